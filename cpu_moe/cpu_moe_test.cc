// Tests of cpu_moe against the float64 reference (test_bank.h), on every compiled Highway target
// the CPU supports, every weight format, T in {1, 2, 5, 16, 64}, dedup on and off, uniform and
// skewed routing, for bf16 the CPU's bf16 dot product on and off, for the int8 formats the
// block-lane and the plain activation layout (internal::Tuning::block_lane).
//
// Tolerance (derived, per output element): the kernels differ from the reference that emulates
// their activation quantization only by fp32 accumulation order and by an occasional int8
// rounding flip of h (h is fp32 in the kernel, float64 in the reference). So
//   |y - ref| <= 2e-4 * abs_scale + flip + 1e-7,
// abs_scale = sum over routes |w| sum_i |D h| (what fp32 rounding acts on: a few ulps, 6e-8 each,
// grown by up to sqrt(H) partial sums, plus h's own relative error) and flip = one quantization
// step of h times the largest |D| per route. A wrong block scale moves the output by about
// abs_scale / sqrt(blocks) and a missed route by its whole term: both far above, and the negative
// controls below check that they fail.
// Against the plain float64 reference (no activation emulation) the relative Frobenius error is
// bounded by the int8 activation error (two stages of about 0.4% RMS each) for quantized formats,
// by fp32 rounding otherwise.
//
// bf16 by the CPU's bf16 dot product (Options::bf16_dot_product; it runs on AVX3_DL where the CPU
// has AVX512_BF16, ForwardStats says when): the reference rounds x and h to bf16 as the kernel
// does (EmulateActBf16). x is then rounded identically on both sides, and h differs only where
// the kernel's fp32 h and the reference's float64 h round to neighbouring bf16 values (flip = one
// bf16 ulp of h_i times the largest |D| per route). bf16 x bf16 products are exact in fp32, so the
// rest is fp32 summation: per output, each lane of the down row's vdpbf16ps chain adds
// 2 * I / 32 products, AddLaneSums 4 levels of lanes, then one rounding for the route weight and
// top_k - 1 adds over routes: with I = 288, k = 4, 18 + 4 + 1 + 3 = 26 roundings of at most
// 2^-24 of partial sums bounded by abs_scale, 1.6e-6 * abs_scale. Checked at
// 1e-5 * abs_scale + flip + 1e-7 (6x margin), 20 times tighter than the fp32 path's 2e-4, so that
// skipping the rounding would be seen: the reference without it fails (a negative control below).
// The test data hold no denormals (x ~ N(0, 1), weights uniform in +-sqrt(3 / k), h a swiglu of
// O(1) values), so vdpbf16ps' treatment of denormal inputs (as zero) and outputs (flushed) never
// acts; the emulation counts denormal activations as zero all the same. Against the plain
// reference, the bf16 roundings of x and h (relative error at most 2^-9, RMS about 0.16% per
// element; h takes those of gate and up as well) give a relative Frobenius error of about 0.3%,
// checked at <= 1%.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/onednn_experts.h"
#include "cpu_moe/test_bank.h"
#include "gtest/gtest.h"

namespace moe::cpu_moe {
namespace {

using common::WeightFormat;
using internal::Tuning;
using testing::HostBank;
using testing::MakeRandomBank;
using testing::MakeRouting;
using testing::RelFrobenius;
using testing::Routing;
using testing::ReferenceForward;

constexpr WeightFormat kFormats[] = {WeightFormat::kBf16, WeightFormat::kFp8Block,
                                     WeightFormat::kQ4_0, WeightFormat::kNvfp4,
                                     WeightFormat::kMxfp4};
// H and I exercise every vector width's tail and partial fp8 blocks: quantized rows of H = 480
// have 240 packed bytes, one 128-byte block-lane chunk (512-bit targets) and then 64 + 32 + 16
// bytes of the plain layout; I = 288 has 144 (128 + 16); fp8 rows of both end in 32 columns
// past a multiple of 64 and in a partial 128-column block.
constexpr int kE = 16, kH = 480, kI = 288, kTopK = 4;

std::vector<float> RandomX(int T, int H, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * H);
  for (float& v : x) v = n(rng);
  return x;
}

// Tolerance per unit of abs_scale (see the header comment): fp32 kernels, and bf16 by the CPU's
// bf16 dot product against the reference that rounds its activations alike.
constexpr double kRelFp32 = 2e-4;
constexpr double kRelBf16Dot = 1e-5;
// AMX: each output's sum runs along the contraction in one chain of up to k / 2 = 240 (pass 1)
// or 144 (pass 2) additions of bf16 pair products inside the tiles, plus the fp8 block flushes
// and the route sums: about 150 roundings of pass 2 (pass 1's show as h flips or not at all),
// 150 * 2^-24 = 9e-6 of abs_scale; checked at 3e-5 (3x margin), still 7 times tighter than fp32's.
constexpr double kRelAmx = 3e-5;

// fp8 through fp16 (internal::Tuning::fp8_fp16): against the reference that emulates its fp16 sums
// (test_bank.h), the rest is fp32 summation as in the fp32 kernels, plus flip.
double RelFor(const ForwardStats& st) {
  return st.fp8_fp16 ? kRelFp32
         : st.amx    ? kRelAmx
         : st.bf16_dot_product ? kRelBf16Dot
                               : kRelFp32;
}

// max over elements of |y - ref| / tol (<= 1 passes), tol = rel * abs_scale + flip + 1e-7.
double WorstRatio(const std::vector<float>& y, const std::vector<double>& ref,
                  const std::vector<double>& abs_scale, const std::vector<double>& flip,
                  double rel = kRelFp32) {
  double worst = 0.0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double tol = rel * abs_scale[i] + flip[i] + 1e-7;
    const double err = std::fabs(static_cast<double>(y[i]) - ref[i]);
    worst = std::max(worst, std::isfinite(y[i]) ? err / tol : 1e30);
  }
  return worst;
}

bool IsQuant(WeightFormat f) {
  return f == WeightFormat::kQ4_0 || f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4;
}

// Whether a bf16 or fp8 bank at `target` with Options::bf16_dot_product runs the CPU's bf16 dot
// product.
bool Bf16DotRunsAt(const std::string& target) {
  return target == "AVX3_DL" && __builtin_cpu_supports("avx512bf16");
}

// Whether AMX can run there (internal::Tuning::amx; Linux grants the tile state on every kernel
// since 5.16, which Forward requests).
bool AmxRunsAt(const std::string& target) {
  return Bf16DotRunsAt(target) && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("amx-bf16");
}

bool HasBf16Dot(WeightFormat f) {
  return f == WeightFormat::kBf16 || f == WeightFormat::kFp8Block;
}

// Whether fp8's fp16 kernels (internal::Tuning::fp8_fp16) can run at `target`.
bool Fp16RunsAt(const std::string& target) {
  return Bf16DotRunsAt(target) && __builtin_cpu_supports("avx512fp16") &&
         __builtin_cpu_supports("gfni");
}

