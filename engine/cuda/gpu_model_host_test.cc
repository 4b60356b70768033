// The host-side parts of the CUDA backend, on any machine: ExpertStoreFromBanks copies cpu_moe
// banks byte for byte into the loader's store layout, every bank of the format (and replicates a
// few experts over a larger store); the GPU kernels' banks per format are the loader's;
// GpuModel::Create without a device reports Unavailable instead of failing otherwise.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cuda_status.h"
#include "engine/cuda/experts/routed_experts.h"
#include "engine/cuda/gpu_model.h"
#include "engine/loader.h"
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

// The banks the GPU kernels read (ExpertBankSizes) are the loader's (ExpertBankLayout), name for
// name and byte for byte, for every format the GPU computes.
TEST(ExpertBankLayoutTest, GpuBanksAreTheLoaders) {
  const int shapes[][2] = {{2048, 768}, {96, 160}, {128, 128}, {544, 352}};
  for (auto f : {common::WeightFormat::kBf16, common::WeightFormat::kQ4_0,
                 common::WeightFormat::kFp8Block, common::WeightFormat::kNvfp4}) {
    for (const auto& shape : shapes) {
      SCOPED_TRACE(std::string(common::WeightFormatName(f)) + " H=" + std::to_string(shape[0]) +
                   " I=" + std::to_string(shape[1]));
      auto layout = ExpertBankLayout(f, shape[0], shape[1]);
      auto sizes = ExpertBankSizes(f, shape[0], shape[1]);
      ASSERT_TRUE(layout.ok()) << layout.status();
      ASSERT_TRUE(sizes.ok()) << sizes.status();
      ASSERT_EQ(layout->num_banks(), static_cast<int>(sizes->size()));
      for (int b = 0; b < layout->num_banks(); ++b) {
        EXPECT_EQ(layout->bank(b).name, std::string((*sizes)[b].name));
        EXPECT_EQ(layout->bank(b).bytes, (*sizes)[b].bytes) << layout->bank(b).name;
      }
    }
  }
}

// A cpu_moe bank of random bytes in `format`'s layout (fp8_block row-major with dense block
// scales; nvfp4 in panels, global scales 4 floats apart as a store's rows hold them, up's own or
// none), owning its memory.
struct RandomBytesBank {
  cpu_moe::ExpertBank bank;
  std::vector<uint8_t> gate_up, down, gate_up_scales, down_scales;
  std::vector<float> gate_g, up_g, down_g;
};

std::unique_ptr<RandomBytesBank> MakeRandomBytesBank(common::WeightFormat format, int E, int H,
                                                     int I, bool own_up_scale, uint32_t seed) {
  auto r = std::make_unique<RandomBytesBank>();
  std::mt19937 rng(seed);
  auto fill = [&](std::vector<uint8_t>& v, size_t n) {
    v.resize(n);
    for (uint8_t& x : v) x = static_cast<uint8_t>(rng());
  };
  cpu_moe::ExpertBank& b = r->bank;
  b.format = format;
  b.num_experts = E;
  b.hidden = H;
  b.intermediate = I;
  if (format == common::WeightFormat::kFp8Block) {
    fill(r->gate_up, size_t{2} * I * H * E);
    fill(r->down, size_t{1} * H * I * E);
    fill(r->gate_up_scales, size_t{4} * ((2 * I + 127) / 128) * ((H + 127) / 128) * E);
    fill(r->down_scales, size_t{4} * ((H + 127) / 128) * ((I + 127) / 128) * E);
    b.gate_up_scales = r->gate_up_scales.data();
    b.down_scales = r->down_scales.data();
  } else {
    fill(r->gate_up, size_t{2} * I * (H / 2 + H / 16) * E);
    fill(r->down, size_t{1} * H * (I / 2 + I / 16) * E);
    b.layout = cpu_moe::Layout::kPanels;
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    for (auto* g : {&r->gate_g, &r->up_g, &r->down_g}) {
      g->resize(4 * E);
      for (float& x : *g) x = u(rng);
    }
    b.global_scale_stride = 4;
    b.gate_up_global_scales = r->gate_g.data();
    b.up_global_scales = own_up_scale ? r->up_g.data() : nullptr;
    b.down_global_scales = r->down_g.data();
  }
  b.gate_up_weights = r->gate_up.data();
  b.down_weights = r->down.data();
  return r;
}

