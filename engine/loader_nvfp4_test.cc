// LoadModel on NVIDIA ModelOpt NVFP4 checkpoints written by make_tiny_model --dtype nvfp4: the
// experts reach the store as the checkpoint's own codes and scales (gate and up each with its
// per-tensor scale), dense tensors and the experts' MoE output match a float64 dequantization
// written here from the format's definition (not from common/formats), and malformed files are
// InvalidArgument naming the tensor.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/loader.h"
#include "engine/loader_test_util.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

using common::WeightFormat;
using testing::OwnedTensor;

// e2m1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal.
double E2m1(uint8_t nibble) {
  const int e = (nibble >> 1) & 3, m = nibble & 1;
  const double v = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  return (nibble & 8) != 0 ? -v : v;
}

// e4m3fn: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; exponent 0 subnormal.
double E4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) != 0 ? -v : v;
}

float F32At(const StTensor& t) {
  float f;
  std::memcpy(&f, t.data, 4);
  return f;
}

// The real [rows, cols] matrix of NVFP4 tensor `name`: e2m1 (element 2i in the low nibble of
// byte i) x e4m3 weight_scale of its 16-element group x weight_scale_2.
std::vector<double> Dequantize(const Checkpoint& ck, const std::string& name) {
  const StTensor* q = ck.Find(name);
  const StTensor* s = ck.Find(name + "_scale");
  const StTensor* g = ck.Find(name + "_scale_2");
  EXPECT_TRUE(q != nullptr && s != nullptr && g != nullptr) << name;
  if (q == nullptr || s == nullptr || g == nullptr) return {};
  EXPECT_EQ(q->dtype, StDtype::kU8) << name;
  const int64_t rows = q->shape[0], cols = 2 * q->shape[1];
  const double global = F32At(*g);
  std::vector<double> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t byte = q->data[r * cols / 2 + c / 2];
      const uint8_t nib = c % 2 == 0 ? byte & 15 : byte >> 4;
      out[r * cols + c] = E2m1(nib) * E4m3(s->data[r * cols / 16 + c / 16]) * global;
    }
  }
  return out;
}

LoadOptions Opts(WeightFormat f) {
  LoadOptions o;
  o.expert_format = f;
  o.dense_dtype = DType::kF32;
  o.threads = 2;
  o.progress = false;
  return o;
}

struct Family {
  const char* name;
  const char* flags;
  const char* root;       // the text model's tensor prefix
  const char* dense;      // an NVFP4 dense tensor of layer 0 (after root)
};

class Nvfp4LoadTest : public ::testing::TestWithParam<Family> {};

const Tensor& DenseOf(const ModelWeights& m, const std::string& which) {
  return which == "self_attn.q_proj.weight" ? m.layers[0].q_proj : m.layers[0].in_proj_qkv;
}

