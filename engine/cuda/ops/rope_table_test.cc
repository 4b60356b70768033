// BuildRopeCosSin holds exactly the CPU RopeTable's values (default and YaRN), checked through
// RopeTable::Apply on (1, 0) pairs, which returns its cos and sin unchanged. Runs without a GPU.
#include "engine/cuda/ops/rope_table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/model_config.h"
#include "engine/rope.h"
#include "gtest/gtest.h"

namespace moe::engine::gpu {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

ModelConfig RopeConfig(bool yarn, int head_dim) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = yarn ? 131072 : 40960;
  if (yarn) {
    c.rope_scaling.type = "yarn";
    c.rope_scaling.factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 32768;
  }
  return c;
}

TEST(RopeTableTest, HoldsTheCpuTablesValues) {
  for (bool yarn : {false, true}) {
    for (int hd : {128, 40}) {
      const int max_pos = 32768;
      auto params = ComputeRopeParams(RopeConfig(yarn, hd));
      ASSERT_TRUE(params.ok()) << params.status();
      if (yarn) {
        EXPECT_GT(params->attention_factor, 1.0f);
      }
      auto table = BuildRopeCosSin(*params, hd, max_pos);
      ASSERT_TRUE(table.ok()) << table.status();
      ASSERT_EQ(table->cos.size(), static_cast<size_t>(max_pos) * hd / 2);
      const RopeTable cpu(*params, hd, max_pos);
      for (int pos : {0, 1, 17, 4095, 32767}) {
        std::vector<float> v(hd, 0.0f);
        std::fill(v.begin(), v.begin() + hd / 2, 1.0f);
        cpu.Apply(v.data(), 1, pos);
        for (int i = 0; i < hd / 2; ++i) {
          const size_t at = static_cast<size_t>(pos) * hd / 2 + i;
          ASSERT_EQ(Bits(v[i]), Bits(table->cos[at])) << yarn << " " << hd << " " << pos;
          ASSERT_EQ(Bits(v[i + hd / 2]), Bits(table->sin[at])) << yarn << " " << hd << " " << pos;
        }
      }
    }
  }
}

TEST(RopeTableTest, RejectsMismatchedSizes) {
  auto params = ComputeRopeParams(RopeConfig(false, 128));
  ASSERT_TRUE(params.ok());
  EXPECT_FALSE(BuildRopeCosSin(*params, 64, 10).ok());
  EXPECT_FALSE(BuildRopeCosSin(*params, 128, 0).ok());
}

}  // namespace
}  // namespace moe::engine::gpu
