#include "engine/loader.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/loader_test_util.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

using common::WeightFormat;
using testing::MakeTinyModel;
using testing::OwnedTensor;

LoadOptions Opts(WeightFormat f = WeightFormat::kBf16, DType dense = DType::kBf16) {
  LoadOptions o;
  o.expert_format = f;
  o.dense_dtype = dense;
  o.threads = 2;
  o.progress = false;
  return o;
}

std::string Make(const std::string& name, const std::string& flags) {
  absl::StatusOr<std::string> dir = MakeTinyModel(name, flags);
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : "";
}

// Float values of a checkpoint tensor (F32, BF16 or F16).
std::vector<float> Values(const StTensor& t) {
  std::vector<float> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint16_t h;
    switch (t.dtype) {
      case StDtype::kF32:
        std::memcpy(&v[i], t.data + 4 * i, 4);
        break;
      case StDtype::kBf16:
        std::memcpy(&h, t.data + 2 * i, 2);
        v[i] = common::Bf16ToFloat(h);
        break;
      default:
        std::memcpy(&h, t.data + 2 * i, 2);
        v[i] = common::Fp16ToFloat(h);
    }
  }
  return v;
}

int BankIndex(const moe_cache::ExpertStore& store, const std::string& name) {
  for (int b = 0; b < store.layout().num_banks(); ++b) {
    if (store.layout().bank(b).name == name) return b;
  }
  return -1;
}

void ExpectError(const absl::StatusOr<std::unique_ptr<ModelWeights>>& w,
                 std::vector<std::string> needles) {
  ASSERT_FALSE(w.ok());
  const std::string msg(w.status().message());
  for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
}

TEST(LoaderTest, Bf16ExpertsAreTheCheckpointsBitsInPlace) {
  const std::string dir = Make("q3_bf16", "--family qwen3_moe --seed 1 --layers 2 --experts 4");
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts());
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  const int64_t H = m.config.hidden_size, I = m.config.moe_intermediate_size;
  const int E = m.config.num_experts;
  const moe_cache::ExpertStore& store = *m.experts;
  ASSERT_EQ(store.num_layers(), 2);
  const int gu = BankIndex(store, "gate_up"), dn = BankIndex(store, "down");
  ASSERT_GE(gu, 0);
  ASSERT_GE(dn, 0);
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_TRUE(m.layers[layer].is_moe);
    EXPECT_EQ(m.layers[layer].moe_index, layer);
    const cpu_moe::ExpertBank bank = m.ExpertBankFor(layer);
    EXPECT_EQ(bank.num_experts, E);
    EXPECT_EQ(bank.hidden, H);
    EXPECT_EQ(bank.intermediate, I);
    EXPECT_EQ(bank.layout, cpu_moe::Layout::kRowMajor);
    // No copy: the bank is the store's memory, whole layers of it.
    const auto* gu_base = static_cast<const uint8_t*>(bank.gate_up_weights);
    const auto* dn_base = static_cast<const uint8_t*>(bank.down_weights);
    EXPECT_EQ(gu_base, store.expert_bank(layer * E, gu));
    EXPECT_EQ(dn_base, store.expert_bank(layer * E, dn));
    const uint64_t gu_total = store.layout().bank(gu).pitch * E * store.num_layers();
    EXPECT_GE(gu_base, store.bank_host(gu));
    EXPECT_LE(gu_base + E * bank.GateUpBytesPerExpert(), store.bank_host(gu) + gu_total);
    EXPECT_EQ(store.layout().bank(gu).pitch, bank.GateUpBytesPerExpert());
    for (int e = 0; e < E; ++e) {
      const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.", e, ".");
      const StTensor* g = (*ck)->Find(p + "gate_proj.weight");
      const StTensor* u = (*ck)->Find(p + "up_proj.weight");
      const StTensor* d = (*ck)->Find(p + "down_proj.weight");
      ASSERT_TRUE(g && u && d);
      const uint8_t* row = gu_base + e * bank.GateUpBytesPerExpert();
      EXPECT_EQ(std::memcmp(row, g->data, I * H * 2), 0) << "gate " << layer << "/" << e;
      EXPECT_EQ(std::memcmp(row + I * H * 2, u->data, I * H * 2), 0) << "up " << layer << "/" << e;
      EXPECT_EQ(std::memcmp(dn_base + e * bank.DownBytesPerExpert(), d->data, H * I * 2), 0);
    }
  }
  // Dense weights: bf16 bit for bit; norms as f32.
  const StTensor* emb = (*ck)->Find("model.embed_tokens.weight");
  ASSERT_EQ(m.embed_tokens.dtype, DType::kBf16);
  EXPECT_EQ(std::memcmp(m.embed_tokens.bf16(), emb->data, emb->bytes), 0);
  const std::vector<float> qn = Values(*(*ck)->Find("model.layers.1.self_attn.q_norm.weight"));
  ASSERT_EQ(m.layers[1].q_norm.dtype, DType::kF32);
  ASSERT_EQ(m.layers[1].q_norm.cols, static_cast<int64_t>(qn.size()));
  for (size_t i = 0; i < qn.size(); ++i) EXPECT_EQ(m.layers[1].q_norm.f32()[i], qn[i]);
  EXPECT_TRUE(m.layers[0].q_bias.empty());
  EXPECT_TRUE(m.layers[0].shared_gate_proj.empty());
  EXPECT_FALSE(m.lm_head.empty());
  EXPECT_EQ(m.layers[0].router.rows, E);
}

