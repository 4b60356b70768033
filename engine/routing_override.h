// RoutingOverride: recorded routing for benchmarks. A model with random weights routes unlike a
// trained one (its router spreads tokens almost uniformly), which makes expert-cache miss rates
// meaningless; the override replaces the router's choice of experts with a recorded trace
// (moe_cache/trace.h, int [tokens, moe_layers, k]) while the router still runs, so the compute
// stays the model's own:
//
//   - ids: token after token in order, one pass, from the trace's first token (cold start
//     included). Never looped: a looped short trace would flatter a large cache. A batch of R
//     rows takes the next R trace tokens, row r the r-th of them.
//   - weights: the router's softmax probabilities gathered at the forced ids, renormalised over
//     them when the model renormalises its top-k (norm_topk_prob), exactly as for its own choice
//     (ForcedRouteWeights). A padding id (< 0: a cell the recording engine never computed)
//     stays padding: weight 0, skipped by the expert backend and by the cache's counters, as in
//     the offline simulator's replay of the same trace.
//   - past the trace's end: moe_cache's synthetic generator (synthetic_trace.h), its zipf and
//     reuse fitted to the trace's reuse-distance profile (Calibration), and its experts relabelled
//     per layer so that its popularity ranking is the trace's (rank r of the generator's counts
//     -> the trace's r-th most routed expert of that layer): the continuation keeps the trace's
//     hot experts hot instead of switching to an unrelated hot set the moment the trace ends.
//     It is generated in chunks of fresh seeds (never a repeat).
//
// The interface is step-shaped so that the GPU engine can reuse it: Next(rows) gives every MoE
// layer's forced ids of one step at once ([moe_layers, rows, k], ready to be copied to the
// device before a captured step), and ForcedRouteWeights is the reference for a device kernel.
//
// Owns its trace and continuation. Not thread-safe: one caller (the engine's step thread).
#ifndef MOE_ENGINE_ROUTING_OVERRIDE_H_
#define MOE_ENGINE_ROUTING_OVERRIDE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model_config.h"
#include "moe_cache/trace.h"

namespace moe::engine {

// weights[j] = probs[ids[j]] for ids[j] >= 0, divided by the sum over those ids when
// norm_topk_prob (as the model's own top-k); 0 for padding ids (< 0), and all 0 when every id is
// padding. probs [num_experts] (a softmax row), ids and weights [k]. InvalidArgument for an id >=
// num_experts or sizes that differ.
absl::Status ForcedRouteWeights(absl::Span<const float> probs, absl::Span<const int32_t> ids,
                                bool norm_topk_prob, absl::Span<float> weights);

// The statistic the continuation is fitted to: the reuse-distance profile. For each routed id
// (padding excluded), its distance is the number of distinct experts routed at the same layer
// since the token that last routed it (infinite on first use); the profile gives, for slot
// counts S, the fraction of ids whose distance is < S, i.e. the hit rate of a per-layer LRU cache
// of S slots (cold misses included), and the fraction of ids that reuse an expert of the previous
// token at their layer.
struct ReuseProfile {
  std::vector<int32_t> slots;       // S values, increasing
  std::vector<double> hit_rate;     // [slots.size()] fraction of ids at distance < S
  double previous_token_reuse = 0;  // fraction of ids routed at the same layer one token before
  // Share of ids that go to each layer's most routed eighth of the experts (of this trace).
  double top_eighth_share = 0;
};

// slots: e.g. {k, 2k, 4k, 8k} capped at `experts`.
ReuseProfile MeasureReuseProfile(const moe_cache::Trace& trace, int32_t experts,
                                 absl::Span<const int32_t> slots);

struct RoutingCalibration {
  double zipf = 0;
  double reuse = 0;
  ReuseProfile trace;      // measured on the trace
  ReuseProfile generator;  // on the fitted generator's output of the trace's length (seed mean)
  // Share of the continuation's ids (its first chunk) that go to the trace's most routed eighth
  // of each layer's experts: the relabelling's check, against trace.top_eighth_share.
  double continuation_top_eighth_share = 0;
  // One paragraph: the trace's shape, the fitted parameters, each statistic on the trace and on
  // the generator.
  std::string Summary() const;
};

class RoutingOverride {
 public:
  struct Options {
    uint64_t seed = 1;                  // of the continuation (and of the fit's generator runs)
    int32_t continuation_chunk = 4096;  // tokens generated at a time past the trace's end
    // Both >= 0: the continuation's generator parameters as given, without the fit (its search
    // runs the generator some 500 times at the trace's shape: minutes for a long, wide trace);
    // the calibration's generator profile is then left empty.
    double zipf = -1;
    double reuse = -1;
  };

  // Checks the trace against the model: its layers must be config.NumMoeLayers(), its k
  // config.num_experts_per_tok, its ids < config.num_experts and distinct within a row
  // (InvalidArgument naming both numbers otherwise); then fits the continuation.
  static absl::StatusOr<std::unique_ptr<RoutingOverride>> Create(moe_cache::Trace trace,
                                                                 const ModelConfig& config,
                                                                 const Options& options);
  static absl::StatusOr<std::unique_ptr<RoutingOverride>> FromFile(const std::string& path,
                                                                   const ModelConfig& config,
                                                                   const Options& options);

  // The forced ids of the next `rows` tokens for every MoE layer: ids [moe_layers, rows, k]
  // (layer-major: one layer's [rows, k] block is contiguous). Advances by `rows` tokens.
  // InvalidArgument for rows < 0 or a span of the wrong size.
  absl::Status Next(int rows, absl::Span<int32_t> ids);

  // Starts a new pass at the trace's first token (a new run, cold start again); the
  // continuation restarts from the same seed. Next never wraps by itself.
  void Rewind();

  int64_t tokens_served() const { return position_; }
  // Of tokens_served(): how many came from the trace, how many from the generator.
  int64_t trace_tokens_served() const;
  int64_t synthetic_tokens_served() const;
  int32_t moe_layers() const { return trace_.layers; }
  int32_t k() const { return trace_.k; }
  const moe_cache::Trace& trace() const { return trace_; }
  const RoutingCalibration& calibration() const { return calibration_; }

 private:
  RoutingOverride(moe_cache::Trace trace, int32_t experts, const Options& options);
  absl::Status Fit();
  // Fills continuation_ with chunk `index` (relabelled).
  absl::Status GenerateChunk(int64_t index);

  moe_cache::Trace trace_;
  int32_t experts_;
  Options options_;
  RoutingCalibration calibration_;
  // Per layer, experts in decreasing trace count (ties: lower id first).
  std::vector<std::vector<int32_t>> trace_rank_;
  int64_t position_ = 0;
  int64_t chunk_index_ = -1;  // the chunk held in continuation_
  moe_cache::Trace continuation_;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_ROUTING_OVERRIDE_H_
