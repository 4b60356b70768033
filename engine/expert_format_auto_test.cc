// The expert format "auto" (the default of --expert_format and ModelEngineOptions): LoadModel
// keeps a checkpoint's experts in their own format (NVFP4 -> nvfp4, FP8 block-scaled ->
// fp8_block, BF16 / F16 / F32 -> bf16), with exactly the store an explicit load of that format
// builds; a checkpoint that mixes formats takes the one most experts are in; the engine reports
// the resolved format.
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "engine/engine.h"
#include "engine/loader.h"
#include "engine/loader_test_util.h"
#include "engine/model_engine.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

using common::WeightFormat;
using testing::OwnedTensor;

LoadOptions Opts(std::optional<WeightFormat> f) {
  LoadOptions o;
  o.expert_format = f;
  o.threads = 2;
  o.progress = false;
  return o;
}

// Every byte of every expert of every bank.
void ExpectSameStore(const ModelWeights& a, const ModelWeights& b) {
  ASSERT_NE(a.experts, nullptr);
  ASSERT_NE(b.experts, nullptr);
  const moe_cache::ExpertStore& sa = *a.experts;
  const moe_cache::ExpertStore& sb = *b.experts;
  ASSERT_EQ(sa.layout().num_banks(), sb.layout().num_banks());
  ASSERT_EQ(sa.num_layers(), sb.num_layers());
  ASSERT_EQ(sa.num_experts(), sb.num_experts());
  for (int b = 0; b < sa.layout().num_banks(); ++b) {
    ASSERT_EQ(sa.layout().bank(b).name, sb.layout().bank(b).name);
    ASSERT_EQ(sa.layout().bank(b).bytes, sb.layout().bank(b).bytes);
    for (int g = 0; g < sa.num_layers() * sa.num_experts(); ++g) {
      ASSERT_EQ(std::memcmp(sa.expert_bank(g, b), sb.expert_bank(g, b), sa.layout().bank(b).bytes),
                0)
          << "bank " << sa.layout().bank(b).name << ", expert " << g;
    }
  }
}

struct Case {
  const char* name;
  const char* flags;
  WeightFormat want;
};

class ExpertFormatAutoTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertFormatAutoTest, ResolvesToTheCheckpointsOwnFormat) {
  const Case& c = GetParam();
  absl::StatusOr<std::string> dir = testing::MakeTinyModel(absl::StrCat("auto_", c.name), c.flags);
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(*dir, Opts(std::nullopt));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->expert_format, c.want)
      << "got " << common::WeightFormatName((*w)->expert_format) << ", want "
      << common::WeightFormatName(c.want);
  // The same store as asking for that format by name: auto changes nothing but the choice.
  absl::StatusOr<std::unique_ptr<ModelWeights>> named = LoadModel(*dir, Opts(c.want));
  ASSERT_TRUE(named.ok()) << named.status();
  ExpectSameStore(**w, **named);
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoints, ExpertFormatAutoTest,
    ::testing::Values(
        Case{"qwen3_bf16", "--family qwen3_moe --seed 1", WeightFormat::kBf16},
        Case{"qwen3_f16", "--family qwen3_moe --seed 2 --dtype f16", WeightFormat::kBf16},
        Case{"qwen3_f32", "--family qwen3_moe --seed 3 --dtype f32", WeightFormat::kBf16},
        Case{"qwen3_fused", "--family qwen3_moe --seed 4 --fused_experts", WeightFormat::kBf16},
        // Whole 128x128 blocks: the FP8 codes and scales pass straight into fp8_block.
        Case{"qwen3_fp8",
             "--family qwen3_moe --seed 5 --dtype fp8 --layers 1 --experts 2 --hidden 256 "
             "--moe_intermediate 128 --heads 2 --head_dim 64 --vocab 64",
             WeightFormat::kFp8Block},
        // Partial blocks: still fp8_block (re-blocked), never widened to bf16.
        Case{"qwen3_fp8_partial",
             "--family qwen3_moe --seed 6 --dtype fp8 --hidden 192 --moe_intermediate 160 "
             "--heads 4 --head_dim 48",
             WeightFormat::kFp8Block},
        Case{"qwen3_nvfp4", "--family qwen3_moe --seed 7 --dtype nvfp4", WeightFormat::kNvfp4},
        Case{"qwen2_nvfp4", "--family qwen2_moe --seed 8 --dtype nvfp4", WeightFormat::kNvfp4},
        Case{"qwen35_bf16", "--family qwen3_5_moe --seed 9", WeightFormat::kBf16},
        Case{"qwen35_fp8", "--family qwen3_5_moe --seed 10 --dtype fp8", WeightFormat::kFp8Block},
        Case{"qwen35_nvfp4", "--family qwen3_5_moe --seed 11 --dtype nvfp4",
             WeightFormat::kNvfp4}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// An NVFP4 checkpoint whose first `bf16_layers` layers' experts are stored as BF16 (the
// dequantized values; their scales removed), as a quantization that left layers out would.
std::string MixedNvfp4(const std::string& name, int bf16_layers) {
  absl::StatusOr<std::string> dir =
      testing::MakeTinyModel(name, "--family qwen3_moe --dtype nvfp4 --layers 3 --seed 12");
  EXPECT_TRUE(dir.ok()) << dir.status();
  if (!dir.ok()) return "";
  const absl::Status s =
      testing::RewriteTensors(*dir + "/model.safetensors", [&](std::vector<OwnedTensor>& ts) {
        auto find = [&](const std::string& n) -> OwnedTensor* {
          for (OwnedTensor& t : ts) {
            if (t.name == n) return &t;
          }
          return nullptr;
        };
        std::vector<std::string> drop;
        for (int l = 0; l < bf16_layers; ++l) {
          for (int e = 0; e < 8; ++e) {
            for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
              const std::string n =
                  absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".", proj, ".weight");
              OwnedTensor* q = find(n);
              OwnedTensor* sc = find(n + "_scale");
              OwnedTensor* g = find(n + "_scale_2");
              ASSERT_TRUE(q != nullptr && sc != nullptr && g != nullptr) << n;
              ASSERT_EQ(q->dtype, StDtype::kU8) << n;
              float global;
              std::memcpy(&global, g->bytes.data(), 4);
              const int64_t rows = q->shape[0], cols = 2 * q->shape[1];
              std::vector<uint8_t> out(rows * cols * 2);
              for (int64_t r = 0; r < rows; ++r) {
                for (int64_t col = 0; col < cols; ++col) {
                  const uint8_t byte = q->bytes[r * cols / 2 + col / 2];
                  const float v =
                      common::Fp4E2M1ToFloat(col % 2 == 0 ? byte & 15 : byte >> 4) *
                      common::Fp8E4M3ToFloat(sc->bytes[r * cols / 16 + col / 16]) * global;
                  const uint16_t h = common::FloatToBf16(v);
                  std::memcpy(out.data() + 2 * (r * cols + col), &h, 2);
                }
              }
              q->dtype = StDtype::kBf16;
              q->shape = {rows, cols};
              q->bytes = std::move(out);
              for (const char* suffix : {"_scale", "_scale_2"}) drop.push_back(n + suffix);
              drop.push_back(absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".", proj,
                                          ".input_scale"));
            }
          }
        }
        std::vector<OwnedTensor> kept;
        for (OwnedTensor& t : ts) {
          bool dropped = false;
          for (const std::string& d : drop) dropped = dropped || t.name == d;
          if (!dropped) kept.push_back(std::move(t));
        }
        ts = std::move(kept);
      });
  EXPECT_TRUE(s.ok()) << s;
  return *dir;
}