// Reference options matching a run: the bf16 activation rounding emulated where the run did it.
Options RefOptions(Options o, const ForwardStats& st) {
  o.bf16_dot_product = st.bf16_dot_product && !st.fp8_fp16;
  return o;
}

// Reference tuning matching a run: fp8's fp16 kernels emulated where they ran, with the experts
// that went through AMX instead.
Tuning RefTuning(Tuning t, const ForwardStats& st) {
  t.fp8_fp16 = st.fp8_fp16;
  if (st.fp8_fp16) t.amx = st.amx;
  return t;
}

// The int8 formats' bank in panels (Layout::kPanels); null for the other formats.
std::unique_ptr<PanelBank> PanelsOf(const HostBank& hb) {
  if (!IsQuant(hb.bank.format)) return nullptr;
  absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb.bank);
  EXPECT_TRUE(pb.ok()) << pb.status();
  return pb.ok() ? std::move(*pb) : nullptr;
}

class CpuMoeTest : public ::testing::Test {
 protected:
  CpuMoeTest() : pool_(2) {}
  common::ThreadPool pool_;
};

TEST_F(CpuMoeTest, TargetsAvailable) {
  const std::vector<std::string> targets = AvailableTargets();
  ASSERT_FALSE(targets.empty());
  for (const std::string& t : targets) std::printf("compiled and supported target: %s\n", t.c_str());
}

// Every format x target x T x dedup x routing (x bf16 dot product on / off for bf16) against the
// emulating reference; plain reference once per (format, T, routing).
TEST_F(CpuMoeTest, MatchesReferenceEverywhere) {
  std::mt19937_64 rng(1234);
  int fp16_runs = 0;  // runs in which fp8's fp16 kernels ran
  for (WeightFormat f : kFormats) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 77 + static_cast<int>(f));
    const bool bf16 = HasBf16Dot(f);  // bf16 and fp8: the bf16 dot product variants
    // The int8 formats' bank in panels (kH / 32 = 15 and kI / 32 = 9 blocks per row: each
    // panel's last group of blocks is short, for every format).
    std::unique_ptr<PanelBank> panels;
    if (IsQuant(f)) {
      absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb.bank, &pool_);
      ASSERT_TRUE(pb.ok()) << pb.status();
      panels = std::move(*pb);
    }
    for (int T : {1, 2, 5, 16, 64}) {
      for (bool skewed : {false, true}) {
        const Routing r = MakeRouting(T, kE, kTopK, skewed ? 1.2 : 0.0, rng);
        const std::vector<float> x = RandomX(T, kH, rng);
        Options exact, rounded;
        exact.bf16_dot_product = false;
        Tuning no_fp16;
        no_fp16.fp8_fp16 = false;
        // [0]: activations as the fp32 kernels take them; [1]: rounded to bf16 (bf16 dot);
        // fp8 through fp16: emulated per run (which experts went through AMX depends on it).
        std::vector<double> ref[3], scale[3], flip[3], plain, s2, f2;
        ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, exact, true, &ref[0], &scale[0],
                         &flip[0], no_fp16);
        if (bf16) {
          ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, rounded, true, &ref[1], &scale[1],
                           &flip[1], no_fp16);
        }
        ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, exact, false, &plain, &s2, &f2,
                         no_fp16);
        for (const std::string& target : AvailableTargets()) {
          for (bool dedup : {false, true}) {
            // bf16 and fp8: the bf16 dot product off, on (AMX for experts with the default
            // number of routes; fp8: the others through fp16 where the CPU has it) and on with
            // every expert through AMX; fp8 also on without fp16 (vdpbf16ps); int8 formats:
            // the block-lane and the plain activation layout, and the bank in panels.
            for (int alt : {0, 1, 2, 3}) {
              const bool dot = bf16 && alt != 0, block_lane = alt == 0;
              const bool panel = IsQuant(f) && alt == 2;
              if (alt != 0 && !bf16 && !IsQuant(f)) continue;
              if (alt == 3 && f != WeightFormat::kFp8Block) continue;
              Options o;
              o.dedup = dedup;
              o.max_target = target;
              o.bf16_dot_product = dot;
              o.onednn_min_tokens_per_expert = 0;  // GEMV kernels (oneDNN: onednn_experts_test)
              Tuning tu;
              tu.block_lane = block_lane;
              tu.fp8_fp16 = alt != 3;
              if (alt == 2 && bf16) tu.amx_min_routes = 1;
              std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
              ForwardStats st;
              ASSERT_TRUE(internal::Forward(panel ? panels->bank : hb.bank, T, kTopK, r.ids,
                                            r.weights, x, absl::MakeSpan(y), o, tu, pool_, &st)
                              .ok());
              const std::string what = absl::StrCat(
                  std::string(common::WeightFormatName(f)), " T=", T, " skewed=", skewed,
                  " target=", target, " dedup=", dedup, " bf16_dot=", dot,
                  " block_lane=", block_lane, " amx_all=", alt == 2 && bf16, " panels=", panel);
              EXPECT_EQ(st.target, target) << what;
              EXPECT_EQ(st.bf16_dot_product, dot && Bf16DotRunsAt(target)) << what;
              if (alt == 2 && bf16) {
                EXPECT_EQ(st.amx, AmxRunsAt(target)) << what;
              }
              if (!dot) {
                EXPECT_FALSE(st.amx) << what;
              }
              if (!dot || alt == 3 || !Fp16RunsAt(target)) {
                EXPECT_FALSE(st.fp8_fp16) << what;
              }
              fp16_runs += st.fp8_fp16;
              if (st.fp8_fp16) {
                ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, RefOptions(o, st), true,
                                 &ref[2], &scale[2], &flip[2], RefTuning(tu, st));
              }
              const int v = st.fp8_fp16 ? 2 : st.bf16_dot_product ? 1 : 0;
              EXPECT_LE(WorstRatio(y, ref[v], scale[v], flip[v], RelFor(st)), 1.0) << what;
              const double rel = RelFrobenius(y, plain);
              EXPECT_LE(rel, IsQuant(f) ? 0.02 : st.bf16_dot_product ? 0.01 : 1e-5) << what;
            }
          }
        }
      }
    }
  }
  if (Fp16RunsAt(AvailableTargets().front())) {
    EXPECT_GT(fp16_runs, 0) << "fp8's fp16 kernels never ran on a CPU that has them";
  }
}

