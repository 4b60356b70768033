// Bank sizes and SlotBanksFromPool: host-side helpers of routed_experts.h, built with and
// without CUDA.
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/experts/routed_experts.h"
#include "moe_cache/gpu/slot_pool.h"

namespace moe::engine::gpu {
namespace {

absl::Status CheckShape(WeightFormat format, int hidden, int intermediate) {
  if (format != WeightFormat::kBf16 && format != WeightFormat::kQ4_0) {
    return absl::InvalidArgumentError(
        absl::StrCat("routed experts on the GPU take bf16 and q4_0 weights, not ",
                     std::string(common::WeightFormatName(format))));
  }
  if (hidden <= 0 || intermediate <= 0 || hidden % 32 != 0 || intermediate % 32 != 0 ||
      hidden > 16384 || intermediate > 16384) {
    return absl::InvalidArgumentError(absl::StrCat("expert shape H=", hidden, " I=", intermediate,
                                                   ": both must be multiples of 32 in [32, 16384]"));
  }
  return absl::OkStatus();
}

// Bytes of a [rows, cols] matrix: bf16 2 per weight, q4_0 18 per 32 (panels hold the same bytes
// as the row-major blocks).
uint64_t MatrixBytes(WeightFormat format, uint64_t rows, uint64_t cols) {
  return format == WeightFormat::kBf16 ? rows * cols * 2 : rows * (cols / 32) * 18;
}

int FindBank(const moe_cache::BankLayout& layout, const char* name) {
  for (int b = 0; b < layout.num_banks(); ++b) {
    if (layout.bank(b).name == name) return b;
  }
  return -1;
}

}  // namespace

absl::StatusOr<uint64_t> GateUpBankBytes(WeightFormat format, int hidden, int intermediate) {
  if (absl::Status s = CheckShape(format, hidden, intermediate); !s.ok()) return s;
  return MatrixBytes(format, 2 * static_cast<uint64_t>(intermediate), hidden);
}

absl::StatusOr<uint64_t> DownBankBytes(WeightFormat format, int hidden, int intermediate) {
  if (absl::Status s = CheckShape(format, hidden, intermediate); !s.ok()) return s;
  return MatrixBytes(format, hidden, intermediate);
}

absl::StatusOr<SlotBanks> SlotBanksFromPool(const moe_cache::SlotPool& pool, WeightFormat format,
                                            int hidden, int intermediate) {
  absl::StatusOr<uint64_t> gu_bytes = GateUpBankBytes(format, hidden, intermediate);
  if (!gu_bytes.ok()) return gu_bytes.status();
  absl::StatusOr<uint64_t> dn_bytes = DownBankBytes(format, hidden, intermediate);
  if (!dn_bytes.ok()) return dn_bytes.status();
  const moe_cache::BankLayout& layout = pool.layout();
  const int gu = FindBank(layout, "gate_up"), dn = FindBank(layout, "down");
  if (gu < 0 || dn < 0) {
    return absl::InvalidArgumentError("slot pool has no \"gate_up\" or no \"down\" bank");
  }
  if (layout.bank(gu).bytes != *gu_bytes || layout.bank(dn).bytes != *dn_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slot pool banks hold ", layout.bank(gu).bytes, " + ", layout.bank(dn).bytes,
        " bytes per expert; ", std::string(common::WeightFormatName(format)), " with H=", hidden,
        " I=", intermediate, " needs ", *gu_bytes, " + ", *dn_bytes));
  }
  SlotBanks banks;
  banks.format = format;
  banks.hidden = hidden;
  banks.intermediate = intermediate;
  banks.num_slots = pool.num_slots();
  banks.gate_up = pool.bank(gu);
  banks.gate_up_pitch = layout.bank(gu).pitch;
  banks.down = pool.bank(dn);
  banks.down_pitch = layout.bank(dn).pitch;
  return banks;
}

}  // namespace moe::engine::gpu
