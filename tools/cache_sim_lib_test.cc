#include "tools/cache_sim_lib.h"

#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe {
namespace tools {
namespace {

TEST(CacheSimTest, RejectsBadFlagsWithClearMessages) {
  auto err = [](std::vector<std::string> args, const std::string& what) {
    auto o = ParseCacheSimArgs(args);
    ASSERT_FALSE(o.ok());
    EXPECT_NE(o.status().message().find(what), absl::string_view::npos) << o.status();
  };
  err({}, "exactly one of --trace");
  err({"--synthetic", "--trace", "x.npy"}, "exactly one of --trace");
  err({"--synthetic", "--slots", "10,abc"}, "--slots=abc");
  err({"--synthetic", "--zipf", "-1"}, "--zipf");
  err({"--synthetic", "--bogus", "1"}, "unknown flag --bogus");
  err({"--synthetic", "--policies", "lru,fifo"}, "unknown policy 'fifo'");
  err({"--trace", "x.npy", "--zipf", "1"}, "only apply to --synthetic");
  err({"--synthetic", "--topk", "9", "--experts", "8"}, "--topk 9 exceeds");
  err({"--synthetic", "--slots"}, "needs a value");
  EXPECT_TRUE(ParseCacheSimArgs({"--help"})->help);
  EXPECT_NE(CacheSimUsage().find("--slots_frac"), std::string::npos);
}

TEST(CacheSimTest, JsonLinesHaveTheRequiredKeys) {
  auto o = ParseCacheSimArgs({"--synthetic", "--layers=4", "--experts=16", "--topk=2",
                              "--tokens=50", "--slots=8,16", "--json"});
  ASSERT_TRUE(o.ok()) << o.status();
  std::ostringstream out;
  ASSERT_TRUE(RunCacheSim(*o, out).ok());
  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 10u);  // 5 policies x 2 slot counts
  for (const std::string& line : lines) {
    nlohmann::json j = nlohmann::json::parse(line);
    for (const char* key :
         {"policy", "slots", "hit_rate", "misses_per_token", "fetched_gb_per_token"}) {
      EXPECT_TRUE(j.contains(key)) << key << " in " << line;
    }
  }
  EXPECT_EQ(nlohmann::json::parse(lines[0])["policy"], "lru");
  EXPECT_EQ(nlohmann::json::parse(lines[4])["policy"], "belady");
}

TEST(CacheSimTest, TableAndMissingTrace) {
  auto o = ParseCacheSimArgs({"--synthetic", "--layers=2", "--experts=8", "--topk=2",
                              "--tokens=20", "--slots_frac=0.5", "--policies=scored"});
  ASSERT_TRUE(o.ok()) << o.status();
  std::ostringstream out;
  ASSERT_TRUE(RunCacheSim(*o, out).ok());
  EXPECT_NE(out.str().find("scored"), std::string::npos);
  EXPECT_NE(out.str().find("gap_closed"), std::string::npos);
  o = ParseCacheSimArgs({"--trace", "/nonexistent/trace.npy"});
  ASSERT_TRUE(o.ok());
  absl::Status s = RunCacheSim(*o, out);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/trace.npy"), absl::string_view::npos);
}

TEST(CacheSimTest, GpuBudgetSetsTheSlotCount) {
  // 1 GB at 100 MB per expert is 10 slots; 0.05 GB holds none.
  auto o = ParseCacheSimArgs({"--synthetic", "--layers=4", "--experts=16", "--topk=2",
                              "--tokens=20", "--bytes_per_expert=1e8",
                              "--gpu_expert_budget_gb=1", "--json", "--policies=lru"});
  ASSERT_TRUE(o.ok()) << o.status();
  std::ostringstream out;
  ASSERT_TRUE(RunCacheSim(*o, out).ok());
  EXPECT_EQ(nlohmann::json::parse(out.str())["slots"], 10);
  o = ParseCacheSimArgs({"--synthetic", "--bytes_per_expert=1e8", "--gpu_expert_budget_gb=0.05"});
  ASSERT_TRUE(o.ok());
  absl::Status s = RunCacheSim(*o, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("holds no expert"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace tools
}  // namespace moe