// Negative controls: the same check must fail for a wrong block scale and for a missed route, for
// bf16 with its bf16 dot product on and off; and where the bf16 dot product ran, against a
// reference that does not round the activations (the kernel's rounding must show).
TEST_F(CpuMoeTest, BrokenVariantsFail) {
  std::mt19937_64 rng(99);
  const int T = 5;
  for (WeightFormat f : kFormats) {
    const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
    const std::vector<float> x = RandomX(T, kH, rng);
    // Variants: fp32 kernels; the bf16 dot product (bf16, fp8; fp8 through fp16 where the CPU
    // has it); with every expert through AMX; the int8 formats' bank in panels (packed from the
    // row-major bank before each call); fp8 by the bf16 dot product without fp16.
    for (int variant : {0, 1, 2, 3, 4}) {
      if ((variant == 1 || variant == 2) && !HasBf16Dot(f)) continue;
      if (variant == 3 && !IsQuant(f)) continue;
      if (variant == 4 && f != WeightFormat::kFp8Block) continue;
      const bool dot = variant == 1 || variant == 2 || variant == 4;
      HostBank hb = MakeRandomBank(f, kE, kH, kI, 5 + static_cast<int>(f));
      Options o;
      o.bf16_dot_product = dot;
      Tuning tu;
      tu.fp8_fp16 = variant != 4;
      if (variant == 2) tu.amx_min_routes = 1;
      std::unique_ptr<PanelBank> packed;
      // The bank Forward runs on: hb's, or panels packed from it as it is now.
      auto bank = [&]() -> const ExpertBank& {
        if (variant != 3) return hb.bank;
        absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb.bank);
        EXPECT_TRUE(pb.ok()) << pb.status();
        packed = std::move(*pb);
        return packed->bank;
      };
      std::vector<float> y(x.size());
      ForwardStats st;
      ASSERT_TRUE(internal::Forward(bank(), T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o,
                                    tu, pool_, &st)
                      .ok());
      const std::string what =
          absl::StrCat(std::string(common::WeightFormatName(f)), " bf16_dot=", st.bf16_dot_product,
                       " amx=", st.amx, " fp8_fp16=", st.fp8_fp16, " panels=", variant == 3);
      const double rel = RelFor(st);
      std::vector<double> ref, scale, flip;
      ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, RefOptions(o, st), true, &ref, &scale,
                       &flip, RefTuning(tu, st));
      EXPECT_LE(WorstRatio(y, ref, scale, flip, rel), 1.0) << what;
      if (st.bf16_dot_product && !st.fp8_fp16) {
        std::vector<double> unrounded, s2, f2;
        ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, RefOptions(o, ForwardStats()), true,
                         &unrounded, &s2, &f2, RefTuning(tu, ForwardStats()));
        EXPECT_GT(WorstRatio(y, unrounded, s2, f2, rel), 1.0) << what;
      }

      // Missed route: drop token 0's first route from the kernel's input.
      Routing missed = r;
      missed.ids[0] = -1;
      ASSERT_TRUE(internal::Forward(bank(), T, kTopK, missed.ids, missed.weights, x,
                                    absl::MakeSpan(y), o, tu, pool_)
                      .ok());
      EXPECT_GT(WorstRatio(y, ref, scale, flip, rel), 10.0) << what;

      // Wrong scale: double one block scale of the down matrix of expert ids[0] (first block of
      // row 0, or its fp8 128x128 block; bf16 has no scale, so the 32 weights that a block would
      // cover, the first of row 0, are doubled).
      const int e = r.ids[0];
      switch (f) {
        case WeightFormat::kBf16: {
          uint16_t* w = reinterpret_cast<uint16_t*>(hb.down_w.data()) + size_t{1} * e * kH * kI;
          for (int i = 0; i < 32; ++i) w[i] = common::FloatToBf16(2.0f * common::Bf16ToFloat(w[i]));
          break;
        }
        case WeightFormat::kFp8Block: {
          const int bs = common::kFp8BlockSize;
          float* s = reinterpret_cast<float*>(hb.down_s.data()) +
                     e * ((kH + bs - 1) / bs) * ((kI + bs - 1) / bs);
          s[0] *= 2.0f;
          break;
        }
        case WeightFormat::kQ4_0: {
          auto* b = reinterpret_cast<common::BlockQ4_0*>(hb.down_w.data()) + e * kH * kI / 32;
          b[0].d = common::FloatToFp16(2.0f * common::Fp16ToFloat(b[0].d));
          break;
        }
        case WeightFormat::kMxfp4:
          hb.down_s[e * kH * kI / 32] += 1;
          break;
        case WeightFormat::kNvfp4:
          hb.down_s[e * kH * kI / 16] += 8;  // e4m3 exponent + 1
          break;
      }
      ASSERT_TRUE(internal::Forward(bank(), T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o,
                                    tu, pool_)
                      .ok());
      EXPECT_GT(WorstRatio(y, ref, scale, flip, rel), 1.0) << what;
    }
  }
}

// fp8 through fp16 (Tuning::fp8_fp16): MOE_CPU_FP8_FP16=0 reaches the tuning; ForwardStats
// says when it ran (by default where the CPU has AVX512-FP16 and the bf16 dot product runs; never
// with either switched off); and its per-route activation scaling keeps x and h within fp16's
// range: x scaled by 2^-30, 1 and 2^30 (h then spans about 2^-60 .. 2^60) matches the reference
// within the same relative bound, with no absolute floor (outputs at 2^-30 are about 1e-19).
TEST_F(CpuMoeTest, Fp8Fp16SwitchStatsAndRange) {
  EXPECT_TRUE(Tuning().fp8_fp16);
  setenv("MOE_CPU_FP8_FP16", "0", 1);
  EXPECT_FALSE(Tuning::FromEnv().fp8_fp16);
  unsetenv("MOE_CPU_FP8_FP16");
  EXPECT_TRUE(Tuning::FromEnv().fp8_fp16);

  std::mt19937_64 rng(41);
  const int T = 3;
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  const std::vector<float> x0 = RandomX(T, kH, rng);
  const HostBank hb = MakeRandomBank(WeightFormat::kFp8Block, kE, kH, kI, 43);
  const std::string best = AvailableTargets().front();
  std::vector<float> y(x0.size());
  ForwardStats st;
  Options o;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x0, absl::MakeSpan(y), o, pool_, &st)
                  .ok());
  EXPECT_EQ(st.fp8_fp16, Fp16RunsAt(best));
  for (int off = 0; off < 2; ++off) {
    Options o2;
    Tuning t2;
    (off == 0 ? t2.fp8_fp16 : o2.bf16_dot_product) = false;
    ASSERT_TRUE(internal::Forward(hb.bank, T, kTopK, r.ids, r.weights, x0, absl::MakeSpan(y), o2,
                                  t2, pool_, &st)
                    .ok());
    EXPECT_FALSE(st.fp8_fp16) << off;
  }
  const HostBank q4 = MakeRandomBank(WeightFormat::kQ4_0, kE, kH, kI, 43, false);
  ASSERT_TRUE(
      Forward(q4.bank, T, kTopK, r.ids, r.weights, x0, absl::MakeSpan(y), o, pool_, &st).ok());
  EXPECT_FALSE(st.fp8_fp16) << "q4_0";

  // Against the plain float64 reference (no emulation): the fp16 kernels' activations keep 11
  // significant bits against bf16's 8, so their error is the smaller (printed for the record).
  {
    std::vector<double> plain, ps, pf;
    Options exact;
    exact.bf16_dot_product = false;
    Tuning no_fp16;
    no_fp16.fp8_fp16 = false;
    ReferenceForward(hb, T, kTopK, r.ids, r.weights, x0, exact, true, &plain, &ps, &pf, no_fp16);
    for (bool fp16 : {true, false}) {
      Tuning t2;
      t2.fp8_fp16 = fp16;
      ASSERT_TRUE(internal::Forward(hb.bank, T, kTopK, r.ids, r.weights, x0, absl::MakeSpan(y),
                                    Options(), t2, pool_, &st)
                      .ok());
      const double rel = RelFrobenius(y, plain);
      std::printf("fp8_fp16=%d bf16_dot=%d: relative Frobenius error against float64 %.3g\n",
                  st.fp8_fp16 ? 1 : 0, st.bf16_dot_product ? 1 : 0, rel);
      EXPECT_LE(rel, 0.01) << fp16;
    }
  }

  // Each scale through the fp16 kernels (where the CPU has them) and through the fp32 ones.
  for (int p : {-30, 0, 30}) {
   for (bool dot : {true, false}) {
    std::vector<float> x = x0;
    for (float& v : x) v = std::ldexp(v, p);
    o.bf16_dot_product = dot;
    ASSERT_TRUE(
        Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_, &st).ok());
    std::vector<double> ref, scale, flip;
    ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, RefOptions(o, st), true, &ref, &scale,
                     &flip, RefTuning(Tuning(), st));
    const double rel = RelFor(st);
    double worst = 0.0;
    for (size_t i = 0; i < y.size(); ++i) {
      const double tol = rel * scale[i] + flip[i];
      ASSERT_GT(tol, 0.0) << i;
      worst = std::max(worst, std::isfinite(y[i]) ? std::fabs(y[i] - ref[i]) / tol : 1e30);
    }
    std::printf("x * 2^%d: fp8_fp16=%d worst error / tolerance %.3g, relative Frobenius %.3g\n",
                p, st.fp8_fp16 ? 1 : 0, worst, RelFrobenius(y, ref));
    EXPECT_LE(worst, 1.0) << "x * 2^" << p << " fp8_fp16=" << st.fp8_fp16;
   }
  }
}

