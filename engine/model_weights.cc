#include "engine/model_weights.h"

#include "absl/status/statusor.h"
#include "common/expert_view.h"

namespace moe::engine {

const float* Tensor::f32() const {
  return dtype == DType::kF32 ? reinterpret_cast<const float*>(data.data()) : nullptr;
}
const uint16_t* Tensor::bf16() const {
  return dtype == DType::kBf16 ? reinterpret_cast<const uint16_t*>(data.data()) : nullptr;
}
float* Tensor::mutable_f32() {
  return dtype == DType::kF32 ? reinterpret_cast<float*>(data.data()) : nullptr;
}
uint16_t* Tensor::mutable_bf16() {
  return dtype == DType::kBf16 ? reinterpret_cast<uint16_t*>(data.data()) : nullptr;
}
float Tensor::At(int64_t r, int64_t c) const {
  const int64_t i = r * cols + c;
  return dtype == DType::kF32 ? f32()[i] : common::Bf16ToFloat(bf16()[i]);
}

cpu_moe::ExpertBank ModelWeights::ExpertBankFor(int moe_index) const {
  if (experts == nullptr || moe_index < 0 || moe_index >= experts->num_layers()) return {};
  const bool panels = expert_format != common::WeightFormat::kBf16 &&
                      expert_format != common::WeightFormat::kFp8Block;
  common::ExpertLayerView view = experts->LayerView(
      moe_index, expert_format,
      panels ? common::ExpertLayout::kPanels : common::ExpertLayout::kRowMajor,
      config.hidden_size, config.moe_intermediate_size);
  // fp8_block scales of shapes whose per-expert scale rows are not whole 16-byte rows: the
  // store pads them, so cpu_moe reads the loader's dense copies of the scales instead.
  if (expert_format == common::WeightFormat::kFp8Block &&
      moe_index < static_cast<int>(gate_up_scales.size()) &&
      moe_index < static_cast<int>(down_scales.size())) {
    cpu_moe::ExpertBank b;
    b.format = expert_format;
    b.num_experts = view.num_experts;
    b.hidden = view.hidden;
    b.intermediate = view.intermediate;
    b.gate_up_weights = view.gate_up.data;
    b.down_weights = view.down.data;
    b.gate_up_scales = gate_up_scales[moe_index].data();
    b.down_scales = down_scales[moe_index].data();
    return b;
  }
  // Everything else is read in place.
  absl::StatusOr<cpu_moe::ExpertBank> bank = cpu_moe::BankFromView(view);
  return bank.ok() ? *bank : cpu_moe::ExpertBank();
}

}  // namespace moe::engine
