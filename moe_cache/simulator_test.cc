#include "moe_cache/simulator.h"

#include "gtest/gtest.h"
#include "moe_cache/synthetic_trace.h"

namespace moe {
namespace moe_cache {
namespace {

Trace Synthetic(double zipf, double reuse, uint64_t seed) {
  SyntheticTraceConfig c;
  c.layers = 12;
  c.experts = 32;
  c.k = 4;
  c.tokens = 300;
  c.zipf = zipf;
  c.reuse = reuse;
  c.seed = seed;
  return *GenerateSyntheticTrace(c);
}

double Hit(const Trace& t, SimPolicy p, int32_t slots) {
  SimOptions o;
  o.experts = 32;
  return Simulate(t, p, slots, o)->hit_rate();
}

TEST(SimulatorTest, ScoredClosesPartOfTheGapOnSkewedRouting) {
  // Not the tuning traces (seed 7, L=48): smaller shape, other seeds.
  for (uint64_t seed : {11, 12}) {
    const Trace t = Synthetic(1.0, 0.3, seed);
    const int32_t slots = 12 * 32 / 4;
    const double lru = Hit(t, SimPolicy::kLru, slots);
    const double bel = Hit(t, SimPolicy::kBelady, slots);
    EXPECT_GE(GapClosed(lru, bel, Hit(t, SimPolicy::kScored, slots)), 0.2) << seed;
    EXPECT_GE(GapClosed(lru, bel, Hit(t, SimPolicy::kPinnedScored, slots)), 0.2) << seed;
  }
}

TEST(SimulatorTest, ScoredNotWorseThanLruOnUniformRouting) {
  const Trace t = Synthetic(0, 0, 13);
  for (int32_t slots : {38, 96, 192}) {
    EXPECT_GE(Hit(t, SimPolicy::kScored, slots), Hit(t, SimPolicy::kLru, slots) - 0.01) << slots;
    EXPECT_GE(Hit(t, SimPolicy::kPinnedScored, slots), Hit(t, SimPolicy::kLru, slots) - 0.01);
  }
}

TEST(SimulatorTest, ReportsAndValidates) {
  const Trace t = Synthetic(1.0, 0.3, 1);
  SimOptions o;
  o.bytes_per_expert = 2e9;
  SimResult r = *Simulate(t, SimPolicy::kLru, 50, o);
  EXPECT_EQ(r.tokens, 300u);
  EXPECT_DOUBLE_EQ(r.fetched_gb_per_token(), r.misses_per_token() * 2);
  EXPECT_FALSE(Simulate(t, SimPolicy::kLru, 0, o).ok());
  o.experts = 8;  // ids go up to 31
  EXPECT_FALSE(Simulate(t, SimPolicy::kScored, 50, o).ok());
  EXPECT_EQ(*ParseSimPolicy("pinned_scored"), SimPolicy::kPinnedScored);
  EXPECT_FALSE(ParseSimPolicy("fifo").ok());
  EXPECT_DOUBLE_EQ(GapClosed(0.5, 0.7, 0.6), 0.5);
  // With every expert fitting, everything but the cold misses hits, for every policy.
  for (SimPolicy p : AllSimPolicies()) {
    r = *Simulate(t, p, 12 * 32, SimOptions());
    EXPECT_LE(r.misses, 12u * 32) << SimPolicyName(p);
  }
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