// More than 64 routes per expert (the kernels take an expert's routes 64 at a time, AMX 16 at a
// time within those): T = 150 tokens over 4 experts, top-2, so each expert has about 75 routes.
TEST_F(CpuMoeTest, MoreThan64RoutesPerExpert) {
  std::mt19937_64 rng(31);
  const int T = 150, E = 4, k = 2;
  const Routing r = MakeRouting(T, E, k, 0.0, rng);
  const std::vector<float> x = RandomX(T, kH, rng);
  for (WeightFormat f : kFormats) {
    const HostBank hb = MakeRandomBank(f, E, kH, kI, 61 + static_cast<int>(f));
    std::unique_ptr<PanelBank> panels;
    if (IsQuant(f)) {
      absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb.bank);
      ASSERT_TRUE(pb.ok()) << pb.status();
      panels = std::move(*pb);
    }
    // Variants: as BrokenVariantsFail's.
    for (int variant : {0, 1, 2, 3}) {
      if ((variant == 1 || variant == 2) && !HasBf16Dot(f)) continue;
      if (variant == 3 && !IsQuant(f)) continue;
      Options o;
      o.bf16_dot_product = variant == 1 || variant == 2;
      o.onednn_min_tokens_per_expert = 0;  // the GEMV / AMX kernels
      Tuning tu;
      if (variant == 2) tu.amx_min_routes = 1;
      std::vector<float> y(x.size());
      ForwardStats st;
      ASSERT_TRUE(internal::Forward(variant == 3 ? panels->bank : hb.bank, T, k, r.ids, r.weights,
                                    x, absl::MakeSpan(y), o, tu, pool_, &st)
                      .ok());
      const std::string what = absl::StrCat(std::string(common::WeightFormatName(f)),
                                            " variant=", variant, " amx=", st.amx);
      EXPECT_GT(st.reuse, 64.0) << what;
      if (variant == 2) {
        EXPECT_EQ(st.amx, AmxRunsAt(AvailableTargets().front())) << what;
      }
      std::vector<double> ref, scale, flip;
      ReferenceForward(hb, T, k, r.ids, r.weights, x, RefOptions(o, st), true, &ref, &scale,
                       &flip, RefTuning(tu, st));
      EXPECT_LE(WorstRatio(y, ref, scale, flip, RelFor(st)), 1.0) << what;
    }
  }
}

TEST_F(CpuMoeTest, PaddingIsInert) {
  std::mt19937_64 rng(7);
  const int T = 6;
  for (WeightFormat f : kFormats) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 11);
    Routing r = MakeRouting(T, kE, kTopK, 1.2, rng);
    std::vector<float> x = RandomX(T, kH, rng);
    // Token 2 is a padded row full of inf; token 4 has two padded slots.
    for (int j = 0; j < kTopK; ++j) r.ids[2 * kTopK + j] = -1;
    for (int i = 0; i < kH; ++i) x[2 * kH + i] = std::numeric_limits<float>::infinity();
    r.ids[4 * kTopK + 1] = -1;
    r.ids[4 * kTopK + 3] = -7;
    const std::unique_ptr<PanelBank> panels = PanelsOf(hb);
    for (int v = 0; v < (panels ? 4 : 2); ++v) {
      const bool dedup = v % 2 != 0;
      const ExpertBank& bank = v >= 2 ? panels->bank : hb.bank;
      SCOPED_TRACE(absl::StrCat(std::string(common::WeightFormatName(f)), " dedup=", dedup,
                                " panels=", v >= 2));
      Options o;
      o.dedup = dedup;
      std::vector<float> y(x.size(), 123.0f);
      ForwardStats st;
      ASSERT_TRUE(Forward(bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_,
                          &st).ok());
      EXPECT_EQ(st.routes, T * kTopK - kTopK - 2);
      for (int i = 0; i < kH; ++i) EXPECT_EQ(y[2 * kH + i], 123.0f);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y[i])) << i;
      // Real rows equal the result without the padded token.
      Routing r2;
      std::vector<float> x2;
      for (int t = 0; t < T; ++t) {
        if (t == 2) continue;
        for (int j = 0; j < kTopK; ++j) {
          r2.ids.push_back(r.ids[t * kTopK + j]);
          r2.weights.push_back(r.weights[t * kTopK + j]);
        }
        x2.insert(x2.end(), x.begin() + t * kH, x.begin() + (t + 1) * kH);
      }
      std::vector<float> y2(x2.size());
      ASSERT_TRUE(Forward(bank, T - 1, kTopK, r2.ids, r2.weights, x2, absl::MakeSpan(y2), o,
                          pool_).ok());
      for (int t = 0, t2 = 0; t < T; ++t) {
        if (t == 2) continue;
        for (int i = 0; i < kH; ++i) {
          EXPECT_NEAR(y[t * kH + i], y2[t2 * kH + i], 1e-5f * (1 + std::fabs(y2[t2 * kH + i])));
        }
        ++t2;
      }
    }
  }
}

