#include "engine/routing_override.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "moe_cache/synthetic_trace.h"

namespace moe::engine {
namespace {

using moe_cache::Trace;

// Sum over a prefix of per-token counts (a Fenwick tree): the reuse distance of an id is the
// number of experts whose last use lies after its own, i.e. a range sum of "last use here"
// counts.
class Fenwick {
 public:
  explicit Fenwick(int n) : t_(n + 1, 0) {}
  void Add(int i, int v) {
    for (++i; i < static_cast<int>(t_.size()); i += i & -i) t_[i] += v;
  }
  int Prefix(int i) const {  // sum of [0, i)
    int s = 0;
    for (; i > 0; i -= i & -i) s += t_[i];
    return s;
  }

 private:
  std::vector<int> t_;
};

// Per layer, experts in decreasing count over `trace` (ties: lower id first).
std::vector<std::vector<int32_t>> RankByCount(const Trace& trace, int32_t experts) {
  std::vector<std::vector<int32_t>> rank(trace.layers);
  std::vector<int64_t> count(experts);
  for (int32_t l = 0; l < trace.layers; ++l) {
    std::fill(count.begin(), count.end(), 0);
    for (int32_t t = 0; t < trace.tokens; ++t) {
      const int32_t* row = trace.Row(t, l);
      for (int32_t j = 0; j < trace.k; ++j) {
        if (row[j] >= 0) ++count[row[j]];
      }
    }
    rank[l].resize(experts);
    std::iota(rank[l].begin(), rank[l].end(), 0);
    std::stable_sort(rank[l].begin(), rank[l].end(),
                     [&](int32_t a, int32_t b) { return count[a] > count[b]; });
  }
  return rank;
}

// Share of the routed ids of `trace` that go to the first eighth of each layer's `rank`.
double TopEighthShare(const Trace& trace, const std::vector<std::vector<int32_t>>& rank,
                      int32_t experts) {
  const int32_t top = std::max(1, experts / 8);
  int64_t in_top = 0, total = 0;
  std::vector<uint8_t> hot(experts);
  for (int32_t l = 0; l < trace.layers; ++l) {
    std::fill(hot.begin(), hot.end(), 0);
    for (int32_t r = 0; r < top; ++r) hot[rank[l][r]] = 1;
    for (int32_t t = 0; t < trace.tokens; ++t) {
      const int32_t* row = trace.Row(t, l);
      for (int32_t j = 0; j < trace.k; ++j) {
        if (row[j] < 0) continue;
        ++total;
        in_top += hot[row[j]];
      }
    }
  }
  return total == 0 ? 0.0 : static_cast<double>(in_top) / total;
}

// The fit's objective: squared differences of the LRU hit rates and of the previous-token reuse,
// equally weighted (what a cache sees). The top-eighth share is reported, not fitted: with two
// parameters the generator cannot match it as well on real routing, whose per-layer working set
// is narrower than a zipf tail, and the hit rates matter more to a cache benchmark.
double ProfileDistance(const ReuseProfile& a, const ReuseProfile& b) {
  double d = 0;
  for (size_t i = 0; i < a.hit_rate.size(); ++i) {
    d += (a.hit_rate[i] - b.hit_rate[i]) * (a.hit_rate[i] - b.hit_rate[i]);
  }
  d += (a.previous_token_reuse - b.previous_token_reuse) *
       (a.previous_token_reuse - b.previous_token_reuse);
  return d;
}

// The profile of the generator at (zipf, reuse), averaged over `seeds` runs of `base`'s shape.
absl::StatusOr<ReuseProfile> GeneratorProfile(const moe_cache::SyntheticTraceConfig& base,
                                              double zipf, double reuse, int seeds,
                                              absl::Span<const int32_t> slots) {
  ReuseProfile mean;
  mean.slots.assign(slots.begin(), slots.end());
  mean.hit_rate.assign(slots.size(), 0.0);
  for (int s = 0; s < seeds; ++s) {
    moe_cache::SyntheticTraceConfig c = base;
    c.zipf = zipf;
    c.reuse = reuse;
    c.seed = base.seed + 1000003ull * static_cast<uint64_t>(s + 1);
    ASSIGN_OR_RETURN(Trace t, moe_cache::GenerateSyntheticTrace(c));
    const ReuseProfile p = MeasureReuseProfile(t, c.experts, slots);
    for (size_t i = 0; i < slots.size(); ++i) mean.hit_rate[i] += p.hit_rate[i] / seeds;
    mean.previous_token_reuse += p.previous_token_reuse / seeds;
    mean.top_eighth_share += p.top_eighth_share / seeds;
  }
  return mean;
}

}  // namespace

absl::Status ForcedRouteWeights(absl::Span<const float> probs, absl::Span<const int32_t> ids,
                                bool norm_topk_prob, absl::Span<float> weights) {
  if (ids.size() != weights.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids.size(), " forced ids but ", weights.size(), " weights"));
  }
  const int64_t E = static_cast<int64_t>(probs.size());
  float sum = 0.0f;
  for (size_t j = 0; j < ids.size(); ++j) {
    if (ids[j] >= E) {
      return absl::InvalidArgumentError(
          absl::StrCat("forced expert id ", ids[j], " outside [0, ", E, ")"));
    }
    weights[j] = ids[j] < 0 ? 0.0f : probs[ids[j]];
    sum += weights[j];
  }
  // As the model's own top-k: the same f32 sum in slot order, then one division per weight.
  if (norm_topk_prob && sum > 0.0f) {
    for (float& w : weights) w /= sum;
  }
  return absl::OkStatus();
}

