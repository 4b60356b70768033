// ParseCommandLine accepts dashed flag names, and the flags become ModelEngineOptions.
#include "engine/engine_flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

TEST(EngineFlagsTest, DashedNamesAndValuesReachTheOptions) {
  std::vector<std::string> args = {"prog",
                                   "--expert-format=q4_0",
                                   "--max-batch",
                                   "8",
                                   "--kv_blocks=100",
                                   "--deterministic",
                                   "positional",
                                   "--",
                                   "--not-a-flag"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const std::vector<char*> rest =
      ParseCommandLine(static_cast<int>(argv.size()), argv.data(), "usage");
  auto o = ModelEngineOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->expert_format, "q4_0");
  EXPECT_EQ(o->max_batch, 8);
  EXPECT_EQ(o->kv_blocks, 100);
  EXPECT_TRUE(o->deterministic);
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(std::string(rest[1]), "positional");
  EXPECT_EQ(std::string(rest[2]), "--not-a-flag");  // after "--": left alone
}

TEST(EngineFlagsTest, BadValuesNameTheFlag) {
  absl::SetFlag(&FLAGS_max_batch, 0);
  auto o = ModelEngineOptionsFromFlags();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("max_batch"), std::string::npos);
  absl::SetFlag(&FLAGS_max_batch, 64);
}

}  // namespace
}  // namespace moe::engine