TEST_F(CpuMoeTest, DedupOnOffAgreeAndInertWithoutSharing) {
  std::mt19937_64 rng(3);
  for (WeightFormat f : kFormats) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 21);
    const std::unique_ptr<PanelBank> panels = PanelsOf(hb);
    for (int v = 0; v < (panels ? 6 : 3); ++v) {
      const int T = (int[]){1, 16, 64}[v % 3];
      const ExpertBank& bank = v >= 3 ? panels->bank : hb.bank;
      SCOPED_TRACE(absl::StrCat(std::string(common::WeightFormatName(f)), " T=", T,
                                " panels=", v >= 3));
      const Routing r = MakeRouting(T, kE, kTopK, 1.2, rng);
      const std::vector<float> x = RandomX(T, kH, rng);
      std::vector<float> y0(x.size()), y1(x.size());
      // AMX off: it takes experts by their route count, which dedup changes, and its fp32 sums
      // differ from vdpbf16ps' in order; where h is then rounded to bf16 a last-bit difference
      // can flip h by a bf16 step. Both kernels meet the reference with such flips counted
      // (MatchesReferenceEverywhere runs dedup on and off with AMX); here the same kernels run
      // either way, so only the split differs.
      Options off, on;
      off.dedup = false;
      Tuning no_amx;
      no_amx.amx_min_routes = 0;
      ForwardStats s0, s1;
      ASSERT_TRUE(internal::Forward(bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y0), off,
                                    no_amx, pool_, &s0)
                      .ok());
      ASSERT_TRUE(internal::Forward(bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y1), on,
                                    no_amx, pool_, &s1)
                      .ok());
      EXPECT_EQ(s0.unique_experts, s1.unique_experts);
      if (T == 1) {
        // All routes distinct: the same plain work split, bit for bit.
        EXPECT_DOUBLE_EQ(s1.reuse, 1.0);
        EXPECT_EQ(y0, y1);
      } else {
        EXPECT_GT(s1.reuse, 1.0);
        for (size_t i = 0; i < y0.size(); ++i) {
          EXPECT_NEAR(y0[i], y1[i], 1e-4f * (1 + std::fabs(y0[i]))) << i;
        }
      }
    }
  }
}

TEST_F(CpuMoeTest, StatsReportPhaseTimes) {
  std::mt19937_64 rng(9);
  const HostBank hb = MakeRandomBank(WeightFormat::kQ4_0, kE, kH, kI, 5);
  const int T = 4;
  const Routing r = MakeRouting(T, kE, kTopK, 1.0, rng);
  const std::vector<float> x = RandomX(T, kH, rng);
  std::vector<float> y(x.size());
  ForwardStats st;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(
      Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), Options(), pool_, &st)
          .ok());
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(st.pass1_seconds, 0.0);
  EXPECT_GT(st.pass2_seconds, 0.0);
  EXPECT_GE(st.prep_x_seconds, 0.0);
  EXPECT_GE(st.prep_h_seconds, 0.0);
  EXPECT_LE(st.prep_x_seconds + st.pass1_seconds + st.prep_h_seconds + st.pass2_seconds, wall);
  // All padding: no phase runs, and the stats say so.
  const std::vector<int32_t> pad(static_cast<size_t>(T) * kTopK, -1);
  ForwardStats none;
  none.pass1_seconds = 1.0;
  ASSERT_TRUE(
      Forward(hb.bank, T, kTopK, pad, r.weights, x, absl::MakeSpan(y), Options(), pool_, &none)
          .ok());
  EXPECT_EQ(none.routes, 0);
  EXPECT_EQ(none.pass1_seconds, 0.0);
  EXPECT_EQ(none.pass2_seconds, 0.0);
}

// Forward keeps its scratch memory per calling thread between calls (and frees buffers above
// 16 MiB after their call), and splits x's preparation into column chunks among the workers
// while there are fewer tokens than workers. A call's result must not depend on what the thread
// ran before: each case, run after calls of other sizes and formats on this thread (growing,
// shrinking and trimming its buffers), must equal bit for bit the same case run first on a
// fresh thread. The cases include T = 1 with bf16 x (chunked preparation from bf16) and a
// prefill-sized call whose per-route buffers exceed 16 MiB.
TEST_F(CpuMoeTest, ScratchReuseDoesNotChangeResults) {
  struct Case {
    WeightFormat format;
    int T;
    bool bf16_x;
  };
  const Case cases[] = {{WeightFormat::kQ4_0, 64, false},  {WeightFormat::kQ4_0, 1, true},
                        {WeightFormat::kFp8Block, 1, true}, {WeightFormat::kQ4_0, 2400, false},
                        {WeightFormat::kBf16, 2, false},    {WeightFormat::kMxfp4, 1, false},
                        {WeightFormat::kQ4_0, 1, false},    {WeightFormat::kFp8Block, 16, false}};
  std::vector<HostBank> banks;
  for (WeightFormat f : kFormats) banks.push_back(MakeRandomBank(f, kE, kH, kI, 61, false));
  std::mt19937_64 rng(17);
  std::vector<Routing> routings;
  std::vector<std::vector<float>> xs;
  for (const Case& c : cases) {
    routings.push_back(MakeRouting(c.T, kE, kTopK, 0.5, rng));
    xs.push_back(RandomX(c.T, kH, rng));
    for (float& v : xs.back()) v = common::Bf16ToFloat(common::FloatToBf16(v));
  }
  auto run = [&](size_t i) {
    const Case& c = cases[i];
    const HostBank& hb = banks[static_cast<size_t>(c.format)];
    Options o;
    o.onednn_min_tokens_per_expert = 0;
    std::vector<float> y(xs[i].size(), 0.0f);
    std::vector<uint16_t> xb(xs[i].size());
    for (size_t j = 0; j < xb.size(); ++j) xb[j] = common::FloatToBf16(xs[i][j]);
    const void* x = c.bf16_x ? static_cast<const void*>(xb.data()) : xs[i].data();
    EXPECT_TRUE(Forward(hb.bank, c.T, kTopK, routings[i].ids, routings[i].weights, x,
                        c.bf16_x ? DType::kBf16 : DType::kF32, y.data(), DType::kF32, o, pool_)
                    .ok());
    return y;
  };
  for (size_t f = 0; f < banks.size(); ++f) ASSERT_EQ(static_cast<size_t>(kFormats[f]), f);
  std::vector<std::vector<float>> after(std::size(cases));
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < std::size(cases); ++i) after[i] = run(i);
  }
  for (size_t i = 0; i < std::size(cases); ++i) {
    std::vector<float> fresh;
    std::thread([&] { fresh = run(i); }).join();
    ASSERT_EQ(fresh.size(), after[i].size());
    EXPECT_EQ(std::memcmp(fresh.data(), after[i].data(), fresh.size() * sizeof(float)), 0)
        << "case " << i << ": " << common::WeightFormatName(cases[i].format)
        << " T=" << cases[i].T;
  }
}

