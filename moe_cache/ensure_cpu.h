// The CPU mirror of ensure_experts: the same decisions as the CUDA ensure kernel, victim for
// victim, built from the shared decision core (policy_core.h), plus `CpuExpertCache`, a class that
// owns the host copy of the cache state (used by the simulator, the tests and CPU-only runs).
//
// Thread-safety: EnsureExpertsCpu is a pure function of its arguments; CpuExpertCache is not
// thread-safe (one writer, like the kernel it mirrors).
#ifndef MOE_MOE_CACHE_ENSURE_CPU_H_
#define MOE_MOE_CACHE_ENSURE_CPU_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moe_cache/policy_core.h"

namespace moe {
namespace moe_cache {

// Counts of one call. Hits and misses count each distinct routed (layer, expert) once.
struct EnsureCounts {
  int32_t hits = 0;
  int32_t misses = 0;    // distinct experts that were not resident (placed or not)
  int32_t unplaced = 0;  // misses with no eligible victim (their outputs are -1)
  int32_t cpu = 0;       // misses sent to the CPU by the hybrid split (their outputs: kCpuSlot)
  int32_t padding = 0;   // ids < 0
};

// Runs one ensure_experts call on the state in `st`, in exactly the order documented in
// policy_core.h. `ids` [T*k] row-major; `out_slots` [T*k]; `plan` room for min(T*k, S) entries;
// `used_scratch` [E] scratch bytes. Writes *plan_size. The caller validated layer, sizes and ids
// (CpuExpertCache rejects an id >= E; were one passed here it would be skipped, as the GPU kernel
// skips it after raising its error flag). `fetch_of_misses` [E + 1]: the hybrid split table
// (FetchCount in policy_core.h); null fetches every miss.
void EnsureExpertsCpu(CacheStateView* st, int32_t layer, const int32_t* ids, int32_t num_ids,
                      int32_t* out_slots, MissPlanEntry* plan, int32_t* plan_size,
                      uint8_t* used_scratch, EnsureCounts* counts,
                      const int32_t* fetch_of_misses = nullptr);

struct EnsureResult {
  std::vector<int32_t> slots;        // [T*k] slot per id, -1 for padding / unplaced
  std::vector<MissPlanEntry> plan;   // (global expert, slot) to copy, in order of first occurrence
  EnsureCounts counts;
};

struct CacheConfig {
  int32_t num_layers = 0;
  int32_t num_experts = 0;
  int32_t num_slots = 0;
  PolicyParams params = DefaultPolicyParams(kPolicyLru);
  // The hybrid split table (FetchCount in policy_core.h; hybrid_split.h builds it): empty
  // fetches every miss, else num_experts + 1 entries.
  std::vector<int32_t> fetch_of_misses;
};

// Owns the host state of one cache and runs the mirror on it. Movable, not copyable.
class CpuExpertCache {
 public:
  static absl::StatusOr<CpuExpertCache> Create(const CacheConfig& config);

  CpuExpertCache(CpuExpertCache&&) = default;
  CpuExpertCache& operator=(CpuExpertCache&&) = default;
  CpuExpertCache(const CpuExpertCache&) = delete;
  CpuExpertCache& operator=(const CpuExpertCache&) = delete;

  // ensure_experts(layer, ids [T, k]); ids < 0 are padding. InvalidArgument, with the state
  // unchanged, on a bad layer, ids.size() != T*k or an id >= num_experts.
  absl::StatusOr<EnsureResult> Ensure(int32_t layer, absl::Span<const int32_t> ids, int32_t tokens,
                                      int32_t k);
  // Same, into a caller-owned result (no allocation after warm-up); for the simulator's hot loop.
  absl::Status EnsureInto(int32_t layer, absl::Span<const int32_t> ids, int32_t tokens, int32_t k,
                          EnsureResult* result);

  // Pinning (host side, between steps): pinned experts, once resident, are never evicted.
  void SetPinned(int32_t global_expert, bool pinned) {
    pinned_[global_expert] = pinned ? 1 : 0;
  }
  bool IsPinned(int32_t global_expert) const { return pinned_[global_expert] != 0; }

  const CacheConfig& config() const { return config_; }
  int32_t SlotOf(int32_t global_expert) const { return slot_of_[global_expert]; }
  const std::vector<int32_t>& slot_of() const { return slot_of_; }
  const std::vector<int32_t>& expert_of_slot() const { return expert_of_slot_; }
  const std::vector<uint32_t>& last_use() const { return last_use_; }
  const std::vector<uint32_t>& freq() const { return freq_; }
  uint32_t call_counter() const { return call_counter_; }

 private:
  explicit CpuExpertCache(const CacheConfig& config);
  CacheStateView View();

  CacheConfig config_;
  std::vector<int32_t> slot_of_;
  std::vector<int32_t> expert_of_slot_;
  std::vector<uint32_t> last_use_;
  std::vector<uint32_t> freq_;
  std::vector<uint8_t> pinned_;
  std::vector<uint8_t> used_scratch_;
  uint32_t call_counter_ = 1;
};

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_ENSURE_CPU_H_
