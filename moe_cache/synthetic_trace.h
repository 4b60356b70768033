// Synthetic routing traces for tuning and testing cache policies.
//
// Model (per layer, per token):
//   - popularity: expert with rank r (1-based) has weight 1 / r^zipf; the rank order is a random
//     permutation per layer (so layers disagree on which experts are hot). zipf = 0 is uniform.
//   - temporal locality: each of the previous token's experts at this layer is kept with
//     probability `reuse`, independently; the remaining picks are drawn from the popularity
//     distribution without replacement, so the k ids of a token are distinct.
// Deterministic for a given seed (own PRNG, independent of the standard library).
//
// Thread-safety: a pure function.
#ifndef MOE_MOE_CACHE_SYNTHETIC_TRACE_H_
#define MOE_MOE_CACHE_SYNTHETIC_TRACE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "moe_cache/trace.h"

namespace moe {
namespace moe_cache {

struct SyntheticTraceConfig {
  int32_t layers = 48;
  int32_t experts = 128;
  int32_t k = 8;
  int32_t tokens = 1000;
  double zipf = 1.0;   // popularity exponent, >= 0
  double reuse = 0.3;  // probability that each previous-token expert is routed again, in [0, 1]
  uint64_t seed = 1;
};

// InvalidArgument on bad parameters (k > experts, negative values, ...).
absl::StatusOr<Trace> GenerateSyntheticTrace(const SyntheticTraceConfig& config);

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_SYNTHETIC_TRACE_H_