TEST_F(CpuMoeTest, Bf16IoSwigluOaiAndAccumulate) {
  std::mt19937_64 rng(5);
  const int T = 5;
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 31);
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  std::vector<float> x = RandomX(T, kH, rng);
  for (float& v : x) v = common::Bf16ToFloat(common::FloatToBf16(3.0f * v));
  Options o;
  o.activation = Activation::kSwiGluOai;
  o.swiglu_limit = 0.5f;  // small, so the clamps are exercised
  std::vector<uint16_t> xb(x.size()), yb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = common::FloatToBf16(x[i]);
  ForwardStats st;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, xb.data(), DType::kBf16, yb.data(),
                      DType::kBf16, o, pool_, &st).ok());
  std::vector<double> ref, scale, flip;
  ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, RefOptions(o, st), true, &ref, &scale,
                   &flip);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(common::Bf16ToFloat(yb[i]), ref[i], 1e-2 * std::fabs(ref[i]) + 1e-4 * scale[i]);
  }
  std::vector<float> y(x.size(), 1.0f);
  o.accumulate = true;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o, pool_).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(y[i], 1.0 + ref[i], kRelFp32 * scale[i] + flip[i] + 1e-6);
  }
}

TEST_F(CpuMoeTest, BadInputIsAnError) {
  const HostBank hb = MakeRandomBank(WeightFormat::kQ4_0, 4, 64, 32, 1, false);
  std::vector<int32_t> ids = {0, 4};
  std::vector<float> w = {0.5f, 0.5f}, x(64), y(64);
  Options o;
  EXPECT_EQ(Forward(hb.bank, 1, 2, ids, w, x, absl::MakeSpan(y), o, pool_).code(),
            absl::StatusCode::kInvalidArgument);  // id >= E
  ids = {0, 1};
  EXPECT_EQ(Forward(hb.bank, 1, 3, ids, w, x, absl::MakeSpan(y), o, pool_).code(),
            absl::StatusCode::kInvalidArgument);  // shape
  std::vector<float> x_short(10);
  EXPECT_EQ(Forward(hb.bank, 1, 2, ids, w, x_short, absl::MakeSpan(y), o, pool_).code(),
            absl::StatusCode::kInvalidArgument);
  o.max_target = "NOT_A_TARGET";
  EXPECT_EQ(Forward(hb.bank, 1, 2, ids, w, x, absl::MakeSpan(y), o, pool_).code(),
            absl::StatusCode::kInvalidArgument);
  ExpertBank bad = hb.bank;
  bad.hidden = 48;
  EXPECT_EQ(Forward(bad, 1, 2, ids, w, x, absl::MakeSpan(y), Options(), pool_).code(),
            absl::StatusCode::kInvalidArgument);
  bad = hb.bank;
  bad.format = WeightFormat::kMxfp4;  // needs scales, has none
  EXPECT_EQ(Forward(bad, 1, 2, ids, w, x, absl::MakeSpan(y), Options(), pool_).code(),
            absl::StatusCode::kInvalidArgument);
}

// No abort on input-sized work: a call whose scratch (it grows with tokens and routes) cannot be
// allocated is ResourceExhausted, reads nothing (neither x nor the weights, which here are far
// too short) and leaves y alone; the next call works as before.
TEST_F(CpuMoeTest, ScratchBeyondMemoryIsResourceExhausted) {
  // With overcommit "always" (1) Linux would hand out the terabytes below on paper; the default
  // heuristic mode (0) and strict mode (2) refuse them.
  if (std::FILE* f = std::fopen("/proc/sys/vm/overcommit_memory", "r")) {
    const int mode = std::fgetc(f);
    std::fclose(f);
    if (mode == '1') GTEST_SKIP() << "vm.overcommit_memory=1 grants any allocation";
  }
  // 2^21 tokens x 8 routes of H = I = 16384: h, u and the per-route outputs take 1 TiB each.
  constexpr int kT = 1 << 21, kTopK = 8, kDim = 16384;
  static const uint16_t kNeverRead[64] = {};
  ExpertBank bank;
  bank.format = WeightFormat::kBf16;
  bank.num_experts = 2;
  bank.hidden = kDim;
  bank.intermediate = kDim;
  bank.gate_up_weights = kNeverRead;
  bank.down_weights = kNeverRead;
  std::vector<int32_t> ids(static_cast<size_t>(kT) * kTopK, 1);
  ids[0] = -1;  // padding, as anywhere
  std::vector<float> w(ids.size(), 0.125f);
  const float x[1] = {0.0f};
  float y[1] = {42.0f};
  Options o;
  o.onednn_min_tokens_per_expert = 0;
  for (bool dedup : {true, false}) {
    o.dedup = dedup;
    const absl::Status s =
        Forward(bank, kT, kTopK, ids, w, x, DType::kF32, y, DType::kF32, o, pool_);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(y[0], 42.0f);
  }
  // oneDNN's part of the call asks for [T, H] floats of its own first (128 GiB here).
  o.onednn_min_tokens_per_expert = 1;
  o.onednn_min_experts = 1;
  OnednnExperts onednn;
  const absl::Status s =
      Forward(bank, kT, kTopK, ids, w, x, DType::kF32, y, DType::kF32, o, pool_, nullptr, &onednn);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(y[0], 42.0f);

  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, 4, 64, 32, 1, false);
  std::vector<int32_t> small_ids = {0, 3};
  std::vector<float> small_w = {0.5f, 0.5f}, sx(64, 1.0f), sy(64, 0.0f);
  EXPECT_TRUE(Forward(hb.bank, 1, 2, small_ids, small_w, sx, absl::MakeSpan(sy), Options(), pool_)
                  .ok());
}

TEST_F(CpuMoeTest, PackPanelsRejectsWhatItCannotPack) {
  const HostBank bf = MakeRandomBank(WeightFormat::kBf16, 2, 64, 32, 1, false);
  absl::StatusOr<std::unique_ptr<PanelBank>> p = PackPanels(bf.bank);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("bf16"), std::string::npos) << p.status();
  ExpertBank bad = bf.bank;
  bad.layout = Layout::kPanels;  // bf16 in panels: Forward says so
  std::vector<int32_t> ids = {0, 1};
  std::vector<float> w = {0.5f, 0.5f}, x(64), y(64);
  const absl::Status st = Forward(bad, 1, 2, ids, w, x, absl::MakeSpan(y), Options(), pool_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("kPanels"), std::string::npos) << st;

  const HostBank q = MakeRandomBank(WeightFormat::kNvfp4, 2, 64, 32, 1, false);
  absl::StatusOr<std::unique_ptr<PanelBank>> once = PackPanels(q.bank);
  ASSERT_TRUE(once.ok()) << once.status();
  EXPECT_EQ((*once)->bank.BytesPerExpert(), q.bank.BytesPerExpert());
  EXPECT_EQ((*once)->gate_up.size(), 2 * q.bank.GateUpBytesPerExpert() - 2 * sizeof(float));
  EXPECT_EQ(PackPanels((*once)->bank).status().code(), absl::StatusCode::kInvalidArgument);
  ExpertBank no_scales = q.bank;
  no_scales.down_scales = nullptr;
  EXPECT_EQ(PackPanels(no_scales).status().code(), absl::StatusCode::kInvalidArgument);
}

