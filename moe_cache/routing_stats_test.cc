#include "moe_cache/routing_stats.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "moe_cache/ensure_cpu.h"
#include "moe_cache/simulator.h"
#include "moe_cache/synthetic_trace.h"

namespace moe {
namespace moe_cache {
namespace {

// Replays a trace with batches of T tokens per call and returns its stats.
RoutingStats Replay(const Trace& t, int32_t experts, int32_t slots, int32_t T, int32_t k_padded) {
  CacheConfig c;
  c.num_layers = t.layers;
  c.num_experts = experts;
  c.num_slots = slots;
  c.params = DefaultPolicyParams(kPolicyScored);
  CpuExpertCache cache = *CpuExpertCache::Create(c);
  RoutingStats stats(t.layers, experts, 1e6);
  for (int32_t tok = 0; tok < t.tokens; ++tok) {
    for (int32_t l = 0; l < t.layers; ++l) {
      // One real row plus (T - 1) fully padded rows, each row widened to k_padded with -1.
      std::vector<int32_t> ids(static_cast<size_t>(T) * k_padded, -1);
      for (int32_t j = 0; j < t.k; ++j) ids[j] = t.Row(tok, l)[j];
      EnsureResult r = *cache.Ensure(l, ids, T, k_padded);
      EXPECT_TRUE(stats.AddCall(l, ids, r.counts).ok());
    }
    stats.AddTokens(1);
  }
  return stats;
}

TEST(RoutingStatsTest, PaddingDoesNotChangeCounts) {
  SyntheticTraceConfig sc;
  sc.layers = 3;
  sc.experts = 16;
  sc.k = 4;
  sc.tokens = 100;
  Trace t = *GenerateSyntheticTrace(sc);
  RoutingStats plain = Replay(t, 16, 12, 1, 4);
  RoutingStats padded = Replay(t, 16, 12, 3, 6);
  EXPECT_EQ(plain.counts, padded.counts);
  EXPECT_EQ(plain.hits, padded.hits);
  EXPECT_EQ(plain.misses, padded.misses);
  uint64_t total = 0;
  for (uint64_t c : plain.counts) total += c;
  EXPECT_EQ(total, 100u * 3 * 4);
  EXPECT_DOUBLE_EQ(plain.bytes_fetched(), plain.misses * 1e6);
  EXPECT_DOUBLE_EQ(plain.misses_per_token(), plain.misses / 100.0);
}

TEST(BeladyTest, HandExample) {
  // One layer, k = 1, 2 slots, requests a b c a b c.
  Trace t;
  t.tokens = 6;
  t.layers = 1;
  t.k = 1;
  t.ids = {0, 1, 2, 0, 1, 2};
  ReplayCounts r = *ReplayBelady(t, 3, 2);
  // a b c(evict b) a(hit) b(evict a or c: c next at 5, a never -> evict a) c(hit).
  EXPECT_EQ(r.misses, 4u);
  EXPECT_EQ(r.hits, 2u);
  EXPECT_FALSE(ReplayBelady(t, 3, 0).ok());
}

// Ids < 0 are padding; an id >= E is InvalidArgument and adds nothing.
TEST(RoutingStatsTest, IdAtOrAboveExpertsIsInvalidArgument) {
  RoutingStats stats(2, 4, 1e6);
  EnsureCounts outcome;
  outcome.hits = 1;
  std::vector<int32_t> ids = {1, -1, 4};
  EXPECT_EQ(stats.AddCall(0, ids, outcome).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stats.AddCall(2, {}, outcome).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stats.hits, 0u);
  for (uint64_t c : stats.counts) EXPECT_EQ(c, 0u);
  ids = {1, -1, -5};
  ASSERT_TRUE(stats.AddCall(1, ids, outcome).ok());
  EXPECT_EQ(stats.counts[1 * 4 + 1], 1u);
  EXPECT_EQ(stats.hits, 1u);
}

TEST(BeladyTest, IdAtOrAboveExpertsIsInvalidArgument) {
  Trace t;
  t.tokens = 2;
  t.layers = 1;
  t.k = 1;
  t.ids = {0, 3};
  EXPECT_EQ(ReplayBelady(t, 3, 2).status().code(), absl::StatusCode::kInvalidArgument);
  t.ids = {0, -1};
  EXPECT_TRUE(ReplayBelady(t, 3, 2).ok());
}

TEST(BeladyTest, NeverBeatenByAnOnlinePolicyOnRandomSmallTraces) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    Trace t;
    t.layers = 1 + rng() % 4;
    t.k = 1 + rng() % 3;
    t.tokens = 1 + rng() % 40;
    const int32_t experts = t.k + rng() % 6;
    t.ids.resize(static_cast<size_t>(t.tokens) * t.layers * t.k);
    for (int32_t& v : t.ids) v = (rng() % 8 == 0) ? -1 : static_cast<int32_t>(rng() % experts);
    const int32_t slots = t.k + rng() % 8;
    SimOptions o;
    o.experts = experts;
    o.pinning.adapt_every = 1 + rng() % 4;
    o.pinning.pin_fraction = 0.5;
    const SimResult best = *Simulate(t, SimPolicy::kBelady, slots, o);
    for (SimPolicy p : {SimPolicy::kLru, SimPolicy::kLfu, SimPolicy::kScored,
                        SimPolicy::kPinnedScored}) {
      const SimResult r = *Simulate(t, p, slots, o);
      ASSERT_EQ(r.hits + r.misses, best.hits + best.misses);
      ASSERT_LE(r.hits, best.hits) << "trial " << trial << " policy " << SimPolicyName(p);
    }
  }
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
