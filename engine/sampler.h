// Sampler: picks the next token of one sequence from its logits, as Hugging Face's generate and
// vLLM do: penalties (repetition over prompt and output, presence and frequency over the
// output), then greedy (temperature 0) or temperature, top-k, top-p (on the distribution left by
// top-k), min-p (relative to the most likely token), and a draw from what is left.
//
// Each sequence carries its own SequenceSampler with its own RNG, so a seeded request gives the
// same tokens whatever else is in the batch. Not thread-safe: one per sequence, used by one
// thread at a time (different sequences may be sampled concurrently).
#ifndef MOE_ENGINE_SAMPLER_H_
#define MOE_ENGINE_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/types/span.h"
#include "engine/engine.h"

namespace moe::engine {

// SplitMix64: small, fast and the same on every platform (std::mt19937 is too, but the
// distributions of <random> are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  // Uniform in [0, 1) with 53 random bits.
  double Uniform();

 private:
  uint64_t state_;
};

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;         // of `token` under the model's raw distribution
  std::vector<TopLogprob> top;  // the n most likely tokens under that distribution
};

class SequenceSampler {
 public:
  // `params` must be valid (SamplingParams::Validate). The prompt feeds the repetition penalty.
  SequenceSampler(const SamplingParams& params, uint64_t seed,
                  absl::Span<const int32_t> prompt_ids);

  // Samples from `logits` [vocab] (not modified) and records the token as output. Logprobs
  // (log-softmax of the raw logits, before penalties and temperature) are filled when
  // `want_logprobs`; `top_n` most likely tokens with them.
  SampleResult Sample(absl::Span<const float> logits, bool want_logprobs, int top_n);
  // Records a token the sampler did not choose (a forced output token) as output.
  void Accept(int32_t token);

  // The logits after penalties (what temperature and the filters see); for tests.
  std::vector<float> Penalized(absl::Span<const float> logits) const;
  // Probabilities over the vocabulary after penalties, temperature and the top-k, top-p and
  // min-p filters, renormalised (temperature > 0 only); for tests and for Sample.
  std::vector<double> FilteredProbs(absl::Span<const float> logits) const;

 private:
  SamplingParams params_;
  Rng rng_;
  absl::flat_hash_set<int32_t> prompt_tokens_;
  absl::flat_hash_map<int32_t, int> output_counts_;
};

// log-softmax of `logits` at `token`, and the n largest entries (ties: lower id first).
float LogSoftmaxAt(absl::Span<const float> logits, int32_t token);
std::vector<TopLogprob> TopLogprobs(absl::Span<const float> logits, int n);

}  // namespace moe::engine

#endif  // MOE_ENGINE_SAMPLER_H_