// nvfp4 with the up rows' own global scales (ExpertBank::up_global_scales), on every target, row
// major and in panels, block-lane and plain: against the float64 reference on weights
// dequantized with each half's scale; without the up scales the same run misses the reference
// (the test can fail); with up scales equal to the gate's, bit-identical to the bank without
// them.
TEST_F(CpuMoeTest, Nvfp4UpGlobalScales) {
  std::mt19937_64 rng(2024);
  HostBank hb = MakeRandomBank(WeightFormat::kNvfp4, kE, kH, kI, 19);
  // Up rows' global scale 1.5-4.5x the gate's, differing per expert: the up rows now dequantize
  // to codes x block scale x their own global scale.
  std::vector<float> up_g(kE), same_g = hb.gate_up_g;
  for (int e = 0; e < kE; ++e) up_g[e] = hb.gate_up_g[e] * (1.5f + 0.2f * static_cast<float>(e));
  const size_t H = kH, I = kI;
  for (size_t e = 0; e < kE; ++e) {
    for (size_t r = I; r < 2 * I; ++r) {
      const size_t row = e * 2 * I + r;
      common::DequantizeRowNvfp4(hb.gate_up_w.data() + row * H / 2,
                                 hb.gate_up_s.data() + row * H / common::kNvfp4Block, up_g[e], H,
                                 hb.gate_up_f.data() + row * H);
    }
  }
  const ExpertBank gate_only = hb.bank;
  ExpertBank split = hb.bank, equal = hb.bank;
  split.up_global_scales = up_g.data();
  equal.up_global_scales = same_g.data();
  absl::StatusOr<std::unique_ptr<PanelBank>> split_p = PackPanels(split, &pool_);
  absl::StatusOr<std::unique_ptr<PanelBank>> equal_p = PackPanels(equal, &pool_);
  absl::StatusOr<std::unique_ptr<PanelBank>> gate_p = PackPanels(gate_only, &pool_);
  ASSERT_TRUE(split_p.ok() && equal_p.ok() && gate_p.ok());
  ASSERT_NE((*split_p)->bank.up_global_scales, nullptr);
  EXPECT_EQ((*gate_p)->bank.up_global_scales, nullptr);
  for (int T : {1, 5, 16}) {
    const Routing r = MakeRouting(T, kE, kTopK, 1.2, rng);
    const std::vector<float> x = RandomX(T, kH, rng);
    Options exact;
    exact.bf16_dot_product = false;
    std::vector<double> ref, scale, flip;
    ReferenceForward(hb, T, kTopK, r.ids, r.weights, x, exact, true, &ref, &scale, &flip);
    for (const std::string& target : AvailableTargets()) {
      for (int alt : {0, 1, 2}) {  // row major block-lane, row major plain, panels
        Options o;
        o.max_target = target;
        Tuning tu;
        tu.block_lane = alt == 0;
        const bool panel = alt == 2;
        const std::string what =
            absl::StrCat("T=", T, " target=", target, " block_lane=", alt == 0, " panels=", panel);
        auto run = [&](const ExpertBank& b) {
          std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
          EXPECT_TRUE(internal::Forward(b, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), o,
                                        tu, pool_)
                          .ok())
              << what;
          return y;
        };
        const std::vector<float> y_split = run(panel ? (*split_p)->bank : split);
        EXPECT_LE(WorstRatio(y_split, ref, scale, flip), 1.0) << what;
        const std::vector<float> y_gate = run(panel ? (*gate_p)->bank : gate_only);
        EXPECT_GT(WorstRatio(y_gate, ref, scale, flip), 10.0) << what;
        const std::vector<float> y_equal = run(panel ? (*equal_p)->bank : equal);
        EXPECT_EQ(std::memcmp(y_equal.data(), y_gate.data(), y_gate.size() * sizeof(float)), 0)
            << what;
      }
    }
  }
}

// Panel banks take whole panels per work item: row counts that are not multiples of 16 (and
// blocks with an odd number of panels) give the same results as the defaults.
TEST_F(CpuMoeTest, PanelItemRowsAnyValue) {
  std::mt19937_64 rng(41);
  const int T = 16;
  for (WeightFormat f : {WeightFormat::kQ4_0, WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 3);
    const std::unique_ptr<PanelBank> panels = PanelsOf(hb);
    ASSERT_NE(panels, nullptr);
    const Routing r = MakeRouting(T, kE, kTopK, 1.2, rng);
    const std::vector<float> x = RandomX(T, kH, rng);
    std::vector<float> y0(x.size()), y1(x.size());
    ASSERT_TRUE(Forward(panels->bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y0),
                        Options(), pool_).ok());
    for (auto [p1, p2] : {std::pair{1, 2}, std::pair{17, 48}, std::pair{40, 80}}) {
      Tuning tu;
      tu.pass1_rows = p1;
      tu.pass2_rows = p2;
      ASSERT_TRUE(internal::Forward(panels->bank, T, kTopK, r.ids, r.weights, x,
                                    absl::MakeSpan(y1), Options(), tu, pool_)
                      .ok());
      // Each output row's arithmetic is the same whatever panels it is computed beside.
      EXPECT_EQ(y0, y1) << common::WeightFormatName(f) << " pass1_rows=" << p1
                        << " pass2_rows=" << p2;
    }
  }
}

// The env switches are read each time options are built (a cached static would make both arms
// of an A/B comparison the same).
TEST_F(CpuMoeTest, EnvReadWhenOptionsAreBuilt) {
  setenv("MOE_CPU_DEDUP", "0", 1);
  setenv("MOE_CPU_MAX_TARGET", "SSE4", 1);
  setenv("MOE_CPU_DEBUG", "1", 1);
  Options a = Options::FromEnv();
  EXPECT_FALSE(a.dedup);
  EXPECT_TRUE(a.debug);
  EXPECT_EQ(a.max_target, "SSE4");
  setenv("MOE_CPU_DEDUP", "1", 1);
  unsetenv("MOE_CPU_MAX_TARGET");
  unsetenv("MOE_CPU_DEBUG");
  Options b = Options::FromEnv();
  EXPECT_TRUE(b.dedup);
  EXPECT_FALSE(b.debug);
  EXPECT_EQ(b.max_target, "");
  unsetenv("MOE_CPU_DEDUP");
  // And the cap takes effect.
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, 4, 64, 32, 1, false);
  std::vector<int32_t> ids = {0, 1};
  std::vector<float> w = {0.5f, 0.5f}, x(64, 1.0f), y(64);
  ForwardStats st;
  a.debug = false;
  ASSERT_TRUE(Forward(hb.bank, 1, 2, ids, w, x, absl::MakeSpan(y), a, pool_, &st).ok());
  EXPECT_EQ(st.target, "SSE4");
}

