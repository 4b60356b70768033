// token_ops.h against float64 references and the CPU engine's own kernels (RmsNormRows,
// RopeTable, the router and argmax rules of model.cc and sampler.cc) on fresh random inputs
// (the seed is printed), with odd sizes, outputs poisoned with NaN and checked fully written.
// GPU test: skips without a GPU.
#include "engine/cuda/ops/token_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/formats.h"
#include "common/gpu_test_util.h"
#include "engine/cuda/ops/rope_table.h"
#include "engine/kernels.h"
#include "engine/model_config.h"
#include "engine/rope.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include "engine/cuda/ops/ops_test_util.h"

namespace moe::engine::gpu {
namespace {

using testing::DeviceArray;
using testing::RandomBf16;
using testing::RandomF32;
using testing::Rng;

constexpr int kTokenCounts[] = {1, 3, 64};

uint64_t SeedForTest() {
  const uint64_t seed = testing::FreshSeed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(TokenOpsTest, EmbeddingGatherWidensRowsAndZeroesPadding) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  const int vocab = 1031;
  for (int hidden : {2048, 1000, 33}) {
    const std::vector<uint16_t> table = RandomBf16(rng, static_cast<size_t>(vocab) * hidden, -2, 2);
    DeviceArray<uint16_t> d_table(table);
    for (int T : kTokenCounts) {
      SCOPED_TRACE(::testing::Message() << "hidden " << hidden << " T " << T);
      std::vector<int32_t> ids(T);
      for (int32_t& id : ids) id = rng.Int(vocab);
      if (T >= 3) {
        ids[1] = -1;     // padding
        ids[2] = vocab;  // out of range
      }
      DeviceArray<int32_t> d_ids(ids);
      DeviceArray<float> d_out(static_cast<size_t>(T) * hidden);
      d_out.Poison();
      ASSERT_TRUE(
          LaunchEmbeddingGather(d_table.get(), vocab, hidden, d_ids.get(), T, d_out.get(), nullptr)
              .ok());
      const std::vector<float> out = d_out.Download();
      for (int t = 0; t < T; ++t) {
        const bool valid = ids[t] >= 0 && ids[t] < vocab;
        for (int i = 0; i < hidden; ++i) {
          const float want =
              valid ? common::Bf16ToFloat(table[static_cast<size_t>(ids[t]) * hidden + i]) : 0.0f;
          ASSERT_EQ(Bits(out[static_cast<size_t>(t) * hidden + i]), Bits(want)) << t << "," << i;
        }
      }
    }
  }
}

TEST(TokenOpsTest, RmsNormMatchesFloat64AndTheCpuKernel) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  const float eps = 1e-6f;
  for (int n : {2048, 1000, 4097, 7}) {
    const std::vector<float> w = RandomF32(rng, n, 0.5f, 1.5f);
    DeviceArray<float> d_w(w);
    for (int T : kTokenCounts) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " T " << T);
      const std::vector<float> x = RandomF32(rng, static_cast<size_t>(T) * n, -3, 3);
      DeviceArray<float> d_x(x);
      DeviceArray<float> d_out(x.size());
      DeviceArray<uint16_t> d_bf(x.size());
      d_out.Poison();
      d_bf.Poison();
      ASSERT_TRUE(
          LaunchRmsNorm(d_x.get(), T, n, d_w.get(), eps, d_out.get(), d_bf.get(), nullptr).ok());
      const std::vector<float> out = d_out.Download();
      const std::vector<uint16_t> bf = d_bf.Download();
      std::vector<float> cpu(x.size());
      RmsNormRows(x.data(), T, n, w.data(), eps, cpu.data());
      for (int t = 0; t < T; ++t) {
        const float* xr = x.data() + static_cast<size_t>(t) * n;
        double ss = 0;
        for (int i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
        const double inv = 1.0 / std::sqrt(ss / n + eps);
        for (int i = 0; i < n; ++i) {
          const size_t at = static_cast<size_t>(t) * n + i;
          const double ref = static_cast<double>(w[i]) * xr[i] * inv;
          // f32: the mean square differs by summation order only (far under 1e-6 relative),
          // then two roundings per element.
          ASSERT_NEAR(out[at], ref, 2e-6 * std::fabs(ref) + 1e-7) << t << "," << i;
          ASSERT_NEAR(out[at], cpu[at], 2e-6 * std::fabs(cpu[at]) + 1e-7) << t << "," << i;
          ASSERT_EQ(bf[at], common::FloatToBf16(out[at])) << t << "," << i;
        }
      }
      // In place, bf16 output only.
      DeviceArray<uint16_t> d_bf2(x.size());
      d_bf2.Poison();
      ASSERT_TRUE(
          LaunchRmsNorm(d_x.get(), T, n, d_w.get(), eps, nullptr, d_bf2.get(), nullptr).ok());
      EXPECT_EQ(d_bf2.Download(), bf);
      ASSERT_TRUE(LaunchRmsNorm(d_x.get(), T, n, d_w.get(), eps, d_x.get(), nullptr, nullptr).ok());
      const std::vector<float> inplace = d_x.Download();
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(inplace[i]), Bits(out[i])) << i;
    }
  }
  EXPECT_EQ(LaunchRmsNorm(nullptr, 1, 8, nullptr, eps, nullptr, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

ModelConfig RopeConfig(bool yarn, int head_dim, double partial = 1.0) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.partial_rotary_factor = partial;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = yarn ? 131072 : 40960;
  if (yarn) {
    c.rope_scaling.type = "yarn";
    c.rope_scaling.factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 32768;
  }
  return c;
}

// The GPU's q/k path against the CPU engine's: RmsNormRows over heads, then RopeTable::Apply.
void CheckQkNormRope(Rng& rng, bool yarn, bool norm, bool rope, int T, int nq, int nkv, int hd,
                     double partial = 1.0) {
  SCOPED_TRACE(::testing::Message() << "yarn " << yarn << " norm " << norm << " rope " << rope
                                    << " T " << T << " heads " << nq << "/" << nkv << " hd " << hd
                                    << " partial " << partial);
  const int max_pos = 32768;
  auto params = ComputeRopeParams(RopeConfig(yarn, hd, partial));
  ASSERT_TRUE(params.ok()) << params.status();
  auto host = BuildRopeCosSin(*params, hd, max_pos);
  ASSERT_TRUE(host.ok());
  auto table = DeviceRopeTable::Create(*host);
  ASSERT_TRUE(table.ok()) << table.status();
  const RopeTable cpu_rope(*params, hd, max_pos);
  const float eps = 1e-6f;

  std::vector<float> q = RandomF32(rng, static_cast<size_t>(T) * nq * hd, -4, 4);
  std::vector<float> k = RandomF32(rng, static_cast<size_t>(T) * nkv * hd, -4, 4);
  const std::vector<float> qw = RandomF32(rng, hd, 0.5f, 1.5f);
  const std::vector<float> kw = RandomF32(rng, hd, 0.5f, 1.5f);
  std::vector<int32_t> pos(T);
  for (int32_t& p : pos) p = rng.Int(max_pos);
  pos[0] = max_pos - 1;
  if (T >= 3) {
    pos[1] = -1;       // padding: normalised, not rotated
    pos[2] = max_pos;  // past the table: likewise
  }
  DeviceArray<float> d_q(q), d_k(k), d_qw(qw), d_kw(kw);
  DeviceArray<int32_t> d_pos(pos);
  QkNormRopeArgs a;
  a.q = d_q.get();
  a.k = d_k.get();
  a.num_tokens = T;
  a.num_q_heads = nq;
  a.num_kv_heads = nkv;
  a.head_dim = hd;
  if (norm) {
    a.q_norm = d_qw.get();
    a.k_norm = d_kw.get();
  }
  a.eps = eps;
  if (rope) {
    a.positions = d_pos.get();
    a.cos = (*table)->cos();
    a.sin = (*table)->sin();
    a.max_positions = max_pos;
    a.rotary_dim = (*table)->rotary_dim();
  }
  ASSERT_TRUE(LaunchQkNormRope(a, nullptr).ok());
  const std::vector<float> gq = d_q.Download(), gk = d_k.Download();

  if (norm) {
    RmsNormRows(q.data(), T * nq, hd, qw.data(), eps, q.data());
    RmsNormRows(k.data(), T * nkv, hd, kw.data(), eps, k.data());
  }
  if (rope) {
    for (int t = 0; t < T; ++t) {
      if (pos[t] < 0 || pos[t] >= max_pos) continue;
      cpu_rope.Apply(q.data() + static_cast<size_t>(t) * nq * hd, nq, pos[t]);
      cpu_rope.Apply(k.data() + static_cast<size_t>(t) * nkv * hd, nkv, pos[t]);
    }
  }
  auto compare = [&](const std::vector<float>& g, const std::vector<float>& c, const char* name) {
    for (size_t i = 0; i < g.size(); ++i) {
      if (!norm) {
        // RoPE alone: the same products and sums, rounded the same way.
        ASSERT_EQ(Bits(g[i]), Bits(c[i])) << name << " " << i;
      } else {
        // The norm's mean square differs by summation order; values are O(1) after it.
        ASSERT_NEAR(g[i], c[i], 4e-6 * std::fabs(c[i]) + 4e-6) << name << " " << i;
      }
    }
  };
  compare(gq, q, "q");
  compare(gk, k, "k");
}

TEST(TokenOpsTest, QkNormRopeMatchesTheCpuEngine) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (bool yarn : {false, true}) {
    for (int T : kTokenCounts) {
      CheckQkNormRope(rng, yarn, true, true, T, 32, 4, 128);  // Qwen3-30B-A3B
      CheckQkNormRope(rng, yarn, false, true, T, 3, 1, 40);   // half < 32 lanes
      CheckQkNormRope(rng, yarn, true, false, T, 5, 3, 256);
      CheckQkNormRope(rng, yarn, true, true, T, 4, 2, 96);
      CheckQkNormRope(rng, yarn, true, true, T, 16, 2, 256, 0.25);  // Qwen3.6's partial rotary
      CheckQkNormRope(rng, yarn, false, true, T, 4, 2, 16, 0.25);   // the tiny fixture's
    }
  }
}

