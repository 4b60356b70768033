// ParseCommandLine accepts dashed flag names, and the flags become ModelEngineOptions and
// GpuEngineOptions; bad values name their flag.
#include "engine/engine_flags.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
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
                                   "--gpu-expert-budget-gb=12.5",
                                   "--moe-cache-policy",
                                   "pinned",
                                   "--adapt-every=32",
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
  auto g = GpuEngineOptionsFromFlags();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->expert_budget_gb, 12.5);
  EXPECT_EQ(g->cache_policy, moe_cache::kPolicyScored);
  EXPECT_TRUE(g->pin_hot_experts);
  EXPECT_EQ(g->adapt_every, 32);
  absl::SetFlag(&FLAGS_gpu_expert_budget_gb, 0.0);
  absl::SetFlag(&FLAGS_moe_cache_policy, "scored");
  absl::SetFlag(&FLAGS_adapt_every, 16);
  absl::SetFlag(&FLAGS_expert_format, "auto");
}

TEST(EngineFlagsTest, ExpertFormatDefaultsToTheCheckpointsOwn) {
  // Nothing set: "auto", which LoadModel resolves from the checkpoint.
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag("expert_format");
  ASSERT_NE(flag, nullptr);
  EXPECT_EQ(flag->DefaultValue(), "auto");
  absl::SetFlag(&FLAGS_expert_format, "auto");
  auto o = ModelEngineOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->expert_format, "auto");
  EXPECT_EQ(ModelEngineOptions().expert_format, "auto");
  for (const char* f : {"bf16", "fp8_block", "q4_0", "nvfp4", "mxfp4"}) {
    absl::SetFlag(&FLAGS_expert_format, f);
    auto named = ModelEngineOptionsFromFlags();
    ASSERT_TRUE(named.ok()) << f << ": " << named.status();
    EXPECT_EQ(named->expert_format, f);
  }
  // A typo fails at parse time, naming the flag and the accepted values.
  absl::SetFlag(&FLAGS_expert_format, "nvfp");
  auto bad = ModelEngineOptionsFromFlags();
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--expert_format"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("must be auto"), std::string::npos) << bad.status();
  absl::SetFlag(&FLAGS_expert_format, "auto");
}

TEST(EngineFlagsTest, BadValuesNameTheFlag) {
  absl::SetFlag(&FLAGS_max_batch, 0);
  auto o = ModelEngineOptionsFromFlags();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("max_batch"), std::string::npos);
  absl::SetFlag(&FLAGS_max_batch, 64);
}

TEST(EngineFlagsTest, CachePolicyNamesMapToPolicyCoreIds) {
  const std::pair<const char*, int32_t> policies[] = {{"lru", moe_cache::kPolicyLru},
                                                      {"lfu", moe_cache::kPolicyLfu},
                                                      {"scored", moe_cache::kPolicyScored}};
  for (const auto& [name, id] : policies) {
    absl::SetFlag(&FLAGS_moe_cache_policy, name);
    auto p = GpuEngineOptionsFromFlags();
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->cache_policy, id) << name;
    EXPECT_FALSE(p->pin_hot_experts) << name;
  }
  absl::SetFlag(&FLAGS_moe_cache_policy, "scored");
}

TEST(EngineFlagsTest, BadGpuEngineFlagsNameTheFlag) {
  auto expect_error = [](const std::string& flag, const std::string& want) {
    auto o = GpuEngineOptionsFromFlags();
    ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(o.status().message().find(want), std::string::npos) << o.status();
    // The CPU engine's options fail on them too: a typo never passes silently.
    EXPECT_EQ(ModelEngineOptionsFromFlags().status().code(), absl::StatusCode::kInvalidArgument);
  };
  absl::SetFlag(&FLAGS_moe_cache_policy, "mru");
  expect_error("moe_cache_policy",
               "--moe_cache_policy=mru: must be one of lru, lfu, scored, pinned");
  absl::SetFlag(&FLAGS_moe_cache_policy, "scored");
  absl::SetFlag(&FLAGS_gpu_expert_budget_gb, -1.0);
  expect_error("gpu_expert_budget_gb", "--gpu_expert_budget_gb=-1: must be >= 0");
  absl::SetFlag(&FLAGS_gpu_expert_budget_gb, std::nan(""));
  expect_error("gpu_expert_budget_gb", "--gpu_expert_budget_gb=nan");
  absl::SetFlag(&FLAGS_gpu_expert_budget_gb, 0.0);
  absl::SetFlag(&FLAGS_adapt_every, 0);
  expect_error("adapt_every", "--adapt_every=0: must be >= 1");
  absl::SetFlag(&FLAGS_adapt_every, 16);
  absl::SetFlag(&FLAGS_moe_mode, "cpu");
  expect_error("moe_mode", "--moe_mode=cpu: must be one of offload, hybrid, auto");
  absl::SetFlag(&FLAGS_moe_mode, "offload");
  EXPECT_TRUE(GpuEngineOptionsFromFlags().ok());
  EXPECT_TRUE(ModelEngineOptionsFromFlags().ok());
}

TEST(EngineFlagsTest, MoeModesAndTheProfilePath) {
  const std::pair<const char*, GpuEngineOptions::MoeMode> modes[] = {
      {"offload", GpuEngineOptions::MoeMode::kOffload},
      {"hybrid", GpuEngineOptions::MoeMode::kHybrid},
      {"auto", GpuEngineOptions::MoeMode::kAuto}};
  for (const auto& [name, mode] : modes) {
    absl::SetFlag(&FLAGS_moe_mode, name);
    auto o = GpuEngineOptionsFromFlags();
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->moe_mode, mode) << name;
  }
  absl::SetFlag(&FLAGS_moe_mode, "offload");
  auto o = GpuEngineOptionsFromFlags();
  ASSERT_TRUE(o.ok());
  EXPECT_NE(o->bandwidth_profile.find(".cache/moe-offload/bandwidth_profile.txt"),
            std::string::npos);
  absl::SetFlag(&FLAGS_bandwidth_profile, "/tmp/p.txt");
  EXPECT_EQ(GpuEngineOptionsFromFlags()->bandwidth_profile, "/tmp/p.txt");
  absl::SetFlag(&FLAGS_bandwidth_profile, "");
}

}  // namespace
}  // namespace moe::engine