// MOE_CPU_BF16_DOT=0 turns the bf16 dot product off when options are built, and ForwardStats says
// which path ran: off when switched off, for other formats and at other targets than AVX3_DL; on
// by default where the CPU has AVX512_BF16 and AVX3_DL is the best target.
TEST_F(CpuMoeTest, Bf16DotEnvSwitchAndStats) {
  EXPECT_TRUE(Options().bf16_dot_product);
  setenv("MOE_CPU_BF16_DOT", "0", 1);
  const Options off = Options::FromEnv();
  EXPECT_FALSE(off.bf16_dot_product);
  unsetenv("MOE_CPU_BF16_DOT");
  const Options on = Options::FromEnv();
  EXPECT_TRUE(on.bf16_dot_product);

  std::mt19937_64 rng(12);
  const int T = 3;
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  const std::vector<float> x = RandomX(T, kH, rng);
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, kE, kH, kI, 13, false);
  std::vector<float> y_off(x.size()), y_on(x.size());
  ForwardStats st;
  st.bf16_dot_product = true;
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y_off), off, pool_,
                      &st).ok());
  EXPECT_FALSE(st.bf16_dot_product);
  const HostBank q4 = MakeRandomBank(WeightFormat::kQ4_0, kE, kH, kI, 13, false);
  std::vector<float> y(x.size());
  ASSERT_TRUE(
      Forward(q4.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), on, pool_, &st).ok());
  EXPECT_FALSE(st.bf16_dot_product) << "q4_0";
  for (const std::string& target : AvailableTargets()) {
    Options capped = on;
    capped.max_target = target;
    ASSERT_TRUE(
        Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y), capped, pool_, &st)
            .ok());
    EXPECT_EQ(st.bf16_dot_product, Bf16DotRunsAt(target)) << target;
  }

  if (!Bf16DotRunsAt(AvailableTargets().front())) {
    GTEST_SKIP() << "the best target is " << AvailableTargets().front()
                 << (__builtin_cpu_supports("avx512bf16") ? "" : " and the CPU lacks AVX512_BF16")
                 << ": the bf16 dot product cannot run here";
  }
  ASSERT_TRUE(Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y_on), on, pool_,
                      &st).ok());
  EXPECT_TRUE(st.bf16_dot_product);
  EXPECT_EQ(st.target, "AVX3_DL");
  EXPECT_NE(y_on, y_off);  // the activations were rounded to bf16
}

// MOE_CPU_AMX=0 and MOE_CPU_AMX_MIN_ROUTES reach the tuning when it is built; ForwardStats::amx
// says whether tiles ran: with every expert through AMX where the CPU has it, never with amx off,
// with amx_min_routes = 0, or for formats without it (q4_0); a negative threshold is rejected.
TEST_F(CpuMoeTest, AmxEnvSwitchAndStats) {
  EXPECT_TRUE(Tuning().amx);
  setenv("MOE_CPU_AMX", "0", 1);
  setenv("MOE_CPU_AMX_MIN_ROUTES", "5", 1);
  const Tuning env = Tuning::FromEnv();
  EXPECT_FALSE(env.amx);
  EXPECT_EQ(env.amx_min_routes, 5);
  unsetenv("MOE_CPU_AMX");
  unsetenv("MOE_CPU_AMX_MIN_ROUTES");
  EXPECT_TRUE(Tuning::FromEnv().amx);

  std::mt19937_64 rng(21);
  const int T = 3;
  const Routing r = MakeRouting(T, kE, kTopK, 0.0, rng);
  const std::vector<float> x = RandomX(T, kH, rng);
  std::vector<float> y(x.size());
  const std::string best = AvailableTargets().front();
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8Block, WeightFormat::kQ4_0}) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 23, false);
    const std::string what(common::WeightFormatName(f));
    auto run = [&](const Tuning& tu, ForwardStats* st) {
      return internal::Forward(hb.bank, T, kTopK, r.ids, r.weights, x, absl::MakeSpan(y),
                               Options(), tu, pool_, st);
    };
    Tuning all;
    all.amx_min_routes = 1;
    ForwardStats st;
    ASSERT_TRUE(run(all, &st).ok());
    EXPECT_EQ(st.amx, HasBf16Dot(f) && AmxRunsAt(best)) << what;
    Tuning off = all;
    off.amx = false;
    ASSERT_TRUE(run(off, &st).ok());
    EXPECT_FALSE(st.amx) << what;
    EXPECT_EQ(st.bf16_dot_product, HasBf16Dot(f) && Bf16DotRunsAt(best)) << what;
    Tuning none = all;
    none.amx_min_routes = 0;
    ASSERT_TRUE(run(none, &st).ok());
    EXPECT_FALSE(st.amx) << what;
    Tuning bad = all;
    bad.amx_min_routes = -5;
    const absl::Status s = run(bad, &st);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find("amx_min_routes"), absl::string_view::npos) << s;
  }
}

// The default thresholds (Tuning::kAuto): fp8 experts go through AMX from 5 routes, bf16
// experts from 12. Every token routes to experts 0..kTopK-1, so each has T routes.
TEST_F(CpuMoeTest, AmxDefaultThresholds) {
  const std::string best = AvailableTargets().front();
  std::mt19937_64 rng(22);
  struct Case {
    WeightFormat format;
    int T;
    bool amx;
  };
  for (const Case& c : {Case{WeightFormat::kBf16, 11, false}, Case{WeightFormat::kBf16, 12, true},
                        Case{WeightFormat::kFp8Block, 4, false},
                        Case{WeightFormat::kFp8Block, 5, true}}) {
    const HostBank hb = MakeRandomBank(c.format, kE, kH, kI, 24, false);
    std::vector<int32_t> ids;
    std::vector<float> w;
    for (int t = 0; t < c.T; ++t) {
      for (int j = 0; j < kTopK; ++j) {
        ids.push_back(j);
        w.push_back(1.0f / kTopK);
      }
    }
    const std::vector<float> x = RandomX(c.T, kH, rng);
    std::vector<float> y(x.size());
    Options o;
    o.onednn_min_tokens_per_expert = 0;  // the GEMV kernels, where AMX is decided
    ForwardStats st;
    ASSERT_TRUE(Forward(hb.bank, c.T, kTopK, ids, w, x, absl::MakeSpan(y), o, pool_, &st).ok());
    EXPECT_EQ(st.amx, c.amx && AmxRunsAt(best))
        << common::WeightFormatName(c.format) << " with " << c.T << " routes per expert";
  }
}

}  // namespace
}  // namespace moe::cpu_moe
