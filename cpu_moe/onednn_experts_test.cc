// Tests of the oneDNN prefill path (onednn_experts.h) through Forward and directly, against the
// float64 reference of test_bank.h on bf16 banks.
//
// Tolerance (derived, per output element). The oneDNN path differs from the float64 reference by
//   (1) x rounded to bf16 (the GEMM input type): the tests that check elementwise feed x that is
//       already bf16-representable, so this term is zero there;
//   (2) a = act(gate, up) rounded to bf16 once (the down GEMM's input): relative error at most
//       u = 2^-8 per element, so |dy| <= 2^-8 * sum over routes |w| sum_i |D_ji a_i|
//       = 2^-8 * abs_scale (exactly the reference's abs_scale);
//   (3) fp32 accumulation in the GEMMs, swish's fp32 exp and the fp32 scatter-add: the GEMV
//       tests' 2e-4 * abs_scale covers these (a few ulps of 6e-8, grown by sqrt(K) partial sums).
// So |y - ref| <= (2^-8 + 2e-4) * abs_scale + 1e-6. A dropped route moves an output by its whole
// term, about abs_scale / (top_k * sqrt(I)) on average and far more at the worst element, and
// swapped gate/up halves change everything: the negative controls below check that both fail.
// With fp32 x (not bf16-representable), (1) adds a relative error of the same order as (2); the
// relative Frobenius error against the reference is then about 2 * 2^-8 / sqrt(3) ~ 0.5%, checked
// at <= 1%.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/onednn_experts.h"
#include "cpu_moe/test_bank.h"
#include "gtest/gtest.h"

namespace moe::cpu_moe {
namespace {

using common::WeightFormat;
using testing::HostBank;
using testing::MakeRandomBank;
using testing::MakeRouting;
using testing::RelFrobenius;
using testing::Routing;
using testing::ReferenceForward;

constexpr int kE = 16, kH = 256, kI = 160, kTopK = 4;

// Standard normal x times `scale`, rounded to bf16-representable values when `bf16_exact`.
std::vector<float> RandomX(int T, int H, bool bf16_exact, std::mt19937_64& rng,
                           float scale = 1.0f) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * H);
  for (float& v : x) {
    v = scale * n(rng);
    if (bf16_exact) v = common::Bf16ToFloat(common::FloatToBf16(v));
  }
  return x;
}

std::vector<int> RouteCounts(const Routing& r, int E) {
  std::vector<int> c(E, 0);
  for (int32_t e : r.ids) {
    if (e >= 0) ++c[e];
  }
  return c;
}

// max over elements of |y - ref| / tol (<= 1 passes).
double WorstRatio(const std::vector<float>& y, const std::vector<double>& ref,
                  const std::vector<double>& abs_scale) {
  double worst = 0.0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double tol = (std::ldexp(1.0, -8) + 2e-4) * abs_scale[i] + 1e-6;
    const double err = std::fabs(static_cast<double>(y[i]) - ref[i]);
    worst = std::max(worst, std::isfinite(y[i]) ? err / tol : 1e30);
  }
  return worst;
}

// A threshold that splits the routed experts into a oneDNN set and a GEMV set, both non-empty.
int MixedThreshold(const std::vector<int>& counts) {
  std::vector<int> c;
  for (int v : counts) {
    if (v > 0) c.push_back(v);
  }
  std::sort(c.rbegin(), c.rend());
  // The 4th largest count, moved up until something below it is routed.
  int thr = c[std::min<size_t>(3, c.size() - 1)];
  if (thr == c.back()) thr = c.back() + 1;
  return thr;
}

class OnednnExpertsTest : public ::testing::Test {
 protected:
  OnednnExpertsTest() : pool_(2) {}
  common::ThreadPool pool_;
  OnednnExperts onednn_;
};

TEST_F(OnednnExpertsTest, ReportsIsa) {
  std::printf("oneDNN %s, effective ISA %s, %d OpenMP threads\n",
              OnednnExperts::Version().c_str(), OnednnExperts::CpuIsa().c_str(),
              OnednnExperts::MaxThreads());
}