ReuseProfile MeasureReuseProfile(const Trace& trace, int32_t experts,
                                 absl::Span<const int32_t> slots) {
  ReuseProfile p;
  p.slots.assign(slots.begin(), slots.end());
  p.hit_rate.assign(slots.size(), 0.0);
  std::vector<int64_t> hits(slots.size(), 0);
  int64_t ids = 0, later_ids = 0, previous = 0;
  std::vector<int32_t> last_use(experts);
  for (int32_t l = 0; l < trace.layers; ++l) {
    std::fill(last_use.begin(), last_use.end(), -1);
    Fenwick at(trace.tokens);  // at[t]: experts whose last use at this layer is token t
    for (int32_t t = 0; t < trace.tokens; ++t) {
      const int32_t* row = trace.Row(t, l);
      const int before_t = at.Prefix(t);
      for (int32_t j = 0; j < trace.k; ++j) {
        const int32_t e = row[j];
        if (e < 0 || e >= experts) continue;
        ++ids;
        if (t > 0) ++later_ids;
        if (last_use[e] < 0) continue;  // cold: infinite distance
        previous += last_use[e] == t - 1;
        const int distance = before_t - at.Prefix(last_use[e] + 1);
        for (size_t s = 0; s < slots.size(); ++s) hits[s] += distance < slots[s];
      }
      for (int32_t j = 0; j < trace.k; ++j) {
        const int32_t e = row[j];
        if (e < 0 || e >= experts) continue;
        if (last_use[e] >= 0) at.Add(last_use[e], -1);
        at.Add(t, 1);
        last_use[e] = t;
      }
    }
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    p.hit_rate[s] = ids == 0 ? 0.0 : static_cast<double>(hits[s]) / ids;
  }
  p.previous_token_reuse = later_ids == 0 ? 0.0 : static_cast<double>(previous) / later_ids;
  p.top_eighth_share = TopEighthShare(trace, RankByCount(trace, experts), experts);
  return p;
}

std::string RoutingCalibration::Summary() const {
  if (generator.hit_rate.size() != trace.hit_rate.size()) {
    return absl::StrFormat(
        "continuation past the trace's end: synthetic routing with zipf %.3f, reuse %.3f as "
        "given (not fitted); share of each layer's top eighth of experts %.3f (continuation: "
        "%.3f)",
        zipf, reuse, trace.top_eighth_share, continuation_top_eighth_share);
  }
  std::string s = absl::StrFormat(
      "continuation past the trace's end: synthetic routing with zipf %.3f, reuse %.3f, fitted "
      "to the trace's reuse-distance profile (trace / generator at the trace's length): "
      "per-layer LRU hit rate",
      zipf, reuse);
  for (size_t i = 0; i < trace.slots.size(); ++i) {
    absl::StrAppendFormat(&s, "%s at %d slots %.3f / %.3f", i == 0 ? "" : ",", trace.slots[i],
                          trace.hit_rate[i], generator.hit_rate[i]);
  }
  absl::StrAppendFormat(&s,
                        "; previous-token reuse %.3f / %.3f; share of each layer's top eighth of "
                        "experts %.3f / %.3f (continuation, on the trace's own top eighth: %.3f)",
                        trace.previous_token_reuse, generator.previous_token_reuse,
                        trace.top_eighth_share, generator.top_eighth_share,
                        continuation_top_eighth_share);
  return s;
}

