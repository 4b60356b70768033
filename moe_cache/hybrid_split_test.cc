#include "moe_cache/hybrid_split.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace moe_cache {
namespace {

std::vector<MissPlanEntry> Misses(int n) {
  std::vector<MissPlanEntry> m;
  for (int i = 0; i < n; ++i) m.push_back({100 + i, i});
  return m;
}

TEST(HybridSplitTest, ProportionalToBandwidth) {
  BandwidthProfile p{50.0, 50.0, true};
  MissSplit s = *SplitMisses(Misses(8), p);
  EXPECT_EQ(s.fetch.size(), 4u);
  EXPECT_EQ(s.cpu.size(), 4u);
  EXPECT_EQ(s.fetch[0].expert, 100);  // plan order: first misses are fetched
  EXPECT_EQ(s.cpu[0].expert, 104);
  p = {51.0, 17.0, true};  // 3:1
  s = *SplitMisses(Misses(8), p);
  EXPECT_EQ(s.fetch.size(), 6u);
  // 7 misses at 3:1: 5.25 ideal; fetch 5 -> max(5/51, 2/17) = 0.118, fetch 6 -> max(0.118, 0.059):
  // tie in the slower path -> fetch more.
  s = *SplitMisses(Misses(7), p);
  EXPECT_EQ(s.fetch.size() + s.cpu.size(), 7u);
  EXPECT_EQ(s.fetch.size(), 6u);
  p = {50.0, 0.0, true};
  EXPECT_EQ(SplitMisses(Misses(5), p)->fetch.size(), 5u);
  EXPECT_TRUE(SplitMisses(Misses(0), p)->fetch.empty());
  p = {0.0, 10.0, true};
  EXPECT_FALSE(SplitMisses(Misses(3), p).ok());
}

TEST(HybridSplitTest, FetchTableIsSplitMissesPerCount) {
  const BandwidthProfile p{51.0, 17.0, true};
  auto table = FetchTable(p, 16);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->size(), 17u);
  for (int n = 0; n <= 16; ++n) {
    EXPECT_EQ((*table)[n], static_cast<int32_t>(SplitMisses(Misses(n), p)->fetch.size()))
        << n << " misses";
  }
  EXPECT_EQ((*table)[8], 6);
  EXPECT_FALSE(FetchTable({0.0, 10.0, true}, 8).ok());
  EXPECT_FALSE(FetchTable(p, 0).ok());
}

TEST(HybridSplitTest, ProfileRoundTripAndErrors) {
  BandwidthProfile p{51.25, 74.5, false};
  auto back = ParseBandwidthProfile(SerializeBandwidthProfile(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->pcie_gather_gbps, 51.25);
  EXPECT_EQ(back->cpu_expert_gbps, 74.5);
  EXPECT_FALSE(back->contended);
  back = ParseBandwidthProfile("# c\n pcie_gather_gbps = 40 # x\n\ncpu_expert_gbps=60\n");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->contended);
  auto err = [](const std::string& text, const std::string& what) {
    auto r = ParseBandwidthProfile(text);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(what), absl::string_view::npos) << r.status();
  };
  err("pcie_gather_gbps=40\n", "missing cpu_expert_gbps");
  err("pcie_gather_gbps=abc\ncpu_expert_gbps=1\n", "line 1");
  err("pcie_gather_gbps=4\ncpu_expert_gbps=1\npcie_gather_gbps=5\n", "duplicate");
  err("pcie_gbps=4\n", "unknown key 'pcie_gbps'");
  err("just text\n", "key=value");
  err("pcie_gather_gbps=-4\ncpu_expert_gbps=1\n", "positive");
  const std::string path = std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp") +
                           "/profile.txt";
  ASSERT_TRUE(WriteBandwidthProfile(p, path).ok());
  EXPECT_EQ(ReadBandwidthProfile(path)->cpu_expert_gbps, 74.5);
  EXPECT_EQ(ReadBandwidthProfile(path + ".none").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe_cache
}  // namespace moe