// Every expert format computes the checkpoint's experts: cpu_moe on the loaded bank against a
// float64 reference from the checkpoint's weights, within the format's quantization error.
struct FormatCase {
  WeightFormat format;
  const char* flags;
  double tolerance;  // relative Frobenius error allowed (activation rounding)
};

class LoaderFormatTest : public ::testing::TestWithParam<FormatCase> {};

// The weights as the format stores them, by common/formats.h's own quantizers (row by row for the
// 4-bit formats, one global scale per gate_up or down matrix for nvfp4, 128x128 blocks for fp8),
// so that what remains between kernel and reference is the kernels' activation rounding.
void QuantizeDequantize(WeightFormat f, int64_t I, int64_t H, std::vector<float>* g,
                        std::vector<float>* u, std::vector<float>* d) {
  if (f == WeightFormat::kBf16) return;
  std::vector<float> gu(*g);
  gu.insert(gu.end(), u->begin(), u->end());
  auto qdq = [f](std::vector<float>& m, int64_t rows, int64_t cols) {
    std::vector<float> out(m.size());
    if (f == WeightFormat::kFp8Block) {
      std::vector<uint8_t> q(m.size());
      std::vector<float> s(((rows + 127) / 128) * ((cols + 127) / 128));
      common::QuantizeFp8Block(m.data(), rows, cols, q.data(), s.data());
      common::DequantizeFp8Block(q.data(), s.data(), rows, cols, out.data());
      m = out;
      return;
    }
    const float gs = f == WeightFormat::kNvfp4 ? common::Nvfp4GlobalScale(m.data(), m.size()) : 1;
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = m.data() + r * cols;
      float* o = out.data() + r * cols;
      std::vector<common::BlockQ4_0> blocks(cols / 32);
      std::vector<uint8_t> packed(cols / 2), scales(cols / 16);
      switch (f) {
        case WeightFormat::kQ4_0:
          common::QuantizeRowQ4_0(x, cols, blocks.data());
          common::DequantizeRowQ4_0(blocks.data(), cols, o);
          break;
        case WeightFormat::kMxfp4:
          common::QuantizeRowMxfp4(x, cols, packed.data(), scales.data());
          common::DequantizeRowMxfp4(packed.data(), scales.data(), cols, o);
          break;
        default:
          common::QuantizeRowNvfp4(x, cols, gs, packed.data(), scales.data());
          common::DequantizeRowNvfp4(packed.data(), scales.data(), gs, cols, o);
      }
    }
    m = out;
  };
  qdq(gu, 2 * I, H);
  qdq(*d, H, I);
  g->assign(gu.begin(), gu.begin() + I * H);
  u->assign(gu.begin() + I * H, gu.end());
}