// T in {64, 256} x both activations x threshold {1 (all oneDNN), mixed}, skewed routing, against
// the float64 reference; stats report the oneDNN experts.
TEST_F(OnednnExpertsTest, MatchesReferenceAllAndMixed) {
  std::mt19937_64 rng(2024);
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 41);
  for (int T : {64, 256}) {
    for (Activation act : {Activation::kSwiGlu, Activation::kSwiGluOai}) {
      const Routing r = MakeRouting(T, kE, kTopK, 1.5, rng);
      // swigluoai with a small limit so the clamps bind (gate and up are O(1) here).
      const std::vector<float> x = RandomX(T, kH, true, rng, act == Activation::kSwiGlu ? 1 : 3);
      Options base;
      base.activation = act;
      base.swiglu_limit = 0.5f;
      std::vector<double> ref, scale, flip;
      ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, base, false, &ref, &scale, &flip);
      const std::vector<int> counts = RouteCounts(r, kE);
      const int unique = static_cast<int>(std::count_if(counts.begin(), counts.end(),
                                                        [](int c) { return c > 0; }));
      for (int thr : {1, MixedThreshold(counts)}) {
        const int expect_onednn = static_cast<int>(std::count_if(
            counts.begin(), counts.end(), [&](int c) { return c > 0 && c >= thr; }));
        if (thr > 1) {
          ASSERT_GT(expect_onednn, 0);
          ASSERT_LT(expect_onednn, unique);
        }
        Options o = base;
        o.onednn_min_tokens_per_expert = thr;
        o.onednn_min_experts = 1;
        std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
        ForwardStats st;
        ASSERT_TRUE(
            Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, &st, &onednn_)
                .ok());
        const std::string what = absl::StrCat("T=", T, " act=", static_cast<int>(act),
                                              " threshold=", thr);
        EXPECT_EQ(st.onednn_experts, expect_onednn) << what;
        EXPECT_EQ(st.routes, T * kTopK) << what;
        EXPECT_EQ(st.unique_experts, unique) << what;
        const double worst = WorstRatio(y, ref, scale);
        EXPECT_LE(worst, 1.0) << what;
        std::printf("%s: onednn_experts=%d/%d worst |err|/tol=%.3f rel_frob=%.2e\n",
                    what.c_str(), st.onednn_experts, unique, worst, RelFrobenius(y, ref));
      }
    }
  }
}

// fp32 x that is not bf16-representable (rounding of x is then the oneDNN path's own error), bf16
// x and y, and accumulate; all routes through oneDNN.
TEST_F(OnednnExpertsTest, Fp32InputBf16IoAndAccumulate) {
  std::mt19937_64 rng(17);
  const int T = 64;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 43);
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  const std::vector<float> x = RandomX(T, kH, false, rng);
  Options o;
  o.onednn_min_tokens_per_expert = 1;
  o.onednn_min_experts = 1;
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, o, false, &ref, &scale, &flip);
  std::vector<float> y(x.size());
  ForwardStats st;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, &st, &onednn_)
                  .ok());
  EXPECT_EQ(st.onednn_experts, kE);
  EXPECT_LE(RelFrobenius(y, ref), 1e-2);

  // Accumulate: y = 1 + result.
  std::vector<float> acc(x.size(), 1.0f);
  o.accumulate = true;
  ASSERT_TRUE(
      Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(acc), o, pool_, nullptr, &onednn_).ok());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(acc[i], 1.0f + y[i], 1e-5f) << i;

  // bf16 x and y: one extra bf16 rounding of y (relative 2^-8).
  o.accumulate = false;
  std::vector<uint16_t> xb(x.size()), yb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = common::FloatToBf16(x[i]);
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, xb.data(), DType::kBf16, yb.data(),
                      DType::kBf16, o, pool_, nullptr, &onednn_).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    // x is rounded to bf16 on both paths, so y (fp32 path) and yb differ only by yb's rounding.
    EXPECT_NEAR(common::Bf16ToFloat(yb[i]), y[i], std::ldexp(std::fabs(y[i]), -8) + 1e-6) << i;
  }
}