RoutingOverride::RoutingOverride(Trace trace, int32_t experts, const Options& options)
    : trace_(std::move(trace)), experts_(experts), options_(options) {}

absl::StatusOr<std::unique_ptr<RoutingOverride>> RoutingOverride::FromFile(
    const std::string& path, const ModelConfig& config, const Options& options) {
  auto trace = moe_cache::ReadNpyTrace(path);
  if (!trace.ok()) {
    return absl::Status(trace.status().code(),
                        absl::StrCat("--routing-trace ", path, ": ", trace.status().message()));
  }
  return Create(*std::move(trace), config, options);
}

absl::StatusOr<std::unique_ptr<RoutingOverride>> RoutingOverride::Create(Trace trace,
                                                                         const ModelConfig& config,
                                                                         const Options& options) {
  if (trace.tokens <= 0) return absl::InvalidArgumentError("routing trace holds no tokens");
  if (trace.layers != config.NumMoeLayers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "routing trace has ", trace.layers, " MoE layers, the model ", config.NumMoeLayers()));
  }
  if (trace.k != config.num_experts_per_tok) {
    return absl::InvalidArgumentError(
        absl::StrCat("routing trace routes ", trace.k, " experts per token, the model's ",
                     "num_experts_per_tok is ", config.num_experts_per_tok));
  }
  if (trace.MaxId() >= config.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("routing trace routes expert ", trace.MaxId(),
                                                   ", the model has ", config.num_experts,
                                                   " experts per MoE layer"));
  }
  if (options.continuation_chunk <= 0) {
    return absl::InvalidArgumentError("continuation_chunk must be > 0");
  }
  for (int32_t t = 0; t < trace.tokens; ++t) {
    for (int32_t l = 0; l < trace.layers; ++l) {
      const int32_t* row = trace.Row(t, l);
      for (int32_t i = 0; i < trace.k; ++i) {
        for (int32_t j = 0; j < i; ++j) {
          if (row[i] >= 0 && row[i] == row[j]) {
            return absl::InvalidArgumentError(absl::StrCat("routing trace token ", t, " layer ", l,
                                                           " routes expert ", row[i], " twice"));
          }
        }
      }
    }
  }
  std::unique_ptr<RoutingOverride> o(
      new RoutingOverride(std::move(trace), config.num_experts, options));
  RETURN_IF_ERROR(o->Fit());
  return o;
}

