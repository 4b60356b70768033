#include "engine/model_weights.h"

#include <string_view>

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

namespace {
// Index of the bank called `name` in the store's layout, or -1.
int FindBank(const moe_cache::BankLayout& layout, std::string_view name) {
  for (int b = 0; b < layout.num_banks(); ++b) {
    if (layout.bank(b).name == name) return b;
  }
  return -1;
}
}  // namespace

cpu_moe::ExpertBank ModelWeights::ExpertBankFor(int moe_index) const {
  cpu_moe::ExpertBank bank;
  if (experts == nullptr || moe_index < 0 || moe_index >= experts->num_layers()) return bank;
  const moe_cache::BankLayout& layout = experts->layout();
  const int first = moe_index * experts->num_experts();
  auto base = [&](std::string_view name) -> const void* {
    const int b = FindBank(layout, name);
    return b < 0 ? nullptr : experts->expert_bank(first, b);
  };
  bank.format = expert_format;
  bank.num_experts = experts->num_experts();
  bank.hidden = config.hidden_size;
  bank.intermediate = config.moe_intermediate_size;
  bank.gate_up_weights = base("gate_up");
  bank.down_weights = base("down");
  bank.gate_up_scales = base("gate_up_scales");
  bank.down_scales = base("down_scales");
  if (expert_format == common::WeightFormat::kFp8Block &&
      moe_index < static_cast<int>(gate_up_scales.size()) &&
      moe_index < static_cast<int>(down_scales.size())) {
    bank.gate_up_scales = gate_up_scales[moe_index].data();
    bank.down_scales = down_scales[moe_index].data();
  }
  if (expert_format == common::WeightFormat::kNvfp4 &&
      moe_index < static_cast<int>(gate_up_global_scales.size()) &&
      moe_index < static_cast<int>(down_global_scales.size())) {
    bank.gate_up_global_scales = gate_up_global_scales[moe_index].data();
    bank.down_global_scales = down_global_scales[moe_index].data();
  }
  bank.layout = expert_format == common::WeightFormat::kBf16 ||
                        expert_format == common::WeightFormat::kFp8Block
                    ? cpu_moe::Layout::kRowMajor
                    : cpu_moe::Layout::kPanels;
  return bank;
}

}  // namespace moe::engine
