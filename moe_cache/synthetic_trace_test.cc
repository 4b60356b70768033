#include "moe_cache/synthetic_trace.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace moe_cache {
namespace {

SyntheticTraceConfig Config(double zipf, double reuse, uint64_t seed) {
  SyntheticTraceConfig c;
  c.layers = 4;
  c.experts = 32;
  c.k = 4;
  c.tokens = 300;
  c.zipf = zipf;
  c.reuse = reuse;
  c.seed = seed;
  return c;
}

double ReuseRate(const Trace& t) {
  int64_t reused = 0, total = 0;
  for (int32_t tok = 1; tok < t.tokens; ++tok) {
    for (int32_t l = 0; l < t.layers; ++l) {
      std::set<int32_t> prev(t.Row(tok - 1, l), t.Row(tok - 1, l) + t.k);
      for (int32_t j = 0; j < t.k; ++j) reused += prev.count(t.Row(tok, l)[j]);
      total += t.k;
    }
  }
  return double(reused) / total;
}

TEST(SyntheticTraceTest, ShapeDistinctIdsAndDeterminism) {
  Trace a = *GenerateSyntheticTrace(Config(1.0, 0.3, 5));
  Trace b = *GenerateSyntheticTrace(Config(1.0, 0.3, 5));
  Trace c = *GenerateSyntheticTrace(Config(1.0, 0.3, 6));
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_NE(a.ids, c.ids);
  ASSERT_EQ(a.ids.size(), 300u * 4 * 4);
  for (int32_t tok = 0; tok < a.tokens; ++tok) {
    for (int32_t l = 0; l < a.layers; ++l) {
      std::set<int32_t> row(a.Row(tok, l), a.Row(tok, l) + a.k);
      EXPECT_EQ(row.size(), 4u);
      EXPECT_GE(*row.begin(), 0);
      EXPECT_LT(*row.rbegin(), 32);
    }
  }
}

TEST(SyntheticTraceTest, ReuseAndSkewBehaveAsDocumented) {
  // Uniform, no reuse: about k/E of the previous experts come back by chance.
  EXPECT_LT(ReuseRate(*GenerateSyntheticTrace(Config(0, 0, 1))), 0.2);
  EXPECT_GT(ReuseRate(*GenerateSyntheticTrace(Config(0, 0.6, 1))), 0.55);
  // Skew: the hottest expert of a layer is routed far more often under zipf 1.5 than uniform.
  auto top_share = [](const Trace& t) {
    std::vector<int> counts(32);
    for (int32_t tok = 0; tok < t.tokens; ++tok) {
      for (int32_t j = 0; j < t.k; ++j) ++counts[t.Row(tok, 0)[j]];
    }
    return double(*std::max_element(counts.begin(), counts.end())) / t.tokens;
  };
  EXPECT_GT(top_share(*GenerateSyntheticTrace(Config(1.5, 0, 2))), 0.6);
  EXPECT_LT(top_share(*GenerateSyntheticTrace(Config(0, 0, 2))), 0.3);
}

TEST(SyntheticTraceTest, RejectsBadParameters) {
  SyntheticTraceConfig c = Config(1, 0.3, 1);
  c.k = 33;
  EXPECT_FALSE(GenerateSyntheticTrace(c).ok());
  c = Config(-1, 0.3, 1);
  EXPECT_FALSE(GenerateSyntheticTrace(c).ok());
  c = Config(1, 1.5, 1);
  EXPECT_FALSE(GenerateSyntheticTrace(c).ok());
  c = Config(1, 0.3, 1);
  c.layers = 0;
  EXPECT_FALSE(GenerateSyntheticTrace(c).ok());
  // Extreme skew still terminates with distinct ids.
  c = Config(16, 0, 1);
  c.k = 32;
  EXPECT_TRUE(GenerateSyntheticTrace(c).ok());
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