TEST(TokenOpsTest, SiluMulMatchesFloat64) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (int inter : {768, 1000, 5}) {
    for (int T : kTokenCounts) {
      SCOPED_TRACE(::testing::Message() << "inter " << inter << " T " << T);
      const std::vector<float> gu = RandomF32(rng, static_cast<size_t>(T) * 2 * inter, -8, 8);
      DeviceArray<float> d_gu(gu), d_out(static_cast<size_t>(T) * inter);
      DeviceArray<uint16_t> d_bf(d_out.size());
      d_out.Poison();
      d_bf.Poison();
      ASSERT_TRUE(LaunchSiluMul(d_gu.get(), T, inter, d_out.get(), d_bf.get(), nullptr).ok());
      const std::vector<float> out = d_out.Download();
      const std::vector<uint16_t> bf = d_bf.Download();
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < inter; ++i) {
          const double g = gu[static_cast<size_t>(t) * 2 * inter + i];
          const double u = gu[static_cast<size_t>(t) * 2 * inter + inter + i];
          const double ref = g / (1.0 + std::exp(-g)) * u;
          const size_t at = static_cast<size_t>(t) * inter + i;
          // expf within 2 ulp, then a division and a product: a few f32 ulps.
          ASSERT_NEAR(out[at], ref, 1e-6 * std::fabs(ref) + 1e-30) << t << "," << i;
          ASSERT_EQ(bf[at], common::FloatToBf16(out[at])) << t << "," << i;
        }
      }
    }
  }
}

