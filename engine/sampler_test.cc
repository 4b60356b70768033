// The sampler against direct computations: penalties, each filter, greedy, logprobs, seeded
// reproducibility, and the empirical distribution of draws.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace moe::engine {
namespace {

std::vector<float> Logits() { return {1.0f, 3.0f, -2.0f, 0.5f, 2.5f, 2.9f, -1.0f, 0.0f}; }

std::vector<double> Softmax(const std::vector<double>& l) {
  double m = *std::max_element(l.begin(), l.end()), s = 0;
  std::vector<double> p(l.size());
  for (size_t i = 0; i < l.size(); ++i) s += (p[i] = std::exp(l[i] - m));
  for (double& x : p) x /= s;
  return p;
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  EXPECT_TRUE(p.Validate().ok());
  p.temperature = NAN;
  EXPECT_NE(p.Validate().message().find("temperature"), std::string::npos);
  p = {};
  p.top_p = 1.5f;
  EXPECT_NE(p.Validate().message().find("top_p"), std::string::npos);
  p = {};
  p.min_p = -0.1f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.max_tokens = 0;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.top_logprobs = 21;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.stop_strings = {""};
  EXPECT_FALSE(p.Validate().ok());
}

TEST(SamplerTest, GreedyIsArgmaxAndLogprobsAreLogSoftmax) {
  SamplingParams p;
  SequenceSampler s(p, 1, {});
  const auto l = Logits();
  SampleResult r = s.Sample(l, true, 3);
  EXPECT_EQ(r.token, 1);
  const auto ref = Softmax(std::vector<double>(l.begin(), l.end()));
  EXPECT_NEAR(r.logprob, std::log(ref[1]), 1e-6);
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].token_id, 1);
  EXPECT_EQ(r.top[1].token_id, 5);
  EXPECT_EQ(r.top[2].token_id, 4);
  EXPECT_NEAR(r.top[2].logprob, std::log(ref[4]), 1e-6);
}

TEST(SamplerTest, PenaltiesAsHfAndOpenAiDefineThem) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 2};
  SequenceSampler s(p, 1, prompt);
  s.Accept(4);
  s.Accept(4);
  s.Accept(6);
  const auto l = Logits();
  const auto got = s.Penalized(l);
  std::vector<float> want = l;
  // repetition: prompt and output tokens, divide positive logits, multiply negative ones
  for (int t : {0, 2, 4, 6}) want[t] = want[t] > 0 ? want[t] / 2.0f : want[t] * 2.0f;
  want[4] -= 0.5f + 0.25f * 2;  // output token seen twice
  want[6] -= 0.5f + 0.25f * 1;
  for (size_t i = 0; i < l.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << i;
  // Greedy follows the penalized logits.
  SamplingParams g = p;
  g.repetition_penalty = 100.0f;
  SequenceSampler s2(g, 1, std::vector<int32_t>{1});
  EXPECT_EQ(s2.Sample(l, false, 0).token, 5);
}

TEST(SamplerTest, TopKTopPMinPAgainstDirectComputation) {
  const auto l = Logits();
  const double T = static_cast<double>(0.7f);
  std::vector<double> scaled(l.size());
  for (size_t i = 0; i < l.size(); ++i) scaled[i] = l[i] / T;
  const auto p = Softmax(scaled);
  // Sorted order of p: 1 (3.0), 5 (2.9), 4 (2.5), 0 (1.0), 3 (0.5), 7 (0), 6, 2.
  const std::vector<int> order = {1, 5, 4, 0, 3, 7, 6, 2};
  auto check = [&](SamplingParams sp, std::vector<int> kept) {
    sp.temperature = static_cast<float>(T);
    SequenceSampler s(sp, 1, {});
    const auto got = s.FilteredProbs(l);
    double mass = 0;
    for (int t : kept) mass += p[t];
    for (size_t i = 0; i < l.size(); ++i) {
      const bool in = std::find(kept.begin(), kept.end(), static_cast<int>(i)) != kept.end();
      EXPECT_NEAR(got[i], in ? p[i] / mass : 0.0, 1e-12) << "token " << i;
    }
  };
  SamplingParams sp;
  sp.top_k = 3;
  check(sp, {1, 5, 4});
  // top_p: smallest prefix whose mass reaches top_p (the crossing token stays).
  double cum = 0;
  std::vector<int> nucleus;
  for (int t : order) {
    nucleus.push_back(t);
    cum += p[t];
    if (cum >= 0.8) break;
  }
  sp = {};
  sp.top_p = 0.8f;
  check(sp, nucleus);
  // top_p after top_k, on the renormalised top-k mass.
  sp = {};
  sp.top_k = 3;
  sp.top_p = 0.5f;
  const double k3 = p[1] + p[5] + p[4];
  std::vector<int> kp = {1};
  if (p[1] / k3 < 0.5) kp.push_back(5);
  check(sp, kp);
  // min_p: tokens below min_p * p_max go.
  sp = {};
  sp.min_p = 0.3f;
  std::vector<int> mp;
  for (int t : order) {
    if (p[t] >= 0.3 * p[1]) mp.push_back(t);
  }
  check(sp, mp);
  EXPECT_LT(mp.size(), order.size());
}

TEST(SamplerTest, SameSeedSameTokensAndDrawsFollowTheDistribution) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  const auto l = Logits();
  SequenceSampler a(sp, 42, {}), b(sp, 42, {}), c(sp, 43, {});
  std::vector<int> ta, tb, tc;
  std::vector<int> counts(l.size(), 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    ta.push_back(a.Sample(l, false, 0).token);
    tb.push_back(b.Sample(l, false, 0).token);
    tc.push_back(c.Sample(l, false, 0).token);
    ++counts[ta.back()];
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
  const auto p = Softmax(std::vector<double>(l.begin(), l.end()));
  for (size_t i = 0; i < l.size(); ++i) {
    const double sd = std::sqrt(n * p[i] * (1 - p[i]));
    EXPECT_NEAR(counts[i], n * p[i], 5 * sd + 1) << "token " << i;
  }
}

}  // namespace
}  // namespace moe::engine
