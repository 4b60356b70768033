// SlotPool: S GPU slots with the same bank layout as the ExpertStore ([S, pitch] per bank in
// device memory), one pool shared by all MoE layers. S comes from a byte budget
// (--gpu-expert-budget-gb) or is given directly. Owns its device memory; the slot *map* (which
// expert sits in which slot) belongs to the cache state, not to this class. Thread-compatible.
#ifndef MOE_MOE_CACHE_GPU_SLOT_POOL_H_
#define MOE_MOE_CACHE_GPU_SLOT_POOL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "moe_cache/gpu/bank_layout.h"

namespace moe::moe_cache {

// Slots that fit in `budget_bytes` (padding included), capped at `max_slots` (all experts: more
// slots than experts are never useful). InvalidArgument when not even one fits.
absl::StatusOr<int> SlotsForBudget(uint64_t budget_bytes, const BankLayout& layout,
                                   int max_slots);

class SlotPool {
 public:
  // Unavailable without CUDA or a device; ResourceExhausted when cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<SlotPool>> Create(int num_slots, const BankLayout& layout);
  ~SlotPool();
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  int num_slots() const { return num_slots_; }
  const BankLayout& layout() const { return layout_; }
  // Device base of bank `b`: slot s starts at bank(b) + s * layout().bank(b).pitch.
  uint8_t* bank(int b) const { return banks_[b]; }
  uint64_t total_bytes() const {
    return static_cast<uint64_t>(num_slots_) * layout_.padded_bytes_per_expert();
  }

 private:
  SlotPool() = default;
  int num_slots_ = 0;
  BankLayout layout_;
  uint8_t* banks_[kMaxBanks] = {};
};

}  // namespace moe::moe_cache

#endif  // MOE_MOE_CACHE_GPU_SLOT_POOL_H_
