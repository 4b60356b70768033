// BankLayout: how one expert's weights are split into banks (gate_up, down and their scale
// banks) and how many bytes each bank takes per expert, padded to 16 bytes so every expert row
// of every bank starts 16-byte aligned (the gather kernel moves 16-byte vectors).
// Plain value type; thread-compatible.
#ifndef MOE_MOE_CACHE_GPU_BANK_LAYOUT_H_
#define MOE_MOE_CACHE_GPU_BANK_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::moe_cache {

// The most banks an expert may have (gate_up, down, two scale banks, and room for biases).
inline constexpr int kMaxBanks = 8;
// Alignment and granularity of every expert row in every bank.
inline constexpr uint64_t kRowAlignment = 16;

struct BankSpec {
  std::string name;          // "gate_up", "down", "gate_up_scales", ...
  uint64_t bytes = 0;        // payload bytes per expert
  uint64_t pitch = 0;        // bytes rounded up to kRowAlignment (set by BankLayout::Create)
};

class BankLayout {
 public:
  BankLayout() = default;
  // InvalidArgument for no banks, more than kMaxBanks, or a zero-sized bank.
  static absl::StatusOr<BankLayout> Create(std::vector<BankSpec> banks);

  int num_banks() const { return static_cast<int>(banks_.size()); }
  const BankSpec& bank(int b) const { return banks_[b]; }
  // Bytes one expert occupies in a store or a slot, padding included.
  uint64_t padded_bytes_per_expert() const { return padded_bytes_; }
  // Payload bytes of one expert (what a fetch must move at least).
  uint64_t bytes_per_expert() const { return bytes_; }

 private:
  std::vector<BankSpec> banks_;
  uint64_t padded_bytes_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace moe::moe_cache

#endif  // MOE_MOE_CACHE_GPU_BANK_LAYOUT_H_
