// Bank sizes and SlotBanks from a layout or a pool: host-side helpers of routed_experts.h, built
// with and without CUDA.
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/experts/routed_experts.h"
#include "moe_cache/gpu/slot_pool.h"

namespace moe::engine::gpu {
namespace {

bool HasKernel(WeightFormat format) {
  return format == WeightFormat::kBf16 || format == WeightFormat::kQ4_0 ||
         format == WeightFormat::kFp8Block || format == WeightFormat::kNvfp4;
}

absl::Status CheckShape(WeightFormat format, int hidden, int intermediate) {
  if (!HasKernel(format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("routed experts on the GPU take bf16, q4_0, fp8_block and nvfp4 weights, "
                     "not ",
                     std::string(common::WeightFormatName(format))));
  }
  if (hidden <= 0 || intermediate <= 0 || hidden % 32 != 0 || intermediate % 32 != 0 ||
      hidden > 16384 || intermediate > 16384) {
    return absl::InvalidArgumentError(absl::StrCat("expert shape H=", hidden, " I=", intermediate,
                                                   ": both must be multiples of 32 in [32, 16384]"));
  }
  return absl::OkStatus();
}

// Bytes of a [rows, cols] matrix's codes (and the scales inside them): bf16 2 per weight, fp8 1,
// q4_0 18 per 32, nvfp4 8 + 1 per 16 (panels hold the same bytes as the row-major rows).
uint64_t MatrixBytes(WeightFormat format, uint64_t rows, uint64_t cols) {
  switch (format) {
    case WeightFormat::kBf16:
      return rows * cols * 2;
    case WeightFormat::kFp8Block:
      return rows * cols;
    case WeightFormat::kQ4_0:
      return rows * (cols / 32) * 18;
    default:  // kNvfp4
      return rows * (cols / 2 + cols / 16);
  }
}

// fp8_block's f32 block scales of a [rows, cols] matrix.
uint64_t BlockScaleBytes(uint64_t rows, uint64_t cols) {
  constexpr uint64_t b = common::kFp8BlockSize;
  return (rows + b - 1) / b * ((cols + b - 1) / b) * 4;
}

int FindBank(const moe_cache::BankLayout& layout, std::string_view name) {
  for (int b = 0; b < layout.num_banks(); ++b) {
    if (layout.bank(b).name == name) return b;
  }
  return -1;
}

}  // namespace

absl::StatusOr<std::vector<ExpertBankSize>> ExpertBankSizes(WeightFormat format, int hidden,
                                                            int intermediate) {
  if (absl::Status s = CheckShape(format, hidden, intermediate); !s.ok()) return s;
  const uint64_t H = hidden, I = intermediate;
  const uint64_t gu = MatrixBytes(format, 2 * I, H), dn = MatrixBytes(format, H, I);
  switch (format) {
    case WeightFormat::kFp8Block:
      return std::vector<ExpertBankSize>{{"gate_up", gu},
                                         {"gate_up_scales", BlockScaleBytes(2 * I, H)},
                                         {"down", dn},
                                         {"down_scales", BlockScaleBytes(H, I)}};
    case WeightFormat::kNvfp4:
      return std::vector<ExpertBankSize>{{"gate_up", gu},
                                         {"down", dn},
                                         {"gate_up_global_scale", 4},
                                         {"up_global_scale", 4},
                                         {"down_global_scale", 4}};
    default:
      return std::vector<ExpertBankSize>{{"gate_up", gu}, {"down", dn}};
  }
}

absl::StatusOr<uint64_t> GateUpBankBytes(WeightFormat format, int hidden, int intermediate) {
  if (absl::Status s = CheckShape(format, hidden, intermediate); !s.ok()) return s;
  return MatrixBytes(format, 2 * static_cast<uint64_t>(intermediate), hidden);
}

absl::StatusOr<uint64_t> DownBankBytes(WeightFormat format, int hidden, int intermediate) {
  if (absl::Status s = CheckShape(format, hidden, intermediate); !s.ok()) return s;
  return MatrixBytes(format, hidden, intermediate);
}

absl::StatusOr<SlotBanks> SlotBanksFromLayout(const moe_cache::BankLayout& layout,
                                              const uint8_t* const* bases, int num_slots,
                                              WeightFormat format, int hidden, int intermediate) {
  absl::StatusOr<std::vector<ExpertBankSize>> sizes = ExpertBankSizes(format, hidden, intermediate);
  if (!sizes.ok()) return sizes.status();
  SlotBanks banks;
  banks.format = format;
  banks.hidden = hidden;
  banks.intermediate = intermediate;
  banks.num_slots = num_slots;
  for (const ExpertBankSize& want : *sizes) {
    const int b = FindBank(layout, want.name);
    if (b < 0 || bases[b] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert slots have no \"", std::string(want.name), "\" bank, which ",
                       std::string(common::WeightFormatName(format)), " experts need"));
    }
    if (layout.bank(b).bytes != want.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert slots' \"", std::string(want.name), "\" bank holds ", layout.bank(b).bytes,
          " bytes per expert; ", std::string(common::WeightFormatName(format)), " with H=", hidden,
          " I=", intermediate, " needs ", want.bytes));
    }
    const uint8_t* base = bases[b];
    const uint64_t pitch = layout.bank(b).pitch;
    const std::string_view n = want.name;
    if (n == "gate_up") {
      banks.gate_up = base;
      banks.gate_up_pitch = pitch;
    } else if (n == "down") {
      banks.down = base;
      banks.down_pitch = pitch;
    } else if (n == "gate_up_scales") {
      banks.gate_up_scales = base;
      banks.gate_up_scales_pitch = pitch;
    } else if (n == "down_scales") {
      banks.down_scales = base;
      banks.down_scales_pitch = pitch;
    } else if (n == "gate_up_global_scale") {
      banks.gate_global_scale = base;
      banks.gate_global_scale_pitch = pitch;
    } else if (n == "up_global_scale") {
      banks.up_global_scale = base;
      banks.up_global_scale_pitch = pitch;
    } else {
      banks.down_global_scale = base;
      banks.down_global_scale_pitch = pitch;
    }
  }
  return banks;
}

absl::StatusOr<SlotBanks> SlotBanksFromPool(const moe_cache::SlotPool& pool, WeightFormat format,
                                            int hidden, int intermediate) {
  const moe_cache::BankLayout& layout = pool.layout();
  const uint8_t* bases[moe_cache::kMaxBanks] = {};
  for (int b = 0; b < layout.num_banks() && b < moe_cache::kMaxBanks; ++b) bases[b] = pool.bank(b);
  return SlotBanksFromLayout(layout, bases, pool.num_slots(), format, hidden, intermediate);
}

const uint8_t* SlotBankBase(const SlotBanks& banks, std::string_view name) {
  if (name == "gate_up") return banks.gate_up;
  if (name == "down") return banks.down;
  if (name == "gate_up_scales") return banks.gate_up_scales;
  if (name == "down_scales") return banks.down_scales;
  if (name == "gate_up_global_scale") return banks.gate_global_scale;
  if (name == "up_global_scale") return banks.up_global_scale;
  if (name == "down_global_scale") return banks.down_global_scale;
  return nullptr;
}

}  // namespace moe::engine::gpu