TEST(TokenOpsTest, AddAndAddBiasAreExact) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (int n : {2048, 1000, 3}) {
    for (int T : kTokenCounts) {
      const std::vector<float> y = RandomF32(rng, static_cast<size_t>(T) * n, -5, 5);
      const std::vector<float> x = RandomF32(rng, y.size(), -5, 5);
      const std::vector<float> b = RandomF32(rng, n, -1, 1);
      DeviceArray<float> d_y(y), d_x(x), d_b(b);
      ASSERT_TRUE(LaunchAdd(d_y.get(), d_x.get(), static_cast<int64_t>(y.size()), nullptr).ok());
      ASSERT_TRUE(LaunchAddBias(d_y.get(), T, n, d_b.get(), nullptr).ok());
      const std::vector<float> got = d_y.Download();
      for (size_t i = 0; i < y.size(); ++i) {
        const float want = (y[i] + x[i]) + b[i % n];
        ASSERT_EQ(Bits(got[i]), Bits(want)) << "n " << n << " T " << T << " i " << i;
      }
    }
  }
}

// model.cc's router for one token: softmax in f32, partial_sort by (p desc, id asc), weights
// renormalised by the top-k sum in rank order when asked.
void CpuRouter(const float* l, int E, int K, bool renorm, int32_t* ids, float* w,
               std::vector<float>* probs) {
  std::vector<float>& p = *probs;
  p.assign(E, 0.0f);
  const float mx = *std::max_element(l, l + E);
  float sum = 0.0f;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(l[e] - mx);
    sum += p[e];
  }
  for (int e = 0; e < E; ++e) p[e] /= sum;
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + K, order.end(),
                    [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float topsum = 0.0f;
  for (int j = 0; j < K; ++j) topsum += p[order[j]];
  for (int j = 0; j < K; ++j) {
    ids[j] = order[j];
    w[j] = renorm ? p[order[j]] / topsum : p[order[j]];
  }
}

