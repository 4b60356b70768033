#include "moe_cache/synthetic_trace.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe {
namespace moe_cache {
namespace {

// SplitMix64: small, fast and the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t s_;
};

}  // namespace

absl::StatusOr<Trace> GenerateSyntheticTrace(const SyntheticTraceConfig& c) {
  if (c.layers <= 0 || c.experts <= 0 || c.k <= 0 || c.tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "synthetic trace needs positive layers, experts, topk and tokens >= 0 (got %d, %d, %d, %d)",
        c.layers, c.experts, c.k, c.tokens));
  }
  if (c.k > c.experts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("topk %d exceeds the number of experts %d", c.k, c.experts));
  }
  if (!(c.zipf >= 0) || !std::isfinite(c.zipf)) {
    return absl::InvalidArgumentError(absl::StrFormat("zipf must be >= 0, got %g", c.zipf));
  }
  if (!(c.reuse >= 0 && c.reuse <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("reuse must be in [0, 1], got %g", c.reuse));
  }
  if (static_cast<int64_t>(c.tokens) * c.layers * c.k > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("synthetic trace too large");
  }
  Rng rng(c.seed);
  const int32_t E = c.experts;
  // Per layer cumulative distribution over experts (rank permuted).
  std::vector<std::vector<double>> cdf(c.layers, std::vector<double>(E));
  for (int32_t l = 0; l < c.layers; ++l) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    for (int32_t i = E - 1; i > 0; --i) std::swap(perm[i], perm[rng.Below(i + 1)]);
    std::vector<double> w(E);
    for (int32_t r = 0; r < E; ++r) w[perm[r]] = 1.0 / std::pow(r + 1.0, c.zipf);
    double acc = 0;
    for (int32_t e = 0; e < E; ++e) cdf[l][e] = (acc += w[e]);
    for (double& v : cdf[l]) v /= acc;
  }
  Trace t;
  t.tokens = c.tokens;
  t.layers = c.layers;
  t.k = c.k;
  t.ids.assign(static_cast<size_t>(c.tokens) * c.layers * c.k, -1);
  std::vector<uint8_t> taken(E);
  for (int32_t tok = 0; tok < c.tokens; ++tok) {
    for (int32_t l = 0; l < c.layers; ++l) {
      int32_t* row = t.ids.data() + (static_cast<size_t>(tok) * c.layers + l) * c.k;
      std::fill(taken.begin(), taken.end(), 0);
      int32_t n = 0;
      if (tok > 0) {
        const int32_t* prev = t.Row(tok - 1, l);
        for (int32_t j = 0; j < c.k; ++j) {
          if (rng.Uniform() < c.reuse) {
            row[n++] = prev[j];
            taken[prev[j]] = 1;
          }
        }
      }
      int32_t attempts = 0;
      while (n < c.k) {
        if (++attempts > 64 * c.k) {  // extreme skew: finish with the first free experts
          for (int32_t e = 0; e < E && n < c.k; ++e) {
            if (!taken[e]) {
              taken[e] = 1;
              row[n++] = e;
            }
          }
          break;
        }
        const double u = rng.Uniform();
        int32_t e = static_cast<int32_t>(
            std::upper_bound(cdf[l].begin(), cdf[l].end(), u) - cdf[l].begin());
        if (e >= E) e = E - 1;
        if (taken[e]) continue;  // rejection keeps the k ids distinct
        taken[e] = 1;
        row[n++] = e;
      }
    }
  }
  return t;
}

}  // namespace moe_cache
}  // namespace moe
