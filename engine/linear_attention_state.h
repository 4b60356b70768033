// LinearAttentionState: the per-sequence state of a model's Gated DeltaNet (linear-attention)
// layers, the counterpart of the KV cache for those layers. Its size does not grow with the
// sequence: per slot (one running sequence) and linear-attention layer, the causal conv's last
// conv_kernel - 1 inputs [conv_kernel - 1, conv_dim] and the delta rule's state
// [num_value_heads, key_head_dim, value_head_dim], all f32 (as transformers keeps it).
//
// Layout: slot-major, so one sequence's whole state is contiguous (bytes_per_slot()): for slot
// s, layer i (LinearLayerIndex order) starts at s * slot_stride + i * layer_stride with its conv
// inputs first, then its recurrent state.
//
// A sequence takes a slot when it starts running and gives it back when it ends or is preempted
// (the engine's StateSlotAllocator, engine/forward_model.h, hands out the ids); the model resets
// a slot when a chunk starts at position 0. Owns its memory. Not thread-safe: one caller (the
// engine's Step thread); kernels write distinct slots concurrently.
#ifndef MOE_ENGINE_LINEAR_ATTENTION_STATE_H_
#define MOE_ENGINE_LINEAR_ATTENTION_STATE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/aligned_buffer.h"
#include "engine/model_config.h"

namespace moe::engine {

class LinearAttentionState {
 public:
  // InvalidArgument for num_slots < 1 or a config without linear-attention layers;
  // ResourceExhausted when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<LinearAttentionState>> Create(const ModelConfig& config,
                                                                      int num_slots);

  int num_slots() const { return num_slots_; }
  int num_layers() const { return num_layers_; }
  uint64_t bytes_per_slot() const { return slot_stride_ * sizeof(float); }
  uint64_t bytes() const { return bytes_per_slot() * num_slots_; }
  // Bytes one sequence's state takes for `config` (0 without linear-attention layers).
  static uint64_t BytesPerSequence(const ModelConfig& config);

  // [conv_kernel - 1, conv_dim], oldest input first.
  float* conv(int linear_layer, int slot) { return at(linear_layer, slot); }
  // [num_value_heads, key_head_dim, value_head_dim].
  float* recurrent(int linear_layer, int slot) { return at(linear_layer, slot) + conv_floats_; }
  // Zeros a slot (the state before a sequence's first token).
  void Reset(int slot);

 private:
  LinearAttentionState() = default;
  float* at(int linear_layer, int slot) {
    return data_.data() + static_cast<int64_t>(slot) * slot_stride_ +
           static_cast<int64_t>(linear_layer) * layer_stride_;
  }
  int num_slots_ = 0, num_layers_ = 0;
  int64_t conv_floats_ = 0, layer_stride_ = 0, slot_stride_ = 0;
  common::AlignedBuffer<float> data_;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_LINEAR_ATTENTION_STATE_H_