// ties: logits drawn from four values, so many experts tie exactly (and their probabilities
// too, on both sides); the order must then be the CPU's, id for id.
void CheckRouter(Rng& rng, int T, int E, int K, bool renorm, bool ties) {
  SCOPED_TRACE(::testing::Message() << "T " << T << " E " << E << " K " << K << " renorm " << renorm
                                    << " ties " << ties);
  std::vector<float> logits(static_cast<size_t>(T) * E);
  for (float& l : logits) l = ties ? 0.5f * static_cast<float>(rng.Int(4)) : rng.Uniform(-6, 6);
  DeviceArray<float> d_l(logits), d_w(static_cast<size_t>(T) * K);
  DeviceArray<int32_t> d_ids(d_w.size());
  d_w.Poison();
  d_ids.Poison();
  ASSERT_TRUE(LaunchRouterTopK(d_l.get(), T, E, K, renorm, d_ids.get(), d_w.get(), nullptr).ok());
  const std::vector<int32_t> ids = d_ids.Download();
  const std::vector<float> w = d_w.Download();
  std::vector<int32_t> cids(K);
  std::vector<float> cw(K), p;
  for (int t = 0; t < T; ++t) {
    CpuRouter(logits.data() + static_cast<size_t>(t) * E, E, K, renorm, cids.data(), cw.data(), &p);
    for (int j = 0; j < K; ++j) {
      const int32_t g = ids[static_cast<size_t>(t) * K + j];
      ASSERT_GE(g, 0);
      ASSERT_LT(g, E);
      if (ties) {
        ASSERT_EQ(g, cids[j]) << "token " << t << " rank " << j;
      } else if (g != cids[j]) {
        // Within one side every probability shares one sum, so the ranking is that of the
        // exponentials, which CUDA's expf and the CPU's may round a few ulps apart: only a near
        // tie may swap.
        ASSERT_NEAR(p[g], p[cids[j]], 2e-6 * p[cids[j]]) << "token " << t << " rank " << j;
      }
      // Sums of up to 512 positive f32 terms in another order: worst case E * 2^-24 = 3e-5
      // relative, typically ~1e-6.
      ASSERT_NEAR(w[static_cast<size_t>(t) * K + j], cw[j], 1e-5 * cw[j] + 1e-30)
          << "token " << t << " rank " << j;
    }
  }
}