TEST_P(Nvfp4LoadTest, ExpertsKeepTheCheckpointsCodesAndScales) {
  const Family& fam = GetParam();
  absl::StatusOr<std::string> dir = testing::MakeTinyModel(
      absl::StrCat("nvfp4_", fam.name), absl::StrCat(fam.flags, " --dtype nvfp4 --seed 3"));
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(*dir, Opts(WeightFormat::kNvfp4));
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(*dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const moe_cache::ExpertStore& store = *m.experts;
  auto bank = [&](const char* n) { return store.FindBank(n); };
  const int gu = bank("gate_up"), dn = bank("down"), gg = bank("gate_up_global_scale"),
            ug = bank("up_global_scale"), dg = bank("down_global_scale");
  ASSERT_TRUE(gu >= 0 && dn >= 0 && gg >= 0 && ug >= 0 && dg >= 0);
  const int E = m.config.num_experts, H = m.config.hidden_size,
            I = m.config.moe_intermediate_size;
  int differing = 0, checked = 0;
  for (int l = 0; l < m.config.num_hidden_layers; ++l) {
    const int mi = m.layers[l].moe_index;
    if (mi < 0) continue;
    for (int e = 0; e < E; ++e) {
      const std::string p = absl::StrCat(fam.root, "layers.", l, ".mlp.experts.", e, ".");
      const StTensor* t[3];
      const char* names[3] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
      for (int i = 0; i < 3; ++i) {
        t[i] = (*ck)->Find(p + names[i]);
        ASSERT_NE(t[i], nullptr) << p << names[i];
      }
      // The checkpoint's bytes, stacked [gate; up] as cpu_moe's row-major nvfp4 bank, then
      // packed into panels: the store must hold exactly these bytes (a permutation, no
      // re-quantization).
      std::vector<uint8_t> codes, scales;
      for (int i = 0; i < 2; ++i) {
        codes.insert(codes.end(), t[i]->data, t[i]->data + t[i]->bytes);
        const StTensor* s = (*ck)->Find(p + names[i] + std::string("_scale"));
        scales.insert(scales.end(), s->data, s->data + s->bytes);
      }
      const StTensor* ds = (*ck)->Find(p + "down_proj.weight_scale");
      const float g_gate = F32At(*(*ck)->Find(p + "gate_proj.weight_scale_2"));
      const float g_up = F32At(*(*ck)->Find(p + "up_proj.weight_scale_2"));
      const float g_down = F32At(*(*ck)->Find(p + "down_proj.weight_scale_2"));
      cpu_moe::ExpertBank one;
      one.format = WeightFormat::kNvfp4;
      one.num_experts = 1;
      one.hidden = H;
      one.intermediate = I;
      one.gate_up_weights = codes.data();
      one.gate_up_scales = scales.data();
      one.gate_up_global_scales = &g_gate;
      one.up_global_scales = &g_up;
      one.down_weights = t[2]->data;
      one.down_scales = ds->data;
      one.down_global_scales = &g_down;
      absl::StatusOr<std::unique_ptr<cpu_moe::PanelBank>> panels = cpu_moe::PackPanels(one);
      ASSERT_TRUE(panels.ok()) << panels.status();
      const int row = mi * E + e;
      ASSERT_EQ((*panels)->gate_up.size(), store.layout().bank(gu).bytes);
      EXPECT_EQ(std::memcmp(store.expert_bank(row, gu), (*panels)->gate_up.data(),
                            (*panels)->gate_up.size()),
                0)
          << p;
      EXPECT_EQ(std::memcmp(store.expert_bank(row, dn), (*panels)->down.data(),
                            (*panels)->down.size()),
                0)
          << p;
      float sg, su, sd;
      std::memcpy(&sg, store.expert_bank(row, gg), 4);
      std::memcpy(&su, store.expert_bank(row, ug), 4);
      std::memcpy(&sd, store.expert_bank(row, dg), 4);
      EXPECT_EQ(sg, g_gate) << p;
      EXPECT_EQ(su, g_up) << p;
      EXPECT_EQ(sd, g_down) << p;
      differing += g_gate != g_up ? 1 : 0;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(differing, checked) << "the exporter gives gate and up different global scales";

  // A dense NVFP4 projection, dequantized to f32: e2m1 x e4m3 is exact in float, the global
  // scale's product rounds once.
  const std::vector<double> ref = Dequantize(**ck, std::string(fam.root) + "layers.0." + fam.dense);
  const Tensor& d = DenseOf(m, fam.dense);
  ASSERT_EQ(d.dtype, DType::kF32);
  ASSERT_EQ(static_cast<size_t>(d.rows * d.cols), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_NEAR(d.f32()[i], ref[i], std::abs(ref[i]) * 1.2e-7) << i;
  }
}

// The store's experts through cpu_moe against float64 on the independently dequantized
// checkpoint; with one global scale for gate and up (the gate's), the reference must miss.
TEST_P(Nvfp4LoadTest, ExpertsComputeTheDequantizedCheckpoint) {
  const Family& fam = GetParam();
  absl::StatusOr<std::string> dir = testing::MakeTinyModel(
      absl::StrCat("nvfp4_moe_", fam.name), absl::StrCat(fam.flags, " --dtype nvfp4 --seed 5"));
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(*dir, Opts(WeightFormat::kNvfp4));
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(*dir);
  ASSERT_TRUE(ck.ok());
  const int H = m.config.hidden_size, I = m.config.moe_intermediate_size;
  const int E = m.config.num_experts, k = 2, T = 6;
  int layer = 0;
  while (m.layers[layer].moe_index < 0) ++layer;
  const int mi = m.layers[layer].moe_index;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> x(T * H), y(T * H, 0.0f), wts(T * k);
  std::vector<int32_t> ids(T * k);
  for (float& v : x) v = nd(rng);
  for (int t = 0; t < T; ++t) {
    ids[t * k] = t % E;
    ids[t * k + 1] = (t + 3) % E;
    wts[t * k] = 0.6f;
    wts[t * k + 1] = 0.4f;
  }
  common::ThreadPool pool(2);
  ASSERT_TRUE(cpu_moe::Forward(m.ExpertBankFor(mi), T, k, ids, wts, x, absl::MakeSpan(y),
                               cpu_moe::Options(), pool)
                  .ok());
  auto reference = [&](bool one_scale) {
    std::vector<double> ref(T * H, 0.0);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        const std::string p = absl::StrCat(fam.root, "layers.", layer, ".mlp.experts.", e, ".");
        const std::vector<double> g = Dequantize(**ck, p + "gate_proj.weight");
        std::vector<double> u = Dequantize(**ck, p + "up_proj.weight");
        const std::vector<double> d = Dequantize(**ck, p + "down_proj.weight");
        if (one_scale) {
          const double r = F32At(*(*ck)->Find(p + "gate_proj.weight_scale_2")) /
                           F32At(*(*ck)->Find(p + "up_proj.weight_scale_2"));
          for (double& v : u) v *= r;
        }
        std::vector<double> h(I);
        for (int i = 0; i < I; ++i) {
          double gs = 0, us = 0;
          for (int c = 0; c < H; ++c) {
            gs += g[i * H + c] * x[t * H + c];
            us += u[i * H + c] * x[t * H + c];
          }
          h[i] = gs / (1.0 + std::exp(-gs)) * us;
        }
        for (int r = 0; r < H; ++r) {
          double s = 0;
          for (int i = 0; i < I; ++i) s += d[r * I + i] * h[i];
          ref[t * H + r] += wts[t * k + j] * s;
        }
      }
    }
    return ref;
  };
  auto rel = [&](const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      num += (y[i] - ref[i]) * (y[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    return std::sqrt(num / den);
  };
  // The kernels quantize x and h to int8 per 32 (cpu_moe.h): about 1% here.
  const double err = rel(reference(false));
  EXPECT_LT(err, 0.025);
  EXPECT_GT(rel(reference(true)), 0.05) << "negative control: one scale for gate and up";
  std::printf("%s: relative error %.4f\n", fam.name, err);
}

INSTANTIATE_TEST_SUITE_P(
    Families, Nvfp4LoadTest,
    ::testing::Values(Family{"qwen3_moe", "--family qwen3_moe", "model.", "self_attn.q_proj.weight"},
                      Family{"qwen3_5_moe", "--family qwen3_5_moe", "model.language_model.",
                             "linear_attn.in_proj_qkv.weight"}),
    [](const ::testing::TestParamInfo<Family>& info) { return std::string(info.param.name); });

// ---- Errors. ----

std::string MakeNvfp4(const std::string& name) {
  absl::StatusOr<std::string> dir =
      testing::MakeTinyModel(name, "--family qwen3_moe --dtype nvfp4 --layers 1");
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : "";
}

void EditJson(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(testing::ReadFile(path));
  edit(j);
  testing::WriteFile(path, j.dump());
}

void ExpectError(const std::string& dir, std::vector<std::string> needles) {
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(WeightFormat::kNvfp4));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(w.status().message());
  for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
}

void DropTensor(const std::string& dir, const std::string& name) {
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors",
                                      [&](std::vector<OwnedTensor>& ts) {
                                        for (size_t i = 0; i < ts.size(); ++i) {
                                          if (ts[i].name == name) {
                                            ts.erase(ts.begin() + i);
                                            return;
                                          }
                                        }
                                        ADD_FAILURE() << name;
                                      })
                  .ok());
}

