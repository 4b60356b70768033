// Routing statistics of a cache run (the struct the server publishes) and the Belady (optimal
// offline) replay used as the reference for every online policy.
//
// Conventions: counts include routed ids only (padding, id < 0, is excluded everywhere); hits and
// misses count each distinct (layer, expert) of a call once; cold start is included.
//
// Thread-safety: RoutingStats is a plain value, not synchronized.
#ifndef MOE_MOE_CACHE_ROUTING_STATS_H_
#define MOE_MOE_CACHE_ROUTING_STATS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moe_cache/ensure_cpu.h"
#include "moe_cache/trace.h"

namespace moe {
namespace moe_cache {

struct RoutingStats {
  int32_t layers = 0;
  int32_t experts = 0;
  double bytes_per_expert = 0;
  std::vector<uint64_t> counts;  // [layers * experts] routed ids (token-level, padding excluded)
  uint64_t tokens = 0;           // tokens processed (one per step and batch row)
  uint64_t hits = 0;
  uint64_t misses = 0;
  double belady_hit_rate = -1;   // for the same slot count, from a recorded trace; -1 = unknown

  RoutingStats() = default;
  RoutingStats(int32_t num_layers, int32_t num_experts, double bytes)
      : layers(num_layers), experts(num_experts), bytes_per_expert(bytes),
        counts(static_cast<size_t>(num_layers) * num_experts, 0) {}

  // Adds one ensure call's routing (ids [T*k] of `layer`; < 0 is padding) and its outcome.
  // InvalidArgument, adding nothing, for a layer out of range or an id >= experts.
  absl::Status AddCall(int32_t layer, absl::Span<const int32_t> ids, const EnsureCounts& outcome);
  // Counts one step of `tokens` tokens (call once per step, not per layer).
  void AddTokens(uint64_t n) { tokens += n; }

  double hit_rate() const { return hits + misses == 0 ? 0.0 : double(hits) / (hits + misses); }
  double misses_per_token() const { return tokens == 0 ? 0.0 : double(misses) / tokens; }
  double bytes_fetched() const { return double(misses) * bytes_per_expert; }
};

// Hits and misses of a replay.
struct ReplayCounts {
  uint64_t hits = 0;
  uint64_t misses = 0;
  double hit_rate() const { return hits + misses == 0 ? 0.0 : double(hits) / (hits + misses); }
};

// Belady's MIN on `trace` with `slots` slots, one call per (token, layer) in order: on a miss evict
// the resident expert whose next use is furthest in the future (never one used by the current call;
// free slots first). Ids < 0 are padding. InvalidArgument if slots <= 0 or an id >= experts.
absl::StatusOr<ReplayCounts> ReplayBelady(const Trace& trace, int32_t experts, int32_t slots);

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_ROUTING_STATS_H_
