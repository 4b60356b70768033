#include "moe_cache/pinning.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"
#include "moe_cache/ensure_cpu.h"
#include "moe_cache/synthetic_trace.h"

namespace moe {
namespace moe_cache {
namespace {

TEST(PinningTest, BudgetRespectsFractionAndReserve) {
  PinningConfig c;
  c.pin_fraction = 0.5;
  EXPECT_EQ(HotPinner::Create(2, 8, 10, 2, c)->budget(), 5);
  c.pin_fraction = 1.0;
  EXPECT_EQ(HotPinner::Create(2, 8, 10, 2, c)->budget(), 8);
  c.adapt_every = 0;
  EXPECT_FALSE(HotPinner::Create(2, 8, 10, 2, c).ok());
  c.adapt_every = 1;
  c.pin_fraction = 2;
  EXPECT_FALSE(HotPinner::Create(2, 8, 10, 2, c).ok());
}

struct PinRun {
  uint64_t swaps_late = 0;       // swaps after warm-up (token 500 on)
  int adaptations_late = 0;
  int max_swaps_seen = 0;
  HotPinner pinner;
};

PinRun RunPinner(double margin) {
  SyntheticTraceConfig sc;
  sc.layers = 4;
  sc.experts = 32;
  sc.k = 4;
  sc.tokens = 2000;
  sc.zipf = 1.2;
  sc.reuse = 0.2;
  Trace t = *GenerateSyntheticTrace(sc);
  PinningConfig pc;
  pc.pin_fraction = 0.25;
  pc.adapt_every = 8;
  pc.max_swaps = 4;
  pc.margin = margin;
  PinRun run{0, 0, 0, *HotPinner::Create(4, 32, 40, 4, pc)};
  for (int32_t tok = 0; tok < t.tokens; ++tok) {
    for (int32_t l = 0; l < t.layers; ++l) {
      EXPECT_TRUE(run.pinner.Observe(l, absl::MakeConstSpan(t.Row(tok, l), t.k)).ok());
    }
    const uint64_t before = run.pinner.total_swaps();
    run.pinner.EndStep();
    const int swaps = static_cast<int>(run.pinner.total_swaps() - before);
    run.max_swaps_seen = std::max(run.max_swaps_seen, swaps);
    if (tok >= 500) {
      run.swaps_late += swaps;
      run.adaptations_late += (tok + 1) % 8 == 0;
    }
    EXPECT_LE(run.pinner.num_pinned(), 10);
  }
  return run;
}

TEST(PinningTest, PinsTheHottestAndStaysStableOnAStationaryTrace) {
  PinRun run = RunPinner(0.25);
  const HotPinner& pinner = run.pinner;
  ASSERT_EQ(pinner.budget(), 10);
  EXPECT_EQ(pinner.num_pinned(), 10);
  EXPECT_LE(run.max_swaps_seen, 4);  // the cap holds at every adaptation
  // No thrash: on stationary routing, after warm-up, well under one swap per adaptation (a
  // thrashing pinner would use its cap, 4, at every one of them).
  EXPECT_LE(run.swaps_late * 2, static_cast<uint64_t>(run.adaptations_late))
      << run.swaps_late << " swaps in " << run.adaptations_late << " adaptations";
  // Hysteresis is what keeps it calm: without a margin the same trace swaps more.
  EXPECT_GT(RunPinner(0.0).swaps_late, run.swaps_late);
  // The pinned experts are among the hottest.
  int hot_pinned = 0;
  for (int32_t g = 0; g < 4 * 32; ++g) {
    if (!pinner.IsPinned(g)) continue;
    int hotter = 0;
    for (int32_t h = 0; h < 4 * 32; ++h) hotter += pinner.heat(h) > pinner.heat(g);
    hot_pinned += hotter < 20;
  }
  EXPECT_EQ(hot_pinned, 10);
}

TEST(PinningTest, PaddingIsNotHeat) {
  PinningConfig pc;
  pc.adapt_every = 1;
  HotPinner p = *HotPinner::Create(1, 4, 4, 1, pc);
  std::vector<int32_t> ids = {-1, -1, -7};
  ASSERT_TRUE(p.Observe(0, ids).ok());
  p.EndStep();
  for (int32_t g = 0; g < 4; ++g) EXPECT_EQ(p.heat(g), 0.0);
  EXPECT_EQ(p.num_pinned(), 0);
}

// An id >= E is InvalidArgument and observes nothing (not even the row's valid ids); so is a
// layer out of range.
TEST(PinningTest, IdAtOrAboveExpertsIsInvalidArgument) {
  PinningConfig pc;
  pc.adapt_every = 1;
  HotPinner p = *HotPinner::Create(1, 4, 4, 1, pc);
  std::vector<int32_t> ids = {2, -1, 4};
  EXPECT_EQ(p.Observe(0, ids).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> ok = {2};
  EXPECT_EQ(p.Observe(1, ok).code(), absl::StatusCode::kInvalidArgument);
  p.EndStep();
  for (int32_t g = 0; g < 4; ++g) EXPECT_EQ(p.heat(g), 0.0);
}

TEST(PinningTest, PinnedExpertsStayResidentInTheCache) {
  CacheConfig cc;
  cc.num_layers = 1;
  cc.num_experts = 16;
  cc.num_slots = 4;
  cc.params = DefaultPolicyParams(kPolicyLru);
  CpuExpertCache cache = *CpuExpertCache::Create(cc);
  cache.SetPinned(5, true);
  std::vector<int32_t> first = {5};
  ASSERT_TRUE(cache.Ensure(0, first, 1, 1).ok());
  const int32_t slot = cache.SlotOf(5);
  for (int32_t e = 0; e < 16; ++e) {
    if (e == 5) continue;
    std::vector<int32_t> ids = {e};
    ASSERT_TRUE(cache.Ensure(0, ids, 1, 1).ok());
    EXPECT_EQ(cache.SlotOf(5), slot);
  }
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