TEST_P(LoaderFormatTest, ExpertsComputeTheCheckpointsMoe) {
  const FormatCase& fc = GetParam();
  const std::string name = "fmt_" + std::string(common::WeightFormatName(fc.format));
  const std::string dir = Make(name, fc.flags);
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(fc.format));
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  const int H = m.config.hidden_size, I = m.config.moe_intermediate_size;
  const int E = m.config.num_experts, k = 2, T = 5;
  const int layer = m.config.num_hidden_layers - 1;
  const int mi = m.layers[layer].moe_index;
  ASSERT_GE(mi, 0);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(T * H), y(T * H, 0.0f), wts(T * k);
  std::vector<int32_t> ids(T * k);
  for (float& v : x) v = nd(rng);
  for (int t = 0; t < T; ++t) {
    ids[t * k] = t % E;
    ids[t * k + 1] = (t * 3 + 1) % E == t % E ? (t + 1) % E : (t * 3 + 1) % E;
    wts[t * k] = 0.7f;
    wts[t * k + 1] = 0.3f;
  }
  common::ThreadPool pool(2);
  const cpu_moe::ExpertBank bank = m.ExpertBankFor(mi);
  // The weights cpu_moe reads are the store's memory, this layer's rows of it.
  const moe_cache::ExpertStore& store = *m.experts;
  EXPECT_EQ(bank.gate_up_weights, store.expert_bank(mi * E, BankIndex(store, "gate_up")));
  EXPECT_EQ(bank.down_weights, store.expert_bank(mi * E, BankIndex(store, "down")));
  EXPECT_EQ(bank.layout, fc.format == WeightFormat::kBf16 || fc.format == WeightFormat::kFp8Block
                             ? cpu_moe::Layout::kRowMajor
                             : cpu_moe::Layout::kPanels);
  ASSERT_TRUE(
      cpu_moe::Forward(bank, T, k, ids, wts, x, absl::MakeSpan(y), cpu_moe::Options(), pool).ok());
  // Reference (and a negative control with gate and up swapped, which must not pass).
  auto reference = [&](bool swap) {
    std::vector<double> ref(T * H, 0.0);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.", e, ".");
        std::vector<float> g = Values(*(*ck)->Find(p + "gate_proj.weight"));
        std::vector<float> u = Values(*(*ck)->Find(p + "up_proj.weight"));
        std::vector<float> d = Values(*(*ck)->Find(p + "down_proj.weight"));
        if (swap) std::swap(g, u);
        QuantizeDequantize(fc.format, I, H, &g, &u, &d);
        std::vector<double> h(I);
        for (int i = 0; i < I; ++i) {
          double gs = 0, us = 0;
          for (int c = 0; c < H; ++c) {
            gs += static_cast<double>(g[i * H + c]) * x[t * H + c];
            us += static_cast<double>(u[i * H + c]) * x[t * H + c];
          }
          h[i] = gs / (1.0 + std::exp(-gs)) * us;
        }
        for (int r = 0; r < H; ++r) {
          double s = 0;
          for (int i = 0; i < I; ++i) s += static_cast<double>(d[r * I + i]) * h[i];
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
  const double err = rel(reference(false));
  EXPECT_LT(err, fc.tolerance) << common::WeightFormatName(fc.format);
  EXPECT_GT(rel(reference(true)), fc.tolerance) << "negative control";
  std::printf("%s: relative error %.4f\n", std::string(common::WeightFormatName(fc.format)).c_str(),
              err);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LoaderFormatTest,
    ::testing::Values(
        FormatCase{WeightFormat::kBf16, "--family qwen2_moe --seed 2", 0.01},
        FormatCase{WeightFormat::kQ4_0, "--family qwen2_moe --seed 2", 0.03},
        FormatCase{WeightFormat::kMxfp4, "--family qwen2_moe --seed 2", 0.03},
        FormatCase{WeightFormat::kNvfp4, "--family qwen2_moe --seed 2", 0.03},
        // fp8_block's per-expert scale rows are whole 16-byte rows from hidden 512 and
        // moe_intermediate 128 on (as in every real Qwen shape).
        FormatCase{WeightFormat::kFp8Block,
                   "--family qwen3_moe --seed 2 --layers 1 --experts 4 --hidden 512 "
                   "--moe_intermediate 128 --vocab 64",
                   0.01},
        // Small fp8 shapes: scale rows padded in the store, read from ModelWeights' copies.
        FormatCase{WeightFormat::kFp8Block, "--family qwen2_moe --seed 2", 0.01}),
    [](const ::testing::TestParamInfo<FormatCase>& info) {
      return absl::StrCat(std::string(common::WeightFormatName(info.param.format)), "_",
                          info.index);
    });

// The fused layout of transformers 5 (gate_up_proj [E, 2I, H] = per expert gate rows then up
// rows; down_proj [E, H, I]), made from the per-expert file the way transformers' conversion
// mapping does (MergeModulelist(dim=0), Concatenate(dim=1)), loads to the same store.
TEST(LoaderTest, FusedLayoutLoadsLikePerExpert) {
  const std::string a = Make("per_expert", "--family qwen3_moe --seed 3 --experts 4");
  const std::string b = Make("fused", "--family qwen3_moe --seed 3 --experts 4");
  const int E = 4, L = 2;
  ASSERT_TRUE(testing::RewriteTensors(b + "/model.safetensors", [&](std::vector<OwnedTensor>& ts) {
                std::vector<OwnedTensor> out;
                std::vector<OwnedTensor> gu(L), dn(L);
                for (int l = 0; l < L; ++l) {
                  const std::string p = absl::StrCat("model.layers.", l, ".mlp.experts.");
                  gu[l].name = p + "gate_up_proj";
                  dn[l].name = p + "down_proj";
                  for (int e = 0; e < E; ++e) {
                    for (const char* part : {"gate_proj", "up_proj"}) {
                      for (const OwnedTensor& t : ts) {
                        if (t.name == absl::StrCat(p, e, ".", part, ".weight")) {
                          gu[l].dtype = t.dtype;
                          gu[l].shape = {E, 2 * t.shape[0], t.shape[1]};
                          gu[l].bytes.insert(gu[l].bytes.end(), t.bytes.begin(), t.bytes.end());
                        }
                      }
                    }
                    for (const OwnedTensor& t : ts) {
                      if (t.name == absl::StrCat(p, e, ".down_proj.weight")) {
                        dn[l].dtype = t.dtype;
                        dn[l].shape = {E, t.shape[0], t.shape[1]};
                        dn[l].bytes.insert(dn[l].bytes.end(), t.bytes.begin(), t.bytes.end());
                      }
                    }
                  }
                }
                for (OwnedTensor& t : ts) {
                  if (t.name.find(".mlp.experts.") == std::string::npos) out.push_back(t);
                }
                for (int l = 0; l < L; ++l) {
                  out.push_back(gu[l]);
                  out.push_back(dn[l]);
                }
                ts = std::move(out);
              }).ok());
  absl::StatusOr<std::unique_ptr<ModelWeights>> wa = LoadModel(a, Opts());
  absl::StatusOr<std::unique_ptr<ModelWeights>> wb = LoadModel(b, Opts());
  ASSERT_TRUE(wa.ok()) << wa.status();
  ASSERT_TRUE(wb.ok()) << wb.status();
  for (int b_i = 0; b_i < 2; ++b_i) {
    const uint64_t bytes = (*wa)->experts->layout().bank(b_i).pitch * E * L;
    EXPECT_EQ(std::memcmp((*wa)->experts->bank_host(b_i), (*wb)->experts->bank_host(b_i), bytes),
              0);
  }
  // make_tiny_model's own fused output loads too.
  const std::string c = Make("fused_tool", "--family qwen2_moe --fused_experts --experts 4");
  absl::StatusOr<std::unique_ptr<ModelWeights>> wc = LoadModel(c, Opts(WeightFormat::kQ4_0));
  EXPECT_TRUE(wc.ok()) << wc.status();
}

TEST(LoaderTest, ShardedIndexLoadsLikeOneFile) {
  const std::string a = Make("one", "--family qwen2_moe --seed 4");
  const std::string b = Make("sharded", "--family qwen2_moe --seed 4 --shards 3");
  ASSERT_EQ(access((b + "/model.safetensors.index.json").c_str(), R_OK), 0);
  ASSERT_NE(access((b + "/model.safetensors").c_str(), R_OK), 0);
  absl::StatusOr<std::unique_ptr<ModelWeights>> wa = LoadModel(a, Opts());
  absl::StatusOr<std::unique_ptr<ModelWeights>> wb = LoadModel(b, Opts());
  ASSERT_TRUE(wa.ok()) << wa.status();
  ASSERT_TRUE(wb.ok()) << wb.status();
  const ModelWeights& ma = **wa;
  const ModelWeights& mb = **wb;
  EXPECT_EQ(std::memcmp(ma.experts->bank_host(0), mb.experts->bank_host(0),
                        ma.experts->layout().bank(0).pitch * ma.config.num_experts *
                            ma.experts->num_layers()),
            0);
  EXPECT_EQ(std::memcmp(ma.lm_head.bf16(), mb.lm_head.bf16(), ma.lm_head.data.bytes()), 0);
  EXPECT_EQ(std::memcmp(ma.layers[1].shared_down_proj.bf16(), mb.layers[1].shared_down_proj.bf16(),
                        ma.layers[1].shared_down_proj.data.bytes()),
            0);
}

TEST(LoaderTest, Qwen2MoeSharedExpertBiasesAndDenseLayers) {
  const std::string dir =
      Make("q2_mixed",
           "--family qwen2_moe --seed 5 --layers 4 --decoder_sparse_step 2 --mlp_only_layers 3 "
           "--tie_embeddings --transformers 5");
  absl::StatusOr<std::unique_ptr<ModelWeights>> w =
      LoadModel(dir, Opts(WeightFormat::kBf16, DType::kF32));
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  // Layers 1 is MoE; 0, 2 (sparse step) and 3 (mlp_only_layers) are dense.
  EXPECT_EQ(m.experts->num_layers(), 1);
  EXPECT_TRUE(m.layers[1].is_moe);
  EXPECT_EQ(m.layers[1].moe_index, 0);
  for (int l : {0, 2, 3}) {
    EXPECT_FALSE(m.layers[l].is_moe) << l;
    EXPECT_EQ(m.layers[l].mlp_gate_proj.rows, m.config.intermediate_size) << l;
    EXPECT_TRUE(m.layers[l].router.empty()) << l;
  }
  EXPECT_TRUE(m.lm_head.empty());  // tied
  EXPECT_EQ(m.layers[1].shared_gate_proj.rows, 64);
  EXPECT_EQ(m.layers[1].shared_expert_gate.rows, 1);
  EXPECT_EQ(m.layers[1].shared_expert_gate.cols, m.config.hidden_size);
  // f32 dense weights and biases hold the checkpoint's bf16 values exactly.
  const std::vector<float> qb = Values(*(*ck)->Find("model.layers.2.self_attn.q_proj.bias"));
  ASSERT_EQ(m.layers[2].q_bias.cols, static_cast<int64_t>(qb.size()));
  for (size_t i = 0; i < qb.size(); ++i) EXPECT_EQ(m.layers[2].q_bias.f32()[i], qb[i]);
  const std::vector<float> sd =
      Values(*(*ck)->Find("model.layers.1.mlp.shared_expert.down_proj.weight"));
  ASSERT_EQ(m.layers[1].shared_down_proj.dtype, DType::kF32);
  for (size_t i = 0; i < sd.size(); ++i) ASSERT_EQ(m.layers[1].shared_down_proj.f32()[i], sd[i]);
  EXPECT_TRUE(m.layers[1].q_norm.empty());
}

// F32 and F16 checkpoints: f32 dense tensors hold the file's values exactly (f16 widens
// exactly), bf16 experts are those values rounded to nearest even.
TEST(LoaderTest, F32AndF16Sources) {
  for (const char* dtype : {"f32", "f16"}) {
    const std::string dir = Make(absl::StrCat("src_", dtype),
                                 absl::StrCat("--family qwen2_moe --seed 9 --dtype ", dtype));
    absl::StatusOr<std::unique_ptr<ModelWeights>> w =
        LoadModel(dir, Opts(WeightFormat::kBf16, DType::kF32));
    ASSERT_TRUE(w.ok()) << w.status();
    absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
    ASSERT_TRUE(ck.ok());
    const StTensor* o = (*ck)->Find("model.layers.0.self_attn.o_proj.weight");
    EXPECT_EQ(o->dtype, std::string(dtype) == "f32" ? StDtype::kF32 : StDtype::kF16);
    const std::vector<float> ov = Values(*o);
    const Tensor& ot = (*w)->layers[0].o_proj;
    ASSERT_EQ(ot.numel(), static_cast<int64_t>(ov.size()));
    for (size_t i = 0; i < ov.size(); ++i) ASSERT_EQ(ot.f32()[i], ov[i]) << dtype << " " << i;
    const std::vector<float> dv =
        Values(*(*ck)->Find("model.layers.1.mlp.experts.6.down_proj.weight"));
    const cpu_moe::ExpertBank bank = (*w)->ExpertBankFor(1);
    const auto* down = static_cast<const uint16_t*>(bank.down_weights) + 6 * dv.size();
    for (size_t i = 0; i < dv.size(); ++i) {
      ASSERT_EQ(down[i], common::FloatToBf16(dv[i])) << dtype << " " << i;
    }
  }
}

// FP8 block-quantized checkpoints: real = fp8 * weight_scale_inv per 128x128 block, against a
// float64 reference computed here from the file's codes and scales.
TEST(LoaderTest, Fp8CheckpointDequantizesLikeFloat64) {
  const std::string dir = Make("fp8",
                               "--family qwen3_moe --seed 6 --dtype fp8 --hidden 192 "
                               "--moe_intermediate 160 --heads 4 --head_dim 48");
  absl::StatusOr<std::unique_ptr<ModelWeights>> w =
      LoadModel(dir, Opts(WeightFormat::kBf16, DType::kF32));
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelWeights& m = **w;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  auto reference = [&](const std::string& name, int64_t r, int64_t c) {
    const StTensor* q = (*ck)->Find(name);
    const StTensor* s = (*ck)->Find(name + "_scale_inv");
    EXPECT_EQ(q->dtype, StDtype::kF8E4M3);
    const int64_t cols = q->shape[1], scols = s->shape[1];
    float scale;
    std::memcpy(&scale, s->data + 4 * ((r / 128) * scols + c / 128), 4);
    return static_cast<double>(common::Fp8E4M3ToFloat(q->data[r * cols + c])) *
           static_cast<double>(scale);
  };
  // A dense projection with partial edge blocks ([192, 192]: blocks of 128 and 64).
  const Tensor& q = m.layers[1].q_proj;
  ASSERT_EQ(q.dtype, DType::kF32);
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const double ref = reference("model.layers.1.self_attn.q_proj.weight", r, c);
      ASSERT_NEAR(q.f32()[r * q.cols + c], ref, std::abs(ref) * 6e-8) << r << "," << c;
    }
  }
  // Experts (160 rows: not whole 128-blocks, so dequantized) into bf16: within half a bf16 ulp.
  const cpu_moe::ExpertBank bank = m.ExpertBankFor(0);
  const int64_t H = 192, I = 160;
  const auto* gu = static_cast<const uint16_t*>(bank.gate_up_weights) + 3 * 2 * I * H;
  for (int64_t r = 0; r < I; ++r) {
    for (int64_t c = 0; c < H; ++c) {
      const double ref = reference("model.layers.0.mlp.experts.3.up_proj.weight", r, c);
      ASSERT_NEAR(common::Bf16ToFloat(gu[(I + r) * H + c]), ref, std::abs(ref) * (1.0 / 256))
          << r << "," << c;
    }
  }
}