// Padded rows (ids < 0) are untouched and an inf in a padded x row reaches nothing; partly padded
// tokens keep their real routes.
TEST_F(OnednnExpertsTest, PaddingIsInert) {
  std::mt19937_64 rng(8);
  const int T = 64;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 45);
  Routing r = MakeRouting(T, kE, kTopK, 1.5, rng);
  std::vector<float> x = RandomX(T, kH, true, rng);
  for (int t : {2, 30}) {
    for (int j = 0; j < kTopK; ++j) r.ids[t * kTopK + j] = -1;
    for (int i = 0; i < kH; ++i) x[t * kH + i] = std::numeric_limits<float>::infinity();
  }
  r.ids[4 * kTopK + 1] = -1;
  r.ids[5 * kTopK + 3] = -7;
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, Options(), false, &ref, &scale, &flip);
  const std::vector<int> counts = RouteCounts(r, kE);
  for (int thr : {1, MixedThreshold(counts)}) {
    Options o;
    o.onednn_min_tokens_per_expert = thr;
    o.onednn_min_experts = 1;
    std::vector<float> y(x.size(), 123.0f);
    ForwardStats st;
    ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, &st, &onednn_)
                    .ok());
    EXPECT_GT(st.onednn_experts, 0);
    EXPECT_EQ(st.routes, T * kTopK - 2 * kTopK - 2);
    for (int t : {2, 30}) {
      for (int i = 0; i < kH; ++i) ASSERT_EQ(y[t * kH + i], 123.0f) << "thr=" << thr;
    }
    // Real rows: finite and matching the reference (padded rows' reference is 0, skip them).
    std::vector<float> yr;
    std::vector<double> rr, sr;
    for (int t = 0; t < T; ++t) {
      if (t == 2 || t == 30) continue;
      for (int i = 0; i < kH; ++i) {
        ASSERT_TRUE(std::isfinite(y[t * kH + i]));
        yr.push_back(y[t * kH + i]);
        rr.push_back(ref[t * kH + i]);
        sr.push_back(scale[t * kH + i]);
      }
    }
    EXPECT_LE(WorstRatio(yr, rr, sr), 1.0) << "thr=" << thr;
  }
}

// The GEMV-only result and the oneDNN results agree within the oneDNN tolerance; threshold 0
// and a threshold above every count are the GEMV path exactly.
TEST_F(OnednnExpertsTest, ThresholdOffIsGemvPath) {
  std::mt19937_64 rng(9);
  const int T = 64;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 47);
  const Routing r = MakeRouting(T, kE, kTopK, 1.5, rng);
  const std::vector<float> x = RandomX(T, kH, true, rng);
  std::vector<float> y0(x.size()), y1(x.size()), y2(x.size());
  Options off, high, on;
  off.onednn_min_tokens_per_expert = 0;
  off.onednn_min_experts = 1;
  high.onednn_min_tokens_per_expert = T + 1;
  high.onednn_min_experts = 1;
  on.onednn_min_tokens_per_expert = 1;
  on.onednn_min_experts = 1;
  ForwardStats s0, s1;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y0), off, pool_, &s0, &onednn_)
                  .ok());
  ASSERT_TRUE(
      Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y1), high, pool_, &s1, &onednn_).ok());
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y2), on, pool_, nullptr, &onednn_).ok());
  EXPECT_EQ(s0.onednn_experts, 0);
  EXPECT_EQ(s1.onednn_experts, 0);
  EXPECT_EQ(y0, y1);
  EXPECT_LE(RelFrobenius(y2, std::vector<double>(y0.begin(), y0.end())), 1e-2);
  // Non-bf16 banks never use oneDNN.
  const HostBank q = MakeRandomBank(WeightFormat::kQ4_0, kE, kH, kI, 49, false);
  ForwardStats sq;
  ASSERT_TRUE(Forward(q.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y0), on, pool_, &sq, &onednn_)
                  .ok());
  EXPECT_EQ(sq.onednn_experts, 0);
}

