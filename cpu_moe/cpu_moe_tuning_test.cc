// The internal tuning (cpu_moe/internal/tuning.h: prefetch distances, rows per work item, row
// streams, overlapped passes): every setting gives y bit for bit equal to the defaults', and bad
// values are InvalidArgument.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/test_bank.h"
#include "gtest/gtest.h"

namespace moe::cpu_moe {
namespace {

using common::WeightFormat;
using internal::Tuning;
using testing::HostBank;
using testing::MakeRandomBank;

// As in cpu_moe_test: block-lane chunks and plain tails in quantized rows, fp8 tails.
constexpr int kE = 16, kH = 480, kI = 288, kTopK = 4;

struct Case {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<float> x;
};

Case MakeCase(int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int t = 0; t < T; ++t) {
    // Distinct experts per token, skewed towards low ids so that T=16 shares experts.
    std::vector<int> pool;
    for (int e = 0; e < kE; ++e) pool.push_back(e);
    for (int j = 0; j < kTopK; ++j) {
      const int i = static_cast<int>(rng() % std::min<size_t>(pool.size(), 6));
      c.ids.push_back(pool[i]);
      pool.erase(pool.begin() + i);
      c.weights.push_back(uw(rng));
    }
  }
  c.x.resize(static_cast<size_t>(T) * kH);
  for (float& v : c.x) v = n(rng);
  return c;
}

std::vector<float> RunForward(const ExpertBank& bank, int T, const Case& c, const Options& o,
                              const Tuning& tu, common::ThreadPool& pool) {
  std::vector<float> y(c.x.size(), 0.0f);
  const absl::Status st =
      internal::Forward(bank, T, kTopK, c.ids, c.weights, c.x, absl::MakeSpan(y), o, tu, pool);
  EXPECT_TRUE(st.ok()) << st;
  return y;
}

// bf16 and fp8_block (with the bf16 dot product off, on, and on with AMX for every expert; fp8
// also on without its fp16 kernels) and
// q4_0 (row-major and in panels, Layout::kPanels) x
// every compiled+supported target x T in {1, 16} x dedup on/off: each tuning setting, with the
// passes overlapped and not, gives the defaults' y bit for bit. The settings include pass-1 row
// counts that do and do not allow the overlap (multiples of the activation block or not; kH and
// kI leave a 32-column fp8 tail). oneDNN is off (its runs differ run to run; it does not use
// these options).
TEST(CpuMoeTuningTest, EverySettingIsBitIdenticalToDefaults) {
  common::ThreadPool pool(2);
  struct Setting {
    int prefetch, pass1, pass2;
    bool overlap;
    int streams;
    int prefetch_l2 = 0;
  };
  std::vector<Setting> settings;
  for (bool overlap : {true, false}) {
    for (int streams : {2, 4}) {
      for (int pf : {0, 256, 4096}) {
        for (int p1 : {16, 64}) {
          for (int p2 : {16, 64}) settings.push_back({pf, p1, p2, overlap, streams});
        }
      }
      // Extremes: 1-row pass-1 items, one row pair per pass-2 item; the largest values; odd
      // pass-1 blocks and pass-2 blocks that four streams do not divide.
      settings.push_back({64, 1, 2, overlap, streams});
      settings.push_back({Tuning::kMaxPrefetchBytes, 3, Tuning::kMaxRowsPerItem, overlap, streams});
      settings.push_back({1024, Tuning::kMaxRowsPerItem, 6, overlap, streams});
      settings.push_back({1024, 32, 128, overlap, streams});
      settings.push_back({512, 7, 10, overlap, streams});
    }
  }
  // The L2 prefetch stream off, at its extremes and in between, in turn over the settings.
  const int kL2[] = {0, 8192, 64, Tuning::kMaxPrefetchL2Bytes, 4096};
  for (size_t i = 0; i < settings.size(); ++i) settings[i].prefetch_l2 = kL2[i % 5];
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8Block, WeightFormat::kQ4_0}) {
    const HostBank hb = MakeRandomBank(f, kE, kH, kI, 41 + static_cast<int>(f), false);
    std::unique_ptr<PanelBank> panels;
    if (f == WeightFormat::kQ4_0) {
      absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb.bank);
      ASSERT_TRUE(pb.ok()) << pb.status();
      panels = std::move(*pb);
    }
    for (const std::string& target : AvailableTargets()) {
      for (int T : {1, 16}) {
        const Case c = MakeCase(T, 100 + T);
        for (bool dedup : {true, false}) {
          // bf16 and fp8: the bf16 dot product off, on (AMX for experts with the default
          // number of routes; fp8: the others through fp16 where the CPU has it), on with every
          // expert through AMX (where the CPU has it); fp8 also on without fp16 (4); q4_0:
          // row-major (0) and in panels (3).
          for (int variant : {0, 1, 2, 3, 4}) {
            if (f == WeightFormat::kQ4_0 ? variant == 1 || variant == 2 : variant == 3) continue;
            if (variant == 4 && f != WeightFormat::kFp8Block) continue;
            const bool dot = variant == 1 || variant == 2 || variant == 4;
            const ExpertBank& bank = variant == 3 ? panels->bank : hb.bank;
            Options o;
            o.max_target = target;
            o.dedup = dedup;
            o.bf16_dot_product = dot;
            o.onednn_min_tokens_per_expert = 0;
            Tuning base;
            if (variant == 2) base.amx_min_routes = 1;
            base.fp8_fp16 = variant != 4;
            const std::vector<float> y0 = RunForward(bank, T, c, o, base, pool);
            for (const Setting& s : settings) {
              Tuning tu = base;
              tu.prefetch_bytes = s.prefetch;
              tu.prefetch_l2_bytes = s.prefetch_l2;
              tu.pass1_rows = s.pass1;
              tu.pass2_rows = s.pass2;
              tu.overlap_passes = s.overlap;
              tu.row_streams = s.streams;
              const std::vector<float> y = RunForward(bank, T, c, o, tu, pool);
              // memcmp: bit for bit (NaN-safe, -0 vs +0 distinguished).
              EXPECT_EQ(std::memcmp(y.data(), y0.data(), y.size() * sizeof(float)), 0)
                  << common::WeightFormatName(f) << " " << target << " T=" << T
                  << " dedup=" << dedup << " variant=" << variant << " prefetch=" << s.prefetch
                  << " prefetch_l2=" << s.prefetch_l2 << " pass1=" << s.pass1
                  << " pass2=" << s.pass2 << " overlap=" << s.overlap << " streams=" << s.streams;
            }
          }
        }
      }
    }
  }
}