TEST(ExpertFormatAutoMixedTest, TheFormatMostExpertsAreIn) {
  {
    // 16 NVFP4 experts, 8 BF16: nvfp4 (the BF16 layer's experts are quantized on load).
    const std::string dir = MixedNvfp4("auto_mixed_1", 1);
    absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(std::nullopt));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->expert_format, WeightFormat::kNvfp4);
  }
  {
    // 8 NVFP4, 16 BF16: bf16.
    const std::string dir = MixedNvfp4("auto_mixed_2", 2);
    absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(std::nullopt));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->expert_format, WeightFormat::kBf16);
  }
}

TEST(ExpertFormatAutoMixedTest, TiesGoToTheNarrowerFormat) {
  EXPECT_EQ(CheckpointExpertFormat({}), WeightFormat::kBf16);  // no routed experts
  EXPECT_EQ(CheckpointExpertFormat({8, 0, 8}), WeightFormat::kNvfp4);
  EXPECT_EQ(CheckpointExpertFormat({8, 8, 8}), WeightFormat::kNvfp4);
  EXPECT_EQ(CheckpointExpertFormat({0, 8, 8}), WeightFormat::kFp8Block);
  EXPECT_EQ(CheckpointExpertFormat({7, 0, 8}), WeightFormat::kBf16);
  EXPECT_EQ(CheckpointExpertFormat({0, 7, 8}), WeightFormat::kBf16);
  EXPECT_EQ(CheckpointExpertFormat({7, 8, 0}), WeightFormat::kFp8Block);
}

TEST(ExpertFormatAutoTest2, ParseExpertFormat) {
  EXPECT_EQ(*ParseExpertFormat("auto"), std::nullopt);
  EXPECT_EQ(*ParseExpertFormat("nvfp4"), WeightFormat::kNvfp4);
  EXPECT_EQ(*ParseExpertFormat("fp8_block"), WeightFormat::kFp8Block);
  EXPECT_EQ(*ParseExpertFormat("bf16"), WeightFormat::kBf16);
  const absl::Status bad = ParseExpertFormat("Auto").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("must be auto"), std::string::npos) << bad;
}

// The engine with default options serves an NVFP4 checkpoint in nvfp4 and says so; a format
// given by name is kept.
TEST(ExpertFormatAutoTest2, EngineDefaultsToTheCheckpointsFormat) {
  absl::StatusOr<std::string> dir =
      testing::MakeTinyModel("auto_engine", "--family qwen3_5_moe --dtype nvfp4 --seed 13");
  ASSERT_TRUE(dir.ok()) << dir.status();
  ModelEngineOptions o;
  o.model_dir = *dir;
  o.threads = 2;
  o.max_batch = 2;
  o.max_context = 64;
  absl::StatusOr<std::unique_ptr<Engine>> e = CreateModelEngine(o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->model_info().expert_format, "nvfp4");
  o.expert_format = "bf16";
  e = CreateModelEngine(o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->model_info().expert_format, "bf16");
  o.expert_format = "nvfp44";
  EXPECT_EQ(CreateModelEngine(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::engine
