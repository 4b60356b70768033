// Offline cache simulator: replays a routing trace through each eviction policy at a slot count
// and reports hit rate, misses per token and fetched bytes. Online policies run the real CPU mirror
// (CpuExpertCache, the code the GPU kernel mirrors); pinned+scored adds the host HotPinner between
// steps; Belady is the offline optimum (routing_stats.h). Calls are one per (token, layer), in
// order, with T = 1.
//
// Thread-safety: pure functions.
#ifndef MOE_MOE_CACHE_SIMULATOR_H_
#define MOE_MOE_CACHE_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "moe_cache/pinning.h"
#include "moe_cache/policy_core.h"
#include "moe_cache/routing_stats.h"
#include "moe_cache/trace.h"

namespace moe {
namespace moe_cache {

enum class SimPolicy { kLru, kLfu, kScored, kPinnedScored, kBelady };

// "lru", "lfu", "scored", "pinned_scored", "belady".
const char* SimPolicyName(SimPolicy p);
absl::StatusOr<SimPolicy> ParseSimPolicy(absl::string_view name);
std::vector<SimPolicy> AllSimPolicies();

struct SimOptions {
  int32_t experts = 0;               // E; 0 = trace.MaxId() + 1
  double bytes_per_expert = 9.44e6;  // Qwen3-30B-A3B bf16 gate+up+down
  PinningConfig pinning;             // for pinned_scored
  // Scored-policy constants (the policy field is ignored); defaults from policy_core.h.
  PolicyParams scored = DefaultPolicyParams(kPolicyScored);
};

struct SimResult {
  SimPolicy policy = SimPolicy::kLru;
  int32_t slots = 0;
  uint64_t tokens = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  double bytes_per_expert = 0;
  uint64_t pin_swaps = 0;  // pinned_scored only

  double hit_rate() const { return hits + misses == 0 ? 0.0 : double(hits) / (hits + misses); }
  double misses_per_token() const { return tokens == 0 ? 0.0 : double(misses) / tokens; }
  double fetched_gb_per_token() const { return misses_per_token() * bytes_per_expert / 1e9; }
};

// InvalidArgument for slots <= 0, ids >= experts, or an empty trace shape.
absl::StatusOr<SimResult> Simulate(const Trace& trace, SimPolicy policy, int32_t slots,
                                   const SimOptions& options);

// Fraction of the LRU -> Belady hit-rate gap closed by `hit_rate` (0 when the gap is empty).
double GapClosed(double lru, double belady, double hit_rate);

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_SIMULATOR_H_
