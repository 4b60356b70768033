// The host-side parts of the CUDA backend, on any machine: ExpertStoreFromBanks copies cpu_moe
// banks byte for byte into the loader's store layout (and replicates a few experts over a larger
// store); GpuModel::Create without a device reports Unavailable instead of failing otherwise.
#include <cstring>
#include <vector>

#include "common/cuda_status.h"
#include "engine/cuda/gpu_model.h"
#include "engine/random_model.h"
#include "gtest/gtest.h"

namespace moe::engine::gpu {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.intermediate_size = 64;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  return c;
}

class ExpertStoreFromBanksTest : public ::testing::TestWithParam<common::WeightFormat> {};

TEST_P(ExpertStoreFromBanksTest, CopiesEveryExpertByteForByte) {
  RandomModelOptions ro;
  ro.expert_format = GetParam();
  auto rm = MakeRandomModel(SmallConfig(), ro);
  ASSERT_TRUE(rm.ok()) << rm.status();
  auto store = ExpertStoreFromBanks(rm->banks);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ((*store)->num_layers(), 2);
  ASSERT_EQ((*store)->num_experts(), 4);
  const cpu_moe::ExpertBank& b = rm->banks[1];
  const uint64_t gu = b.GateUpBytesPerExpert(), dn = b.DownBytesPerExpert();
  EXPECT_EQ((*store)->bytes_per_expert(), gu + dn);
  for (int e = 0; e < 4; ++e) {
    const int g = 1 * 4 + e;
    EXPECT_EQ(std::memcmp((*store)->expert_bank(g, 0),
                          static_cast<const uint8_t*>(b.gate_up_weights) + e * gu, gu),
              0)
        << e;
    EXPECT_EQ(std::memcmp((*store)->expert_bank(g, 1),
                          static_cast<const uint8_t*>(b.down_weights) + e * dn, dn),
              0)
        << e;
  }
}

TEST_P(ExpertStoreFromBanksTest, ReplicatesFewExpertsOverALargerStore) {
  RandomModelOptions ro;
  ro.expert_format = GetParam();
  auto rm = MakeRandomModel(SmallConfig(), ro);
  ASSERT_TRUE(rm.ok()) << rm.status();
  auto store = ExpertStoreFromBanks(rm->banks, /*num_layers=*/5, /*num_experts=*/10);
  ASSERT_TRUE(store.ok()) << store.status();
  const uint64_t gu = rm->banks[0].GateUpBytesPerExpert();
  for (int l = 0; l < 5; ++l) {
    for (int e = 0; e < 10; ++e) {
      const cpu_moe::ExpertBank& b = rm->banks[l % 2];
      EXPECT_EQ(std::memcmp((*store)->expert_bank(l * 10 + e, 0),
                            static_cast<const uint8_t*>(b.gate_up_weights) + (e % 4) * gu, gu),
                0)
          << l << " " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, ExpertStoreFromBanksTest,
                         ::testing::Values(common::WeightFormat::kBf16,
                                           common::WeightFormat::kQ4_0));

TEST(ExpertStoreFromBanksTest, RejectsMixedShapes) {
  auto a = MakeRandomModel(SmallConfig(), {});
  ModelConfig c2 = SmallConfig();
  c2.moe_intermediate_size = 64;
  auto b = MakeRandomModel(c2, {});
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<cpu_moe::ExpertBank> banks = {a->banks[0], b->banks[0]};
  EXPECT_EQ(ExpertStoreFromBanks(banks).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertStoreFromBanks({}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GpuModelHostTest, UnavailableWithoutADevice) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a device is present";
  RandomModelOptions ro;
  ro.dense_dtype = DType::kBf16;
  auto rm = MakeRandomModel(SmallConfig(), ro);
  ASSERT_TRUE(rm.ok()) << rm.status();
  auto store = ExpertStoreFromBanks(rm->banks);
  ASSERT_TRUE(store.ok());
  auto m = GpuModel::Create(rm->weights.get(), store->get(), {});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
}

}  // namespace
}  // namespace moe::engine::gpu