// FP8 experts in whole 128x128 blocks go into fp8_block as they are: codes and scales unchanged.
TEST(LoaderTest, Fp8ExpertsPassStraightIntoFp8Block) {
  const std::string dir = Make("fp8_pass",
                               "--family qwen3_moe --seed 8 --dtype fp8 --layers 1 "
                               "--experts 2 --hidden 512 --moe_intermediate 128 "
                               "--vocab 64");
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts(WeightFormat::kFp8Block));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  const cpu_moe::ExpertBank bank = (*w)->ExpertBankFor(0);
  const int64_t H = 512, I = 128;
  for (int e = 0; e < 2; ++e) {
    const std::string p = absl::StrCat("model.layers.0.mlp.experts.", e, ".");
    const auto* codes = static_cast<const uint8_t*>(bank.gate_up_weights) + e * 2 * I * H;
    const auto* scales =
        static_cast<const float*>(bank.gate_up_scales) + e * 2 * (I / 128) * (H / 128);
    const StTensor* up = (*ck)->Find(p + "up_proj.weight");
    const StTensor* up_s = (*ck)->Find(p + "up_proj.weight_scale_inv");
    EXPECT_EQ(std::memcmp(codes + I * H, up->data, I * H), 0);
    EXPECT_EQ(std::memcmp(scales + (I / 128) * (H / 128), up_s->data, up_s->bytes), 0);
    const auto* down = static_cast<const uint8_t*>(bank.down_weights) + e * H * I;
    EXPECT_EQ(std::memcmp(down, (*ck)->Find(p + "down_proj.weight")->data, H * I), 0);
  }
}

