#include "moe_cache/simulator.h"

#include <algorithm>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "moe_cache/ensure_cpu.h"

namespace moe {
namespace moe_cache {

const char* SimPolicyName(SimPolicy p) {
  switch (p) {
    case SimPolicy::kLru: return "lru";
    case SimPolicy::kLfu: return "lfu";
    case SimPolicy::kScored: return "scored";
    case SimPolicy::kPinnedScored: return "pinned_scored";
    case SimPolicy::kBelady: return "belady";
  }
  return "?";
}

absl::StatusOr<SimPolicy> ParseSimPolicy(absl::string_view name) {
  for (SimPolicy p : AllSimPolicies()) {
    if (name == SimPolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown policy '", name, "' (known: lru, lfu, scored, pinned_scored, belady)"));
}

std::vector<SimPolicy> AllSimPolicies() {
  return {SimPolicy::kLru, SimPolicy::kLfu, SimPolicy::kScored, SimPolicy::kPinnedScored,
          SimPolicy::kBelady};
}

double GapClosed(double lru, double belady, double hit_rate) {
  const double gap = belady - lru;
  if (gap <= 1e-12) return 0.0;
  return (hit_rate - lru) / gap;
}

absl::StatusOr<SimResult> Simulate(const Trace& trace, SimPolicy policy, int32_t slots,
                                   const SimOptions& options) {
  if (slots <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("slots must be positive, got %d", slots));
  }
  if (trace.layers <= 0 || trace.k <= 0) {
    return absl::InvalidArgumentError("trace has no layers or k = 0");
  }
  const int32_t max_id = trace.MaxId();
  const int32_t experts = options.experts > 0 ? options.experts : std::max(1, max_id + 1);
  if (max_id >= experts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "trace has expert id %d but only %d experts were given", max_id, experts));
  }
  SimResult r;
  r.policy = policy;
  r.slots = slots;
  r.tokens = static_cast<uint64_t>(trace.tokens);
  r.bytes_per_expert = options.bytes_per_expert;
  if (policy == SimPolicy::kBelady) {
    auto b = ReplayBelady(trace, experts, slots);
    if (!b.ok()) return b.status();
    r.hits = b->hits;
    r.misses = b->misses;
    return r;
  }
  CacheConfig cfg;
  cfg.num_layers = trace.layers;
  cfg.num_experts = experts;
  cfg.num_slots = slots;
  switch (policy) {
    case SimPolicy::kLru: cfg.params = DefaultPolicyParams(kPolicyLru); break;
    case SimPolicy::kLfu: cfg.params = DefaultPolicyParams(kPolicyLfu); break;
    default:
      cfg.params = options.scored;
      cfg.params.policy = kPolicyScored;
      break;
  }
  auto cache_or = CpuExpertCache::Create(cfg);
  if (!cache_or.ok()) return cache_or.status();
  CpuExpertCache cache = std::move(cache_or).value();
  std::unique_ptr<HotPinner> pinner;
  if (policy == SimPolicy::kPinnedScored) {
    auto p = HotPinner::Create(trace.layers, experts, slots, trace.k, options.pinning);
    if (!p.ok()) return p.status();
    pinner = std::make_unique<HotPinner>(std::move(p).value());
  }
  EnsureResult res;
  for (int32_t t = 0; t < trace.tokens; ++t) {
    for (int32_t l = 0; l < trace.layers; ++l) {
      absl::Span<const int32_t> ids(trace.Row(t, l), trace.k);
      absl::Status s = cache.EnsureInto(l, ids, 1, trace.k, &res);
      if (!s.ok()) return s;
      r.hits += res.counts.hits;
      r.misses += res.counts.misses;
      if (pinner) {
        s = pinner->Observe(l, ids);
        if (!s.ok()) return s;
      }
    }
    if (pinner) {
      for (const PinChange& c : pinner->EndStep()) cache.SetPinned(c.expert, c.pinned);
    }
  }
  if (pinner) r.pin_swaps = pinner->total_swaps();
  return r;
}

}  // namespace moe_cache
}  // namespace moe
