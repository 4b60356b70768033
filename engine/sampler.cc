#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace moe::engine {

uint64_t Rng::Next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

namespace {

// Largest entry, lowest id on ties (what argmax does in torch on CPU).
int32_t ArgMax(absl::Span<const float> v) {
  int32_t best = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

double LogSumExp(absl::Span<const float> logits) {
  float m = -std::numeric_limits<float>::infinity();
  for (float x : logits) m = std::max(m, x);
  if (!std::isfinite(m)) return m;
  double s = 0.0;
  for (float x : logits) s += std::exp(static_cast<double>(x) - m);
  return m + std::log(s);
}

}  // namespace

float LogSoftmaxAt(absl::Span<const float> logits, int32_t token) {
  return static_cast<float>(logits[token] - LogSumExp(logits));
}

std::vector<TopLogprob> TopLogprobs(absl::Span<const float> logits, int n) {
  n = std::min<int>(n, static_cast<int>(logits.size()));
  if (n <= 0) return {};
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), better);
  const double lse = LogSumExp(logits);
  std::vector<TopLogprob> out(n);
  for (int i = 0; i < n; ++i) {
    out[i] = {ids[i], static_cast<float>(logits[ids[i]] - lse)};
  }
  return out;
}

SequenceSampler::SequenceSampler(const SamplingParams& params, uint64_t seed,
                                 absl::Span<const int32_t> prompt_ids)
    : params_(params), rng_(seed) {
  if (params_.repetition_penalty != 1.0f) {
    prompt_tokens_.insert(prompt_ids.begin(), prompt_ids.end());
  }
}

void SequenceSampler::Accept(int32_t token) { ++output_counts_[token]; }

std::vector<float> SequenceSampler::Penalized(absl::Span<const float> logits) const {
  std::vector<float> l(logits.begin(), logits.end());
  const int vocab = static_cast<int>(l.size());
  // Repetition penalty (CTRL, as HF's RepetitionPenaltyLogitsProcessor): every token seen in the
  // prompt or the output, once, whatever its count.
  if (params_.repetition_penalty != 1.0f) {
    const float p = params_.repetition_penalty;
    auto penalize = [&](int32_t t) {
      if (t < 0 || t >= vocab) return;
      l[t] = l[t] > 0 ? l[t] / p : l[t] * p;
    };
    for (int32_t t : prompt_tokens_) penalize(t);
    for (const auto& [t, count] : output_counts_) {
      if (!prompt_tokens_.contains(t)) penalize(t);
    }
  }
  // Presence and frequency penalties (OpenAI): output tokens only.
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [t, count] : output_counts_) {
      if (t < 0 || t >= vocab) continue;
      l[t] -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
    }
  }
  return l;
}

std::vector<double> SequenceSampler::FilteredProbs(absl::Span<const float> logits) const {
  const std::vector<float> l = Penalized(logits);
  const int vocab = static_cast<int>(l.size());
  const double inv_t = 1.0 / static_cast<double>(params_.temperature);
  double m = -std::numeric_limits<double>::infinity();
  for (float x : l) m = std::max(m, static_cast<double>(x) * inv_t);
  std::vector<double> p(vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) {
    p[i] = std::exp(static_cast<double>(l[i]) * inv_t - m);
    sum += p[i];
  }
  for (double& x : p) x /= sum;

  const bool need_order = params_.top_k > 0 || params_.top_p < 1.0f;
  if (need_order) {
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    int keep = vocab;
    if (params_.top_k > 0 && params_.top_k < vocab) {
      keep = params_.top_k;
      std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), better);
    } else {
      std::sort(ids.begin(), ids.end(), better);
    }
    if (params_.top_p < 1.0f) {
      // On the distribution that top-k left, renormalised; the token that crosses top_p stays.
      double kept_mass = 0.0;
      for (int i = 0; i < keep; ++i) kept_mass += p[ids[i]];
      double cum = 0.0;
      int n = 0;
      while (n < keep) {
        cum += p[ids[n]] / kept_mass;
        ++n;
        if (cum >= params_.top_p) break;
      }
      keep = n;
    }
    std::vector<double> q(vocab, 0.0);
    for (int i = 0; i < keep; ++i) q[ids[i]] = p[ids[i]];
    p.swap(q);
  }
  if (params_.min_p > 0.0f) {
    double pmax = 0.0;
    for (double x : p) pmax = std::max(pmax, x);
    const double threshold = static_cast<double>(params_.min_p) * pmax;
    for (double& x : p) {
      if (x < threshold) x = 0.0;
    }
  }
  double total = 0.0;
  for (double x : p) total += x;
  for (double& x : p) x /= total;
  return p;
}

SampleResult SequenceSampler::Sample(absl::Span<const float> logits, bool want_logprobs,
                                     int top_n) {
  SampleResult result;
  if (params_.temperature == 0.0f) {
    const bool penalized = params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
                           params_.frequency_penalty != 0.0f;
    result.token = penalized ? ArgMax(Penalized(logits)) : ArgMax(logits);
  } else {
    const std::vector<double> p = FilteredProbs(logits);
    // Inverse CDF in id order; the draw is taken even when one token is left so that the RNG
    // advances once per token whatever the filters leave.
    const double u = rng_.Uniform();
    double cum = 0.0;
    int32_t last_nonzero = -1;
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] <= 0.0) continue;
      last_nonzero = static_cast<int32_t>(i);
      cum += p[i];
      if (u < cum) {
        result.token = static_cast<int32_t>(i);
        break;
      }
    }
    if (result.token < 0) result.token = last_nonzero;    // u past the rounded total
    if (result.token < 0) result.token = ArgMax(logits);  // every probability underflowed
  }
  if (want_logprobs) {
    result.logprob = LogSoftmaxAt(logits, result.token);
    result.top = TopLogprobs(logits, top_n);
  }
  Accept(result.token);
  return result;
}

}  // namespace moe::engine