TEST(CpuMoeTuningTest, BadValuesAreInvalidArgument) {
  common::ThreadPool pool(2);
  const HostBank hb = MakeRandomBank(WeightFormat::kBf16, 4, 64, 32, 1, false);
  std::vector<int32_t> ids = {0, 1};
  std::vector<float> w = {0.5f, 0.5f}, x(64, 1.0f), y(64);
  auto run = [&](const Tuning& t) {
    return internal::Forward(hb.bank, 1, 2, ids, w, x, absl::MakeSpan(y), Options(), t, pool);
  };
  struct Bad {
    int prefetch, pass1, pass2;
    const char* name;
  };
  for (const Bad& b : {Bad{-64, 16, 16, "prefetch_bytes"}, Bad{100, 16, 16, "prefetch_bytes"},
                       Bad{8192 + 64, 16, 16, "prefetch_bytes"}, Bad{1024, 0, 16, "pass1_rows"},
                       Bad{1024, -2, 16, "pass1_rows"}, Bad{1024, 513, 16, "pass1_rows"},
                       Bad{1024, 16, 0, "pass2_rows"}, Bad{1024, 16, 15, "pass2_rows"},
                       Bad{1024, 16, 514, "pass2_rows"}}) {
    Tuning o;
    o.prefetch_bytes = b.prefetch;
    o.pass1_rows = b.pass1;
    o.pass2_rows = b.pass2;
    const absl::Status st = run(o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.name;
    EXPECT_NE(std::string(st.message()).find(b.name), std::string::npos) << st;
  }
  // The bounds themselves are accepted.
  for (const Bad& b : {Bad{0, 1, 2, ""}, Bad{8192, 256, 256, ""}, Bad{64, 16, 16, ""}}) {
    Tuning o;
    o.prefetch_bytes = b.prefetch;
    o.pass1_rows = b.pass1;
    o.pass2_rows = b.pass2;
    EXPECT_TRUE(run(o).ok());
  }
  for (int streams : {0, 1, 3, 8, std::numeric_limits<int>::min()}) {
    Tuning o;
    o.row_streams = streams;
    const absl::Status st = run(o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << streams;
    EXPECT_NE(std::string(st.message()).find("row_streams"), std::string::npos) << st;
  }
  for (int l2 : {-64, 100, Tuning::kMaxPrefetchL2Bytes + 64, std::numeric_limits<int>::min()}) {
    Tuning o;
    o.prefetch_l2_bytes = l2;
    const absl::Status st = run(o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << l2;
    EXPECT_NE(std::string(st.message()).find("prefetch_l2_bytes"), std::string::npos) << st;
  }
  for (int l2 : {0, 64, Tuning::kMaxPrefetchL2Bytes}) {
    Tuning o;
    o.prefetch_l2_bytes = l2;
    EXPECT_TRUE(run(o).ok()) << l2;
  }
}

// Read at FromEnv() time, every time; garbage becomes an error in Forward, not the default.
TEST(CpuMoeTuningTest, EnvReadWhenTuningIsBuilt) {
  const Tuning d;
  EXPECT_EQ(d.prefetch_bytes, Tuning::kAuto);
  EXPECT_EQ(d.prefetch_l2_bytes, Tuning::kAuto);
  EXPECT_EQ(d.pass1_rows, Tuning::kAuto);
  EXPECT_EQ(d.pass2_rows, Tuning::kAuto);
  EXPECT_TRUE(d.overlap_passes);
  EXPECT_TRUE(d.block_lane);
  setenv("MOE_CPU_BLOCK_LANE", "0", 1);
  EXPECT_FALSE(Tuning::FromEnv().block_lane);
  unsetenv("MOE_CPU_BLOCK_LANE");
  setenv("MOE_CPU_OVERLAP", "0", 1);
  EXPECT_FALSE(Tuning::FromEnv().overlap_passes);
  unsetenv("MOE_CPU_OVERLAP");
  EXPECT_TRUE(Tuning::FromEnv().overlap_passes);
  setenv("MOE_CPU_PREFETCH_BYTES", "2048", 1);
  setenv("MOE_CPU_PASS1_ROWS", "32", 1);
  setenv("MOE_CPU_PASS2_ROWS", "64", 1);
  setenv("MOE_CPU_ROW_STREAMS", "4", 1);
  setenv("MOE_CPU_PREFETCH_L2_BYTES", "16384", 1);
  const Tuning a = Tuning::FromEnv();
  EXPECT_EQ(a.prefetch_l2_bytes, 16384);
  setenv("MOE_CPU_PREFETCH_L2_BYTES", "0", 1);
  EXPECT_EQ(Tuning::FromEnv().prefetch_l2_bytes, 0);
  unsetenv("MOE_CPU_PREFETCH_L2_BYTES");
  EXPECT_EQ(Tuning::FromEnv().prefetch_l2_bytes, Tuning::kAuto);
  EXPECT_EQ(a.row_streams, 4);
  unsetenv("MOE_CPU_ROW_STREAMS");
  EXPECT_EQ(Tuning::FromEnv().row_streams, Tuning::kAuto);
  EXPECT_EQ(a.prefetch_bytes, 2048);
  EXPECT_EQ(a.pass1_rows, 32);
  EXPECT_EQ(a.pass2_rows, 64);
  setenv("MOE_CPU_PREFETCH_BYTES", "0", 1);
  setenv("MOE_CPU_PASS1_ROWS", "abc", 1);
  unsetenv("MOE_CPU_PASS2_ROWS");
  const Tuning b = Tuning::FromEnv();
  EXPECT_EQ(b.prefetch_bytes, 0);
  EXPECT_EQ(b.pass1_rows, std::numeric_limits<int>::min());
  EXPECT_EQ(b.pass2_rows, Tuning::kAuto);
  unsetenv("MOE_CPU_PREFETCH_BYTES");
  unsetenv("MOE_CPU_PASS1_ROWS");
  const Tuning c = Tuning::FromEnv();
  EXPECT_EQ(c.prefetch_bytes, Tuning::kAuto);
  EXPECT_EQ(c.pass1_rows, Tuning::kAuto);
}

}  // namespace
}  // namespace moe::cpu_moe