TEST(TokenOpsTest, RouterTopKMatchesTheCpuRouterIncludingTies) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (int T : kTokenCounts) {
    for (bool renorm : {true, false}) {
      for (bool ties : {false, true}) {
        CheckRouter(rng, T, 128, 8, renorm, ties);  // Qwen3-30B-A3B
        CheckRouter(rng, T, 60, 4, renorm, ties);   // Qwen1.5-MoE
        CheckRouter(rng, T, 512, 16, renorm, ties);
        CheckRouter(rng, T, 7, 7, renorm, ties);
      }
    }
  }
  int32_t* none = nullptr;
  EXPECT_EQ(LaunchRouterTopK(nullptr, 1, 513, 8, true, none, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchRouterTopK(nullptr, 1, 128, 17, true, none, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenOpsTest, SharedExpertCombineMatchesFloat64) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (int hidden : {2048, 1000, 3}) {
    for (int T : kTokenCounts) {
      const std::vector<float> h = RandomF32(rng, static_cast<size_t>(T) * hidden, -2, 2);
      const std::vector<float> s = RandomF32(rng, h.size(), -2, 2);
      const std::vector<float> g = RandomF32(rng, T, -6, 6);
      DeviceArray<float> d_h(h), d_s(s), d_g(g);
      ASSERT_TRUE(
          LaunchSharedExpertCombine(d_h.get(), d_s.get(), d_g.get(), T, hidden, nullptr).ok());
      const std::vector<float> got = d_h.Download();
      for (int t = 0; t < T; ++t) {
        const double gate = 1.0 / (1.0 + std::exp(-static_cast<double>(g[t])));
        for (int i = 0; i < hidden; ++i) {
          const size_t at = static_cast<size_t>(t) * hidden + i;
          const double ref = h[at] + gate * s[at];
          // Sigmoid within a few ulps, one product and one sum in f32.
          ASSERT_NEAR(got[at], ref, 1e-6 * (std::fabs(h[at]) + std::fabs(gate * s[at])))
              << "hidden " << hidden << " T " << T << " at " << at;
        }
      }
    }
  }
}

TEST(TokenOpsTest, ArgmaxTakesTheLowestIndexOfTheLargest) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  for (int vocab : {151936, 4097, 1000, 5}) {
    for (int T : kTokenCounts) {
      SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " T " << T);
      std::vector<float> logits = RandomF32(rng, static_cast<size_t>(T) * vocab, -20, 20);
      for (int t = 0; t < T; ++t) {
        float* row = logits.data() + static_cast<size_t>(t) * vocab;
        const int mode = t % 4;
        if (mode == 1) {
          // Exact tie for the maximum, in different chunks where the row is long enough.
          const int a = rng.Int(vocab), b = rng.Int(vocab);
          row[a] = row[b] = 30.0f;
        } else if (mode == 2) {
          // Tie between neighbours (one chunk, one warp).
          const int a = rng.Int(vocab - 1);
          row[a] = row[a + 1] = 30.0f;
        } else if (mode == 3) {
          // NaNs are never chosen.
          row[rng.Int(vocab)] = std::numeric_limits<float>::quiet_NaN();
          row[vocab - 1] = 25.0f;
        }
      }
      const int64_t scratch_bytes = ArgmaxScratchBytes(T, vocab);
      DeviceArray<uint64_t> d_scratch(static_cast<size_t>((scratch_bytes + 7) / 8));
      DeviceArray<float> d_l(logits);
      DeviceArray<int32_t> d_out(T);
      d_out.Poison();
      d_scratch.Poison();
      ASSERT_TRUE(LaunchArgmax(d_l.get(), T, vocab, d_scratch.get(), d_out.get(), nullptr).ok());
      const std::vector<int32_t> out = d_out.Download();
      for (int t = 0; t < T; ++t) {
        const float* row = logits.data() + static_cast<size_t>(t) * vocab;
        int32_t best = 0;  // the sampler's ArgMax, with NaNs skipped
        while (std::isnan(row[best])) ++best;
        for (int i = best + 1; i < vocab; ++i) {
          if (row[i] > row[best]) best = i;
        }
        ASSERT_EQ(out[t], best) << "row " << t;
      }
    }
  }
}