absl::Status RoutingOverride::Fit() {
  const int32_t k = trace_.k, E = experts_;
  std::vector<int32_t> slots;
  for (int32_t s = k; s <= 8 * k; s *= 2) slots.push_back(std::min(s, E));
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  calibration_.trace = MeasureReuseProfile(trace_, E, slots);
  trace_rank_ = RankByCount(trace_, E);
  if (options_.zipf >= 0 && options_.reuse >= 0) {
    calibration_.zipf = options_.zipf;
    calibration_.reuse = options_.reuse;
    RETURN_IF_ERROR(GenerateChunk(0));
    calibration_.continuation_top_eighth_share = TopEighthShare(continuation_, trace_rank_, E);
    return absl::OkStatus();
  }

  moe_cache::SyntheticTraceConfig base;
  base.layers = trace_.layers;
  base.experts = E;
  base.k = k;
  base.tokens = trace_.tokens;
  base.seed = options_.seed;
  // A coarse grid over the generator's two parameters, then a finer one around the best point
  // with more seeds (the profile of a short trace is noisy).
  double best_zipf = 0, best_reuse = 0, best = std::numeric_limits<double>::infinity();
  // Points z0 + i * dz for i in [0, nz] (likewise r), kept inside the parameters' ranges.
  auto search = [&](double z0, double dz, int nz, double r0, double dr, int nr,
                    int seeds) -> absl::Status {
    for (int i = 0; i <= nz; ++i) {
      const double z = z0 + i * dz;
      if (z < 0) continue;
      for (int j = 0; j <= nr; ++j) {
        const double r = r0 + j * dr;
        if (r < 0 || r > 1) continue;
        ASSIGN_OR_RETURN(ReuseProfile p, GeneratorProfile(base, z, r, seeds, slots));
        const double d = ProfileDistance(p, calibration_.trace);
        if (d < best) {
          best = d;
          best_zipf = z;
          best_reuse = r;
        }
      }
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(search(0.0, 0.1, 20, 0.0, 0.05, 19, 2));
  const double z = best_zipf, r = best_reuse;
  best = std::numeric_limits<double>::infinity();
  RETURN_IF_ERROR(search(z - 0.1, 0.025, 8, r - 0.05, 0.0125, 8, 4));
  calibration_.zipf = best_zipf;
  calibration_.reuse = best_reuse;
  ASSIGN_OR_RETURN(calibration_.generator, GeneratorProfile(base, best_zipf, best_reuse, 4, slots));
  RETURN_IF_ERROR(GenerateChunk(0));
  calibration_.continuation_top_eighth_share = TopEighthShare(continuation_, trace_rank_, E);
  return absl::OkStatus();
}

absl::Status RoutingOverride::GenerateChunk(int64_t index) {
  moe_cache::SyntheticTraceConfig c;
  c.layers = trace_.layers;
  c.experts = experts_;
  c.k = trace_.k;
  c.tokens = options_.continuation_chunk;
  c.zipf = calibration_.zipf;
  c.reuse = calibration_.reuse;
  c.seed = options_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) + 1;
  ASSIGN_OR_RETURN(continuation_, moe_cache::GenerateSyntheticTrace(c));
  // Relabel: the generator's r-th most routed expert of a layer becomes the trace's r-th.
  const std::vector<std::vector<int32_t>> gen_rank = RankByCount(continuation_, experts_);
  std::vector<int32_t> relabel(experts_);
  for (int32_t l = 0; l < c.layers; ++l) {
    for (int32_t r = 0; r < experts_; ++r) relabel[gen_rank[l][r]] = trace_rank_[l][r];
    for (int32_t t = 0; t < c.tokens; ++t) {
      int32_t* row = continuation_.ids.data() + (static_cast<size_t>(t) * c.layers + l) * c.k;
      for (int32_t j = 0; j < c.k; ++j) row[j] = relabel[row[j]];
    }
  }
  chunk_index_ = index;
  return absl::OkStatus();
}

absl::Status RoutingOverride::Next(int rows, absl::Span<int32_t> ids) {
  const int32_t L = trace_.layers, k = trace_.k;
  if (rows < 0 || ids.size() != static_cast<size_t>(rows) * L * k) {
    return absl::InvalidArgumentError(absl::StrCat("RoutingOverride::Next: ", rows, " rows need ",
                                                   static_cast<int64_t>(rows) * L * k,
                                                   " ids, the span holds ", ids.size()));
  }
  for (int i = 0; i < rows; ++i) {
    const int64_t token = position_ + i;
    const Trace* src = &trace_;
    int64_t t = token;
    if (token >= trace_.tokens) {
      const int64_t c = token - trace_.tokens;
      const int64_t chunk = c / options_.continuation_chunk;
      if (chunk != chunk_index_) RETURN_IF_ERROR(GenerateChunk(chunk));
      src = &continuation_;
      t = c % options_.continuation_chunk;
    }
    for (int32_t l = 0; l < L; ++l) {
      std::copy_n(src->Row(static_cast<int32_t>(t), l), k,
                  ids.data() + (static_cast<size_t>(l) * rows + i) * k);
    }
  }
  position_ += rows;
  return absl::OkStatus();
}

void RoutingOverride::Rewind() { position_ = 0; }

int64_t RoutingOverride::trace_tokens_served() const {
  return std::min<int64_t>(position_, trace_.tokens);
}

int64_t RoutingOverride::synthetic_tokens_served() const {
  return position_ - trace_tokens_served();
}

}  // namespace moe::engine