// ---- Errors: each names the file and the tensor. ----

TEST(LoaderErrorTest, MissingConfig) {
  const std::string dir = Make("e_noconfig", "--family qwen3_moe");
  ASSERT_EQ(unlink((dir + "/config.json").c_str()), 0);
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts());
  ExpectError(w, {dir + "/config.json", "cannot open"});
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
}

TEST(LoaderErrorTest, BadConfigJson) {
  const std::string dir = Make("e_badjson", "--family qwen3_moe");
  testing::WriteFile(dir + "/config.json", "{\"model_type\": \"qwen3_moe\", ");
  ExpectError(LoadModel(dir, Opts()), {dir + "/config.json", "not valid JSON"});
}

TEST(LoaderErrorTest, UnknownModelType) {
  const std::string dir = Make("e_type", "--family qwen3_moe");
  std::string cfg = testing::ReadFile(dir + "/config.json");
  cfg.replace(cfg.find("\"qwen3_moe\""), 11, "\"mixtral\"");
  testing::WriteFile(dir + "/config.json", cfg);
  ExpectError(LoadModel(dir, Opts()), {dir + "/config.json", "mixtral", "qwen2_moe, qwen3_moe"});
}

TEST(LoaderErrorTest, MissingWeightsFile) {
  const std::string dir = Make("e_noweights", "--family qwen3_moe");
  ASSERT_EQ(unlink((dir + "/model.safetensors").c_str()), 0);
  absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(dir, Opts());
  ExpectError(w, {dir, "model.safetensors"});
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
}