// Both threading modes of the class give the same result, and the primitive cache does not grow
// on a repeated shape.
TEST_F(OnednnExpertsTest, ThreadingModesAgreeAndCacheReuses) {
  std::mt19937_64 rng(10);
  const int T = 256;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 51);
  const Routing r = MakeRouting(T, kE, kTopK, 1.5, rng);
  const std::vector<float> x = RandomX(T, kH, true, rng);
  // Group routes by expert.
  std::vector<int> experts, begin = {0}, tok;
  std::vector<float> wts;
  for (int e = 0; e < kE; ++e) {
    for (int i = 0; i < T * kTopK; ++i) {
      if (r.ids[i] == e) {
        tok.push_back(i / kTopK);
        wts.push_back(r.weights[i]);
      }
    }
    if (static_cast<int>(tok.size()) > begin.back()) {
      experts.push_back(e);
      begin.push_back(static_cast<int>(tok.size()));
    }
  }
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, Options(), false, &ref, &scale, &flip);
  OnednnExperts engine;
  OnednnExpertsWork w;
  w.hidden = kH;
  w.intermediate = kI;
  w.gate_up = reinterpret_cast<const uint16_t*>(hb.gate_up_w.data());
  w.down = reinterpret_cast<const uint16_t*>(hb.down_w.data());
  w.x = x.data();
  w.experts = experts;
  w.group_begin = begin;
  w.route_token = tok;
  w.route_weight = wts;
  std::vector<float> ys(x.size(), 0.0f), yp(x.size(), 0.0f);
  w.y = ys.data();
  w.threading = OnednnThreading::kExpertsSequential;
  ASSERT_TRUE(engine.Run(w).ok());
  const size_t prims = engine.num_primitives();
  EXPECT_GT(prims, 0u);
  w.y = yp.data();
  w.threading = OnednnThreading::kExpertsParallel;
  ASSERT_TRUE(engine.Run(w).ok());
  EXPECT_LE(WorstRatio(ys, ref, scale), 1.0);
  EXPECT_LE(WorstRatio(yp, ref, scale), 1.0);
  std::fill(yp.begin(), yp.end(), 0.0f);
  const size_t prims2 = engine.num_primitives();
  ASSERT_TRUE(engine.Run(w).ok());  // same shapes, same threading: no new primitive
  EXPECT_EQ(engine.num_primitives(), prims2);
  EXPECT_LE(WorstRatio(yp, ref, scale), 1.0);

  // Negative control at the class level: one expert left out of the work fails the check.
  std::vector<float> yd(x.size(), 0.0f);
  w.y = yd.data();
  w.experts = absl::MakeConstSpan(experts).subspan(1);
  w.group_begin = absl::MakeConstSpan(begin).subspan(1);
  ASSERT_TRUE(engine.Run(w).ok());
  EXPECT_GT(WorstRatio(yd, ref, scale), 10.0);
}