TEST(TokenOpsTest, CastsMatchCommonFormats) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  // Every bf16 pattern widens exactly.
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), 0);
  DeviceArray<uint16_t> d_all(all);
  DeviceArray<float> d_wide(all.size());
  d_wide.Poison();
  ASSERT_TRUE(LaunchBf16ToF32(d_all.get(), 65536, d_wide.get(), nullptr).ok());
  const std::vector<float> wide = d_wide.Download();
  for (int i = 0; i < 65536; ++i) {
    ASSERT_EQ(Bits(wide[i]), Bits(common::Bf16ToFloat(static_cast<uint16_t>(i)))) << i;
  }
  // Narrowing: random bit patterns (every class: NaN payloads, inf, subnormals, halfway cases)
  // and exact halfway values.
  std::vector<float> x(100003);
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t u = static_cast<uint32_t>(rng.Next());
    if (i % 3 == 1) u = (u & 0xFFFF0000u) | 0x8000u;  // exactly halfway
    std::memcpy(&x[i], &u, 4);
  }
  DeviceArray<float> d_x(x);
  DeviceArray<uint16_t> d_n(x.size());
  d_n.Poison();
  ASSERT_TRUE(LaunchF32ToBf16(d_x.get(), static_cast<int64_t>(x.size()), d_n.get(), nullptr).ok());
  const std::vector<uint16_t> n = d_n.Download();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(n[i], common::FloatToBf16(x[i])) << "bits " << Bits(x[i]);
  }
}

TEST(TokenOpsTest, GatedQuerySplitAndSigmoidGateMatchTheCpuEngine) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(SeedForTest());
  const int T = 5, nh = 3, hd = 16;
  const std::vector<float> qg = RandomF32(rng, static_cast<size_t>(T) * nh * 2 * hd, -4, 4);
  DeviceArray<float> d_qg(qg), d_q(static_cast<size_t>(T) * nh * hd), d_g(d_q.size());
  ASSERT_TRUE(LaunchSplitGatedQuery(d_qg.get(), T, nh, hd, d_q.get(), d_g.get(), nullptr).ok());
  const std::vector<float> q = d_q.Download(), g = d_g.Download();
  for (int r = 0; r < T * nh; ++r) {
    for (int i = 0; i < hd; ++i) {
      ASSERT_EQ(Bits(q[r * hd + i]), Bits(qg[r * 2 * hd + i])) << r << "," << i;
      ASSERT_EQ(Bits(g[r * hd + i]), Bits(qg[r * 2 * hd + hd + i])) << r << "," << i;
    }
  }
  // The CPU engine: attn * (1 / (1 + exp(-gate))) in f32, then the o projection's bf16 input.
  const std::vector<float> x = RandomF32(rng, q.size(), -4, 4);
  DeviceArray<float> d_x(x);
  DeviceArray<uint16_t> d_out(x.size());
  ASSERT_TRUE(LaunchSigmoidGateToBf16(d_x.get(), d_g.get(), static_cast<int64_t>(x.size()),
                                      d_out.get(), nullptr)
                  .ok());
  const std::vector<uint16_t> out = d_out.Download();
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = x[i] / (1.0 + std::exp(-static_cast<double>(g[i])));
    ASSERT_NEAR(common::Bf16ToFloat(out[i]), want, 1e-2 * std::fabs(want) + 1e-6) << i;
  }
}

TEST(TokenOpsTest, FillUniformIsInRangeAndRepeatable) {
  MOE_SKIP_WITHOUT_GPU();
  const int64_t n = 100000;
  DeviceArray<float> a(n), b(n);
  ASSERT_TRUE(LaunchFillUniformF32(a.get(), n, -0.5f, 0.25f, 7, nullptr).ok());
  ASSERT_TRUE(LaunchFillUniformF32(b.get(), n, -0.5f, 0.25f, 7, nullptr).ok());
  const std::vector<float> va = a.Download(), vb = b.Download();
  double mean = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(Bits(va[i]), Bits(vb[i])) << i;
    ASSERT_GE(va[i], -0.5f);
    ASSERT_LT(va[i], 0.25f);
    mean += va[i];
  }
  EXPECT_NEAR(mean / n, -0.125, 0.01);
}

}  // namespace
}  // namespace moe::engine::gpu

#else  // !MOE_HAVE_CUDA

TEST(TokenOpsTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MOE_HAVE_CUDA