TEST(LoaderErrorTest, MissingTensor) {
  const std::string dir = Make("e_missing", "--family qwen3_moe");
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors", [](std::vector<OwnedTensor>& ts) {
                for (size_t i = 0; i < ts.size(); ++i) {
                  if (ts[i].name == "model.layers.1.mlp.experts.5.up_proj.weight") {
                    ts.erase(ts.begin() + i);
                    return;
                  }
                }
              }).ok());
  ExpectError(
      LoadModel(dir, Opts()),
      {dir + "/model.safetensors", "\"model.layers.1.mlp.experts.5.up_proj.weight\"", "missing"});
}

TEST(LoaderErrorTest, WrongShape) {
  const std::string dir = Make("e_shape", "--family qwen3_moe --hidden 64 --heads 2 --head_dim 16");
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors", [](std::vector<OwnedTensor>& ts) {
                for (OwnedTensor& t : ts) {
                  if (t.name == "model.layers.0.self_attn.o_proj.weight") {
                    std::swap(t.shape[0], t.shape[1]);  // same bytes, transposed shape
                  }
                }
              }).ok());
  ExpectError(LoadModel(dir, Opts()),
              {dir + "/model.safetensors", "\"model.layers.0.self_attn.o_proj.weight\"",
               "has shape [32, 64], expected [64, 32]"});
}

