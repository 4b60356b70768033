#include "moe_cache/ensure_cpu.h"

#include <vector>

#include "gtest/gtest.h"
#include "moe_cache/synthetic_trace.h"

namespace moe {
namespace moe_cache {
namespace {

CpuExpertCache MakeCache(int32_t L, int32_t E, int32_t S, int32_t policy) {
  CacheConfig c;
  c.num_layers = L;
  c.num_experts = E;
  c.num_slots = S;
  c.params = DefaultPolicyParams(policy);
  auto cache = CpuExpertCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return std::move(cache).value();
}

EnsureResult Ensure(CpuExpertCache& c, int32_t layer, std::vector<int32_t> ids, int32_t T = 1) {
  auto r = c.Ensure(layer, ids, T, static_cast<int32_t>(ids.size()) / T);
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(EnsureCpuTest, FillsFreeSlotsInOrderThenHits) {
  CpuExpertCache c = MakeCache(2, 8, 4, kPolicyLru);
  EnsureResult r = Ensure(c, 0, {3, 5});
  EXPECT_EQ(r.slots, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(r.plan.size(), 2u);
  EXPECT_EQ(r.plan[0].expert, 3);
  EXPECT_EQ(r.plan[0].slot, 0);
  EXPECT_EQ(r.plan[1].expert, 5);
  EXPECT_EQ(r.counts.misses, 2);
  r = Ensure(c, 0, {5, 3});
  EXPECT_EQ(r.slots, (std::vector<int32_t>{1, 0}));
  EXPECT_TRUE(r.plan.empty());
  EXPECT_EQ(r.counts.hits, 2);
  EXPECT_EQ(c.call_counter(), 3u);
}

// The hybrid split: of a call's n distinct misses, fetch_of_misses[n] take slots (the most
// frequent first, ties by first occurrence) and the rest are computed on the CPU, taking none.
TEST(EnsureCpuTest, HybridSplitFetchesTheHotMissesAndSendsTheRestToTheCpu) {
  CacheConfig config;
  config.num_layers = 1;
  config.num_experts = 8;
  config.num_slots = 4;
  config.params = DefaultPolicyParams(kPolicyLru);
  config.fetch_of_misses = {0, 1, 1, 2, 2, 3, 3, 4, 4};  // fetch half, rounded up
  auto c = CpuExpertCache::Create(config);
  ASSERT_TRUE(c.ok()) << c.status();
  // Two tokens of top-2: experts 3, 5, 3, 6 -> misses 3, 5, 6 (3 distinct): fetch 2, CPU 1.
  EnsureResult r = Ensure(*c, 0, {3, 5, 3, 6}, 2);
  EXPECT_EQ(r.slots, (std::vector<int32_t>{0, 1, 0, kCpuSlot}));
  ASSERT_EQ(r.plan.size(), 2u);
  EXPECT_EQ(r.counts.misses, 3);
  EXPECT_EQ(r.counts.cpu, 1);
  EXPECT_EQ(c->SlotOf(6), -1);  // no slot for the CPU's expert
  EXPECT_EQ(c->expert_of_slot()[2], -1);
  // Next call: 3 hits; 7 and 6 miss (7 routed first). 6 was routed in the last call, 7 never:
  // 6 is fetched, 7 computed on the CPU.
  r = Ensure(*c, 0, {7, 3, 6, 3}, 2);
  EXPECT_EQ(r.counts.hits, 1);
  EXPECT_EQ(r.counts.cpu, 1);
  EXPECT_EQ(r.slots, (std::vector<int32_t>{kCpuSlot, 0, 2, 0}));
  EXPECT_EQ(c->SlotOf(6), 2);
  EXPECT_EQ(c->SlotOf(7), -1);
  // Equal frequencies: the first routed is fetched. 1 and 2 never seen, 1 first.
  r = Ensure(*c, 0, {1, 2}, 1);
  EXPECT_EQ(r.slots, (std::vector<int32_t>{3, kCpuSlot}));
}

TEST(EnsureCpuTest, HybridSplitTableMustCoverEveryMissCount) {
  CacheConfig config;
  config.num_layers = 1;
  config.num_experts = 8;
  config.num_slots = 4;
  config.fetch_of_misses = {0, 1, 2};
  EXPECT_FALSE(CpuExpertCache::Create(config).ok());
}

TEST(EnsureCpuTest, LruEvictsLeastRecentlyUsedAndNeverTheCurrentCall) {
  CpuExpertCache c = MakeCache(1, 8, 2, kPolicyLru);
  Ensure(c, 0, {0});
  Ensure(c, 0, {1});
  Ensure(c, 0, {0});  // 1 is now least recent
  EnsureResult r = Ensure(c, 0, {2});
  EXPECT_EQ(c.SlotOf(1), -1);
  EXPECT_EQ(r.plan[0].slot, 1);
  // A call with two experts, one resident: the miss must not evict the hit even though it is LRU-older.
  Ensure(c, 0, {0});
  r = Ensure(c, 0, {2, 3});  // 2 is a hit (older than 0), 3 misses: victim must be 0's slot
  EXPECT_EQ(r.counts.hits, 1);
  EXPECT_GE(c.SlotOf(2), 0);
  EXPECT_GE(c.SlotOf(3), 0);
  EXPECT_EQ(c.SlotOf(0), -1);
}

TEST(EnsureCpuTest, PaddingIsSkippedEverywhere) {
  CpuExpertCache c = MakeCache(2, 8, 4, kPolicyScored);
  EnsureResult r = Ensure(c, 1, {2, -1, -1, 7}, 2);
  EXPECT_EQ(r.slots, (std::vector<int32_t>{0, -1, -1, 1}));
  EXPECT_EQ(r.counts.padding, 2);
  EXPECT_EQ(r.counts.misses, 2);
  EXPECT_EQ(r.plan.size(), 2u);
  // Expert 0 (what a clamp would turn padding into) was never touched.
  EXPECT_EQ(c.SlotOf(1 * 8 + 0), -1);
  EXPECT_EQ(c.freq()[1 * 8 + 0], 0u);
  // Any negative id is padding (ids >= E are errors: see below).
  r = Ensure(c, 1, {-8, -100});
  EXPECT_EQ(r.slots, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(r.counts.padding, 2);
}

TEST(EnsureCpuTest, DuplicateIdsInOneCallCountOnceAndShareASlot) {
  CpuExpertCache c = MakeCache(1, 8, 4, kPolicyLru);
  EnsureResult r = Ensure(c, 0, {4, 4, 4, 1}, 2);
  EXPECT_EQ(r.slots, (std::vector<int32_t>{0, 0, 0, 1}));
  EXPECT_EQ(r.counts.misses, 2);
  EXPECT_EQ(r.plan.size(), 2u);
  r = Ensure(c, 0, {4, 4}, 2);
  EXPECT_EQ(r.counts.hits, 1);
}

TEST(EnsureCpuTest, PinnedExpertsNeverLeaveAndOverflowIsUnplaced) {
  CpuExpertCache c = MakeCache(1, 8, 2, kPolicyScored);
  c.SetPinned(0, true);
  c.SetPinned(1, true);
  Ensure(c, 0, {0});
  Ensure(c, 0, {1});
  EnsureResult r = Ensure(c, 0, {2, 3});
  EXPECT_EQ(r.slots, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(r.counts.misses, 2);
  EXPECT_EQ(r.counts.unplaced, 2);
  EXPECT_TRUE(r.plan.empty());
  EXPECT_GE(c.SlotOf(0), 0);
  EXPECT_GE(c.SlotOf(1), 0);
  c.SetPinned(1, false);
  r = Ensure(c, 0, {2});
  EXPECT_EQ(c.SlotOf(1), -1);
  EXPECT_GE(c.SlotOf(0), 0);
}

TEST(EnsureCpuTest, ScoredKeepsTheNextLayerUnderCyclicAccess) {
  // L = 4 layers visited cyclically, one expert each, 3 slots: LRU evicts the expert of the layer
  // about to run (every access misses); the scored policy evicts the one needed last.
  for (int32_t policy : {kPolicyLru, kPolicyScored}) {
    CpuExpertCache c = MakeCache(4, 2, 3, policy);
    int hits = 0;
    for (int t = 0; t < 40; ++t) {
      for (int l = 0; l < 4; ++l) hits += Ensure(c, l, {0}).counts.hits;
    }
    if (policy == kPolicyLru) {
      EXPECT_EQ(hits, 0);
    } else {
      EXPECT_GT(hits, 40 * 4 / 2);
    }
  }
}

TEST(EnsureCpuTest, RejectsBadShapes) {
  CpuExpertCache c = MakeCache(2, 8, 4, kPolicyLru);
  std::vector<int32_t> ids = {1, 2, 3};
  EXPECT_FALSE(c.Ensure(2, ids, 1, 3).ok());
  EXPECT_FALSE(c.Ensure(-1, ids, 1, 3).ok());
  EXPECT_FALSE(c.Ensure(0, ids, 2, 2).ok());
  CacheConfig bad;
  EXPECT_FALSE(CpuExpertCache::Create(bad).ok());
  bad.num_layers = bad.num_experts = bad.num_slots = 1;
  bad.params.policy = 9;
  EXPECT_FALSE(CpuExpertCache::Create(bad).ok());
}

// The id rule: ids < 0 are padding (counted as such, slot -1); an id >= E is InvalidArgument and
// leaves the state as it was (no slot filled, no counter advanced).
TEST(EnsureCpuTest, IdAtOrAboveExpertsIsInvalidArgumentAndChangesNothing) {
  CpuExpertCache c = MakeCache(2, 8, 4, kPolicyLru);
  const uint32_t counter = c.call_counter();
  std::vector<int32_t> ids = {1, 8, 2};
  absl::StatusOr<EnsureResult> r = c.Ensure(0, ids, 1, 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.call_counter(), counter);
  for (int32_t s : c.expert_of_slot()) EXPECT_EQ(s, -1);
  ids = {1, -1, -9};
  r = c.Ensure(0, ids, 1, 3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->counts.padding, 2);
  EXPECT_EQ(r->counts.misses, 1);
  EXPECT_EQ(r->slots[1], -1);
  EXPECT_EQ(r->slots[2], -1);
}

TEST(EnsureCpuTest, MirrorIsDeterministicAndStateStaysConsistent) {
  SyntheticTraceConfig sc;
  sc.layers = 6;
  sc.experts = 16;
  sc.k = 4;
  sc.tokens = 200;
  sc.seed = 3;
  Trace t = *GenerateSyntheticTrace(sc);
  for (int32_t policy : {kPolicyLru, kPolicyLfu, kPolicyScored}) {
    CpuExpertCache a = MakeCache(6, 16, 20, policy), b = MakeCache(6, 16, 20, policy);
    for (int32_t tok = 0; tok < t.tokens; ++tok) {
      for (int32_t l = 0; l < t.layers; ++l) {
        std::vector<int32_t> ids(t.Row(tok, l), t.Row(tok, l) + t.k);
        if (tok % 7 == 0) ids[1] = -1;  // some padding
        EnsureResult ra = Ensure(a, l, ids), rb = Ensure(b, l, ids);
        ASSERT_EQ(ra.slots, rb.slots);
        ASSERT_EQ(ra.plan.size(), rb.plan.size());
        for (size_t i = 0; i < ra.plan.size(); ++i) {
          ASSERT_EQ(ra.plan[i].expert, rb.plan[i].expert);
          ASSERT_EQ(ra.plan[i].slot, rb.plan[i].slot);
        }
        // Every routed id maps to a slot holding exactly that expert.
        for (size_t i = 0; i < ids.size(); ++i) {
          if (ids[i] < 0) continue;
          ASSERT_GE(ra.slots[i], 0);
          ASSERT_EQ(a.expert_of_slot()[ra.slots[i]], l * 16 + ids[i]);
        }
      }
    }
    EXPECT_EQ(a.slot_of(), b.slot_of());
    EXPECT_EQ(a.expert_of_slot(), b.expert_of_slot());
    EXPECT_EQ(a.freq(), b.freq());
    // slot_of and expert_of_slot are inverse maps.
    for (int32_t s = 0; s < 20; ++s) {
      if (a.expert_of_slot()[s] >= 0) {
        EXPECT_EQ(a.SlotOf(a.expert_of_slot()[s]), s);
      }
    }
  }
}

TEST(PolicyCoreTest, FrequencyEmaConvergesAndDecays) {
  uint32_t freq = 0, counter = 1;
  uint8_t pinned = 0;
  int32_t slot_of = -1, eos = -1;
  uint32_t last_use = 0;
  CacheStateView v{&slot_of, &eos, &last_use, &freq, &pinned, &counter, 1, 1, 1,
                   DefaultPolicyParams(kPolicyScored)};
  for (int i = 0; i < 2000; ++i) UpdateFrequency(&v, 0, true);
  EXPECT_GT(freq, kFreqOne * 95 / 100);
  EXPECT_LE(freq, kFreqOne);
  for (int i = 0; i < 2000; ++i) UpdateFrequency(&v, 0, false);
  EXPECT_LT(freq, kFreqOne / 100);
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