TEST(Nvfp4LoadErrorTest, GroupSizeOtherThan16) {
  const std::string dir = MakeNvfp4("nvfp4_e_group");
  EditJson(dir + "/hf_quant_config.json",
           [](nlohmann::json& j) { j["quantization"]["group_size"] = 32; });
  ExpectError(dir, {"hf_quant_config.json", "group_size 32", "expected 16"});
}

TEST(Nvfp4LoadErrorTest, GroupSizeInConfigJson) {
  const std::string dir = MakeNvfp4("nvfp4_e_group_cfg");
  ASSERT_EQ(std::remove((dir + "/hf_quant_config.json").c_str()), 0);
  EditJson(dir + "/config.json",
           [](nlohmann::json& j) { j["quantization_config"]["group_size"] = 8; });
  ExpectError(dir, {"config.json quantization_config", "group_size 8"});
}

TEST(Nvfp4LoadErrorTest, OtherModelOptAlgorithm) {
  const std::string dir = MakeNvfp4("nvfp4_e_algo");
  EditJson(dir + "/hf_quant_config.json",
           [](nlohmann::json& j) { j["quantization"]["quant_algo"] = "W4A8_AWQ"; });
  ExpectError(dir, {"W4A8_AWQ", "not supported"});
}

TEST(Nvfp4LoadErrorTest, PackedWeightsWithoutQuantizationConfig) {
  const std::string dir = MakeNvfp4("nvfp4_e_noconfig");
  ASSERT_EQ(std::remove((dir + "/hf_quant_config.json").c_str()), 0);
  EditJson(dir + "/config.json", [](nlohmann::json& j) { j.erase("quantization_config"); });
  ExpectError(dir, {"model.layers.0.self_attn.q_proj.weight", "U8", "NVFP4"});
}