// Negative controls through Forward: the same check fails for a dropped oneDNN route, a dropped
// oneDNN expert and swapped gate/up halves.
TEST_F(OnednnExpertsTest, BrokenVariantsFail) {
  std::mt19937_64 rng(11);
  const int T = 64;
  HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 53);
  const Routing r = MakeRouting(T, kE, kTopK, 1.5, rng);
  const std::vector<float> x = RandomX(T, kH, true, rng);
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, Options(), false, &ref, &scale, &flip);
  const std::vector<int> counts = RouteCounts(r, kE);
  const int top = static_cast<int>(std::max_element(counts.begin(), counts.end()) -
                                   counts.begin());
  Options o;
  o.onednn_min_tokens_per_expert = MixedThreshold(counts);
  o.onednn_min_experts = 1;
  ASSERT_GE(counts[top], o.onednn_min_tokens_per_expert);
  std::vector<float> y(x.size());
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, nullptr, &onednn_).ok());
  EXPECT_LE(WorstRatio(y, ref, scale), 1.0);

  // One dropped route of the busiest (oneDNN) expert.
  Routing dropped = r;
  for (size_t i = 0; i < dropped.ids.size(); ++i) {
    if (dropped.ids[i] == top) {
      dropped.ids[i] = -1;
      break;
    }
  }
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, dropped.ids, dropped.weights, x, absl::MakeSpan(y), o,
                      pool_, nullptr, &onednn_).ok());
  EXPECT_GT(WorstRatio(y, ref, scale), 5.0);

  // The whole busiest expert dropped.
  for (int32_t& e : dropped.ids) {
    if (e == top) e = -1;
  }
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, dropped.ids, dropped.weights, x, absl::MakeSpan(y), o,
                      pool_, nullptr, &onednn_).ok());
  EXPECT_GT(WorstRatio(y, ref, scale), 10.0);

  // Gate and up halves swapped in the bank the kernels see (the reference keeps the original).
  std::vector<uint8_t> swapped = hb.gate_up_w;
  const size_t half = static_cast<size_t>(kI) * kH * sizeof(uint16_t);
  for (int e = 0; e < kE; ++e) {
    uint8_t* p = swapped.data() + 2 * half * e;
    std::swap_ranges(p, p + half, p + half);
  }
  ExpertBank bad = hb.bank;
  bad.gate_up_weights = swapped.data();
  o.onednn_min_tokens_per_expert = 1;
  o.onednn_min_experts = 1;
  ASSERT_TRUE(Forward(bad, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, nullptr, &onednn_).ok());
  EXPECT_GT(WorstRatio(y, ref, scale), 10.0);
}

// OnednnConfig: a thread bound applies to the call only (the caller's OpenMP setting is back
// after it) and feeds the default expert threshold (twice the threads); parking the pool or not
// leaves the result alone, and the pool works after a parked call.
TEST_F(OnednnExpertsTest, ConfigBoundsThreadsAndParkingKeepsResults) {
  std::mt19937_64 rng(12);
  const int T = 256;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 55);
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  const std::vector<int> counts = RouteCounts(r, kE);
  ASSERT_TRUE(std::all_of(counts.begin(), counts.end(), [](int c) { return c >= 8; }));
  const std::vector<float> x = RandomX(T, kH, true, rng);
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, Options(), false, &ref, &scale, &flip);
  Options o;
  o.onednn_min_tokens_per_expert = 1;
  o.onednn_min_experts = -1;  // twice the OnednnExperts' threads
  const int caller_threads = OnednnExperts::MaxThreads();
  for (int threads : {kE / 2, kE / 2 + 1}) {
    for (bool park : {true, false}) {
      OnednnConfig c;
      c.num_threads = threads;
      c.park_pool = park;
      OnednnExperts onednn(c);
      EXPECT_EQ(onednn.threads(), threads);
      std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
      ForwardStats st;
      ASSERT_TRUE(
          Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, &st, &onednn)
              .ok());
      const std::string what = absl::StrCat("threads=", threads, " park=", park);
      // 16 experts qualify: enough for 8 threads (16 >= 2 x 8), not for 9.
      EXPECT_EQ(st.onednn_experts, threads == kE / 2 ? kE : 0) << what;
      EXPECT_LE(WorstRatio(y, ref, scale), 1.0) << what;
      EXPECT_EQ(OnednnExperts::MaxThreads(), caller_threads) << what;
      std::atomic<int> tasks{0};
      pool_.ParallelFor(100, [&](uint64_t, int) { tasks.fetch_add(1); });
      EXPECT_EQ(tasks.load(), 100) << what;
    }
  }
}

}  // namespace
}  // namespace moe::cpu_moe
