#include "engine/linear_attention_state.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace moe::engine {
namespace {

// Floats of one layer's state: conv inputs, then the recurrent state, rounded up to whole
// 64-byte lines so that every layer starts aligned.
int64_t ConvFloats(const LinearAttentionConfig& la) {
  return static_cast<int64_t>(std::max(la.conv_kernel - 1, 0)) * la.conv_dim();
}
int64_t LayerFloats(const LinearAttentionConfig& la) {
  const int64_t n = ConvFloats(la) +
                    static_cast<int64_t>(la.num_value_heads) * la.key_head_dim * la.value_head_dim;
  return (n + 15) / 16 * 16;
}

}  // namespace

uint64_t LinearAttentionState::BytesPerSequence(const ModelConfig& config) {
  return static_cast<uint64_t>(LayerFloats(config.linear)) * config.NumLinearAttentionLayers() *
         sizeof(float);
}

absl::StatusOr<std::unique_ptr<LinearAttentionState>> LinearAttentionState::Create(
    const ModelConfig& config, int num_slots) {
  const int layers = config.NumLinearAttentionLayers();
  if (num_slots < 1 || layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("linear-attention state: ", num_slots,
                                                   " slots for ", layers,
                                                   " linear-attention layers; both must be >= 1"));
  }
  std::unique_ptr<LinearAttentionState> s(new LinearAttentionState());
  s->num_slots_ = num_slots;
  s->num_layers_ = layers;
  s->conv_floats_ = ConvFloats(config.linear);
  s->layer_stride_ = LayerFloats(config.linear);
  s->slot_stride_ = s->layer_stride_ * layers;
  auto data =
      common::AlignedBuffer<float>::Allocate(static_cast<size_t>(s->slot_stride_) * num_slots);
  if (!data.ok()) {
    return absl::Status(data.status().code(),
                        absl::StrCat("linear-attention state of ", num_slots, " sequences x ",
                                     s->bytes_per_slot(), " bytes: ", data.status().message()));
  }
  // Not cleared here (untouched pages cost nothing): a slot is reset before its first use.
  s->data_ = std::move(*data);
  return s;
}

void LinearAttentionState::Reset(int slot) {
  float* p = data_.data() + static_cast<int64_t>(slot) * slot_stride_;
  std::fill(p, p + slot_stride_, 0.0f);
}

}  // namespace moe::engine