TEST(LoaderErrorTest, WrongDtype) {
  const std::string dir = Make("e_dtype", "--family qwen3_moe");
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors", [](std::vector<OwnedTensor>& ts) {
                for (OwnedTensor& t : ts) {
                  if (t.name == "model.layers.0.mlp.gate.weight") t.dtype = StDtype::kI16;
                }
              }).ok());
  ExpectError(LoadModel(dir, Opts()),
              {dir + "/model.safetensors", "\"model.layers.0.mlp.gate.weight\"", "dtype I16"});
}

TEST(LoaderErrorTest, TruncatedFile) {
  const std::string dir = Make("e_trunc", "--family qwen3_moe");
  const std::string path = dir + "/model.safetensors";
  const std::string bytes = testing::ReadFile(path);
  testing::WriteFile(path, bytes.substr(0, bytes.size() - 100));
  // make_tiny_model writes lm_head.weight last.
  ExpectError(LoadModel(dir, Opts()), {path, "\"lm_head.weight\"", "past the end"});
  testing::WriteFile(path, bytes.substr(0, 5));
  ExpectError(LoadModel(dir, Opts()), {path, "truncated"});
}

TEST(LoaderErrorTest, HeaderOffsetsPastTheEnd) {
  const std::string dir = Make("e_past", "--family qwen3_moe");
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(testing::RewriteHeader(path, [](nlohmann::json& h) {
                auto& t = h["model.norm.weight"];
                const uint64_t n =
                    t["data_offsets"][1].get<uint64_t>() - t["data_offsets"][0].get<uint64_t>();
                t["data_offsets"] = {uint64_t{1} << 40, (uint64_t{1} << 40) + n};
              }).ok());
  ExpectError(LoadModel(dir, Opts()), {path, "\"model.norm.weight\"", "past the end"});
}