TEST(Nvfp4LoadErrorTest, MissingGlobalScale) {
  const std::string dir = MakeNvfp4("nvfp4_e_scale2");
  DropTensor(dir, "model.layers.0.mlp.experts.3.up_proj.weight_scale_2");
  ExpectError(dir, {"\"model.layers.0.mlp.experts.3.up_proj.weight_scale_2\"", "missing"});
}

TEST(Nvfp4LoadErrorTest, MissingGroupScales) {
  const std::string dir = MakeNvfp4("nvfp4_e_scale");
  DropTensor(dir, "model.layers.0.self_attn.o_proj.weight_scale");
  ExpectError(dir, {"\"model.layers.0.self_attn.o_proj.weight_scale\"", "missing"});
}

TEST(Nvfp4LoadErrorTest, WrongShapes) {
  const std::string dir = MakeNvfp4("nvfp4_e_shape");
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors",
                                      [](std::vector<OwnedTensor>& ts) {
                                        for (OwnedTensor& t : ts) {
                                          if (t.name ==
                                              "model.layers.0.mlp.experts.1.down_proj.weight_scale") {
                                            // [64, 2] read as [32, 4]: same bytes, wrong shape.
                                            t.shape = {t.shape[0] / 2, t.shape[1] * 2};
                                          }
                                        }
                                      })
                  .ok());
  ExpectError(dir, {"\"model.layers.0.mlp.experts.1.down_proj.weight_scale\"", "expected F8_E4M3"});
  const std::string dir2 = MakeNvfp4("nvfp4_e_shape2");
  ASSERT_TRUE(testing::RewriteTensors(dir2 + "/model.safetensors",
                                      [](std::vector<OwnedTensor>& ts) {
                                        for (OwnedTensor& t : ts) {
                                          if (t.name == "model.layers.0.mlp.experts.2.gate_proj.weight") {
                                            t.shape = {t.shape[0] * 2, t.shape[1] / 2};
                                          }
                                        }
                                      })
                  .ok());
  ExpectError(dir2, {"\"model.layers.0.mlp.experts.2.gate_proj.weight\"", "two e2m1 codes"});
}

// Another expert format on an NVFP4 checkpoint is an explicit conversion from the dequantized
// weights: bf16 experts are the float64 dequantization rounded to bf16.
TEST(Nvfp4LoadTest2, Bf16ExpertsAreTheDequantizedCheckpoint) {
  const std::string dir = MakeNvfp4("nvfp4_to_bf16");
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(WeightFormat::kBf16));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  const cpu_moe::ExpertBank b = (*w)->ExpertBankFor(0);
  const int H = b.hidden, I = b.intermediate;
  const std::vector<double> up = Dequantize(**ck, "model.layers.0.mlp.experts.5.up_proj.weight");
  const auto* gu = static_cast<const uint16_t*>(b.gate_up_weights) + 5 * 2 * I * H;
  for (int64_t i = 0; i < static_cast<int64_t>(I) * H; ++i) {
    uint32_t bits = static_cast<uint32_t>(gu[I * H + i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    ASSERT_NEAR(f, up[i], std::abs(up[i]) / 256) << i;
  }
}

}  // namespace
}  // namespace moe::engine