// fp8_block and nvfp4 banks: every store bank holds the cpu_moe bank's bytes for every expert
// (nvfp4's up rows take the gate's global scale where the bank has none of their own), and the
// store's view reads back as the same cpu_moe bank.
TEST(ExpertStoreFromBanksTest, CopiesEveryBankOfFp8BlockAndNvfp4) {
  struct Case {
    common::WeightFormat format;
    bool own_up_scale;
  };
  const int E = 3, H = 512, I = 128;  // fp8 scale rows of 32 and 16 bytes: dense in the store
  for (const Case& c :
       {Case{common::WeightFormat::kFp8Block, false}, Case{common::WeightFormat::kNvfp4, true},
        Case{common::WeightFormat::kNvfp4, false}}) {
    SCOPED_TRACE(std::string(common::WeightFormatName(c.format)) +
                 (c.own_up_scale ? " own up scale" : ""));
    std::vector<std::unique_ptr<RandomBytesBank>> owned;
    std::vector<cpu_moe::ExpertBank> banks;
    for (int l = 0; l < 2; ++l) {
      owned.push_back(MakeRandomBytesBank(c.format, E, H, I, c.own_up_scale, 7 + l));
      banks.push_back(owned.back()->bank);
    }
    auto store = ExpertStoreFromBanks(banks);
    ASSERT_TRUE(store.ok()) << store.status();
    const moe_cache::BankLayout& lay = (*store)->layout();
    ASSERT_EQ(lay.num_banks(), c.format == common::WeightFormat::kFp8Block ? 4 : 5);
    for (int l = 0; l < 2; ++l) {
      const RandomBytesBank& src = *owned[l];
      for (int e = 0; e < E; ++e) {
        for (int b = 0; b < lay.num_banks(); ++b) {
          const std::string& name = lay.bank(b).name;
          const uint64_t n = lay.bank(b).bytes;
          const uint8_t* want = nullptr;
          if (name == "gate_up") want = src.gate_up.data() + e * n;
          if (name == "down") want = src.down.data() + e * n;
          if (name == "gate_up_scales") want = src.gate_up_scales.data() + e * n;
          if (name == "down_scales") want = src.down_scales.data() + e * n;
          const float* g = nullptr;
          if (name == "gate_up_global_scale") g = &src.gate_g[4 * e];
          if (name == "up_global_scale") g = c.own_up_scale ? &src.up_g[4 * e] : &src.gate_g[4 * e];
          if (name == "down_global_scale") g = &src.down_g[4 * e];
          if (g != nullptr) want = reinterpret_cast<const uint8_t*>(g);
          ASSERT_NE(want, nullptr) << name;
          EXPECT_EQ(std::memcmp((*store)->expert_bank(l * E + e, b), want, n), 0)
              << name << " layer " << l << " expert " << e;
        }
      }
      const bool panels = c.format == common::WeightFormat::kNvfp4;
      auto back = cpu_moe::BankFromView((*store)->LayerView(
          l, c.format, panels ? common::ExpertLayout::kPanels : common::ExpertLayout::kRowMajor, H,
          I));
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->BytesPerExpert(), src.bank.BytesPerExpert());
      for (int e = 0; e < E; ++e) {
        const uint64_t gu = lay.bank(0).bytes;
        EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(back->gate_up_weights) + e * gu,
                              src.gate_up.data() + e * gu, gu),
                  0);
        if (panels) {
          const int st = back->global_scale_stride;
          EXPECT_EQ(back->gate_up_global_scales[e * st], src.gate_g[4 * e]);
          EXPECT_EQ(back->up_global_scales[e * st],
                    c.own_up_scale ? src.up_g[4 * e] : src.gate_g[4 * e]);
          EXPECT_EQ(back->down_global_scales[e * st], src.down_g[4 * e]);
        }
      }
    }
  }
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