TEST(LoaderErrorTest, HeaderOffsetsOverlap) {
  const std::string dir = Make("e_overlap", "--family qwen3_moe");
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(testing::RewriteHeader(path, [](nlohmann::json& h) {
                // Point one norm at another's bytes (same size).
                h["model.layers.1.input_layernorm.weight"]["data_offsets"] =
                    h["model.layers.0.input_layernorm.weight"]["data_offsets"];
              }).ok());
  ExpectError(LoadModel(dir, Opts()), {path, "input_layernorm.weight", "overlap"});
}

TEST(LoaderErrorTest, UnsortedOffsetsAreFine) {
  const std::string dir = Make("e_unsorted", "--family qwen3_moe");
  const std::string path = dir + "/model.safetensors";
  // Reverse the data order while keeping every tensor: a valid, unsorted file.
  ASSERT_TRUE(testing::RewriteTensors(path, [](std::vector<OwnedTensor>& ts) {
                std::reverse(ts.begin(), ts.end());
              }).ok());
  EXPECT_TRUE(LoadModel(dir, Opts()).ok());
}

TEST(LoaderErrorTest, MissingShard) {
  const std::string dir = Make("e_shard", "--family qwen3_moe --shards 2");
  ASSERT_EQ(unlink((dir + "/model-00002-of-00002.safetensors").c_str()), 0);
  ExpectError(LoadModel(dir, Opts()), {"model-00002-of-00002.safetensors", "cannot open"});
}

TEST(LoaderErrorTest, IndexNamesATensorItsShardLacks) {
  const std::string dir = Make("e_index", "--family qwen3_moe --shards 2");
  const std::string path = dir + "/model.safetensors.index.json";
  nlohmann::json idx = nlohmann::json::parse(testing::ReadFile(path));
  idx["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors";
  testing::WriteFile(path, idx.dump());
  ExpectError(LoadModel(dir, Opts()),
              {path, "\"lm_head.weight\"", "model-00001-of-00002.safetensors", "does not hold it"});
}

TEST(LoaderErrorTest, Fp8WithoutScales) {
  const std::string dir = Make("e_fp8", "--family qwen3_moe --dtype fp8");
  ASSERT_TRUE(testing::RewriteTensors(dir + "/model.safetensors", [](std::vector<OwnedTensor>& ts) {
                for (size_t i = 0; i < ts.size(); ++i) {
                  if (ts[i].name == "model.layers.0.self_attn.k_proj.weight_scale_inv") {
                    ts.erase(ts.begin() + i);
                    return;
                  }
                }
              }).ok());
  ExpectError(LoadModel(dir, Opts()),
              {dir + "/model.safetensors", "\"model.layers.0.self_attn.k_proj.weight_scale_inv\"",
               "missing"});
}

TEST(LoaderErrorTest, ExpertShapesTheKernelsCannotTake) {
  const std::string dir = Make("e_shape32", "--family qwen3_moe --moe_intermediate 40");
  ExpectError(LoadModel(dir, Opts()), {"config.json", "multiples of 32"});
}

}  // namespace
}  // namespace moe::engine
