// MakeRandomModel: qwen3_5_moe models (Gated DeltaNet layers, gated attention, the gated shared
// expert) run through the CPU Model with finite, format-consistent logits in every expert format;
// the fp8_block and nvfp4 banks hold exactly the float values the model reports (decoded here
// from cpu_moe.h's documented layouts, not through common/formats), with nvfp4's gate, up and
// down per-tensor scales apart; fast_fill copies its few distinct experts over the whole bank,
// at Qwen3.6-35B-A3B's own shapes.
#include "engine/random_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/model.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

using common::WeightFormat;

// A small qwen3_5_moe: layers 0-2 Gated DeltaNet, layer 3 gated full attention.
ModelConfig TinyQwen35() {
  ModelConfig c = Qwen36_35B_A3B(/*num_layers=*/4);
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.moe_intermediate_size = 32;
  c.shared_expert_intermediate_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 256;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.linear = {/*num_key_heads=*/2, /*num_value_heads=*/4, /*key_head_dim=*/16,
              /*value_head_dim=*/16, /*conv_kernel=*/4};
  return c;
}

std::vector<int32_t> Tokens(int n, int vocab, int seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 31 + i * 17 + i * i * 7) % vocab;
  return t;
}

// A Model over a random model with its KV cache and linear-attention state.
struct Runner {
  RandomModel rm;
  common::ThreadPool pool{2};
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;
  std::unique_ptr<LinearAttentionState> state;
  static constexpr int kBlock = 4;

  absl::Status Init(const ModelConfig& c, const RandomModelOptions& o, int slots) {
    absl::StatusOr<RandomModel> m = MakeRandomModel(c, o);
    if (!m.ok()) return m.status();
    rm = std::move(*m);
    backend = std::make_unique<CpuExpertBackend>(
        rm.banks, CpuExpertBackend::DefaultOptions(/*deterministic=*/true, /*f32=*/true), &pool);
    absl::StatusOr<std::unique_ptr<Model>> md = Model::Create(
        rm.weights.get(), backend.get(), &pool, /*deterministic=*/true, c.max_position_embeddings);
    if (!md.ok()) return md.status();
    model = std::move(*md);
    absl::StatusOr<std::unique_ptr<KvCache>> k =
        KvCache::Create(c.NumKvLayers(), c.num_key_value_heads, c.head_dim, kBlock, 64 * slots);
    if (!k.ok()) return k.status();
    kv = std::move(*k);
    absl::StatusOr<std::unique_ptr<LinearAttentionState>> s =
        LinearAttentionState::Create(c, slots);
    if (!s.ok()) return s.status();
    state = std::move(*s);
    return absl::OkStatus();
  }

  // Teacher-forced logits of each sequence (slot = its index): prefill of all but the last
  // token in one chunk each (all sequences in one batch), then the last token as a batched
  // decode step. Rows: every prefill token, then every decode token.
  absl::StatusOr<std::vector<float>> Run(const std::vector<std::vector<int32_t>>& seqs) {
    std::vector<std::vector<int32_t>> tables(seqs.size());
    std::vector<Model::Chunk> chunks;
    for (size_t s = 0; s < seqs.size(); ++s) {
      if (!kv->Allocate((static_cast<int>(seqs[s].size()) + kBlock - 1) / kBlock, &tables[s])) {
        return absl::ResourceExhaustedError("kv");
      }
      chunks.push_back({absl::MakeConstSpan(seqs[s].data(), seqs[s].size() - 1), 0, &tables[s],
                        Model::Logits::kAll, static_cast<int>(s)});
    }
    std::vector<float> logits;
    RETURN_IF_ERROR(model->Forward(chunks, kv.get(), &logits, state.get()));
    chunks.clear();
    for (size_t s = 0; s < seqs.size(); ++s) {
      chunks.push_back({absl::MakeConstSpan(&seqs[s].back(), 1),
                        static_cast<int>(seqs[s].size()) - 1, &tables[s], Model::Logits::kLast,
                        static_cast<int>(s)});
    }
    RETURN_IF_ERROR(model->Forward(chunks, kv.get(), &logits, state.get()));
    for (auto& t : tables) kv->Free(&t);
    return logits;
  }
};

double Cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

TEST(RandomModelTest, Qwen35ForwardIsFiniteAndAgreesAcrossExpertFormats) {
  const ModelConfig c = TinyQwen35();
  const std::vector<std::vector<int32_t>> seqs = {Tokens(9, c.vocab_size, 1),
                                                  Tokens(21, c.vocab_size, 2)};
  std::vector<float> bf16_logits;
  // Cosine similarity to the bf16 model's logits (the same draws, quantized otherwise): the
  // quantized formats perturb the experts by their rounding only.
  const std::pair<WeightFormat, double> formats[] = {{WeightFormat::kBf16, 1.0},
                                                     {WeightFormat::kFp8Block, 0.999},
                                                     {WeightFormat::kQ4_0, 0.99},
                                                     {WeightFormat::kMxfp4, 0.98},
                                                     {WeightFormat::kNvfp4, 0.99}};
  for (const auto& [format, min_cosine] : formats) {
    SCOPED_TRACE(common::WeightFormatName(format));
    RandomModelOptions o;
    o.expert_format = format;
    o.seed = 5;
    Runner r;
    ASSERT_TRUE(r.Init(c, o, /*slots=*/2).ok());
    // The layer kinds got their own weights.
    const LayerWeights& lin = r.rm.weights->layers[0];
    const LayerWeights& full = r.rm.weights->layers[3];
    ASSERT_EQ(lin.in_proj_qkv.rows, c.linear.conv_dim());
    ASSERT_EQ(lin.conv1d.rows, c.linear.conv_kernel);
    ASSERT_EQ(lin.conv1d.cols, c.linear.conv_dim());
    ASSERT_TRUE(lin.q_proj.empty());
    ASSERT_EQ(full.q_proj.rows, 2 * c.num_attention_heads * c.head_dim);  // query + gate
    ASSERT_TRUE(full.in_proj_qkv.empty());
    ASSERT_FALSE(full.shared_expert_gate.empty());
    for (int h = 0; h < c.linear.num_value_heads; ++h) {
      const float a = std::exp(lin.a_log.f32()[h]);
      EXPECT_TRUE(a >= 1.0f && a <= 16.0f) << a;
    }
    absl::StatusOr<std::vector<float>> logits = r.Run(seqs);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ASSERT_EQ(logits->size(), static_cast<size_t>(30) * c.vocab_size);
    double max_abs = 0, sum_sq = 0;
    for (float v : *logits) {
      ASSERT_TRUE(std::isfinite(v));
      max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
      sum_sq += static_cast<double>(v) * v;
    }
    const double rms = std::sqrt(sum_sq / logits->size());
    // Sane magnitudes: neither collapsed nor blown up through the layers.
    EXPECT_GT(rms, 0.05);
    EXPECT_LT(max_abs, 100.0);
    if (format == WeightFormat::kBf16) {
      bf16_logits = *logits;
    } else {
      const double cos = Cosine(*logits, bf16_logits);
      std::printf("%s: logits rms %.3f, max %.3f, cosine to bf16 %.5f\n",
                  std::string(common::WeightFormatName(format)).c_str(), rms, max_abs, cos);
      EXPECT_GT(cos, min_cosine);
    }
  }
}

// The recurrent state carries the sequence: the same tokens prefilled in one chunk and fed one
// at a time give the same logits (random weights in the range where the chunked delta rule is
// stable), and another sequence's state in the next slot changes nothing.
TEST(RandomModelTest, Qwen35ChunkedPrefillMatchesTokenByToken) {
  const ModelConfig c = TinyQwen35();
  RandomModelOptions o;
  o.expert_format = WeightFormat::kNvfp4;
  o.seed = 9;
  Runner r;
  ASSERT_TRUE(r.Init(c, o, /*slots=*/2).ok());
  const std::vector<int32_t> seq = Tokens(40, c.vocab_size, 3);
  std::vector<int32_t> table;
  ASSERT_TRUE(r.kv->Allocate(10, &table));
  std::vector<float> chunked;
  Model::Chunk whole{seq, 0, &table, Model::Logits::kAll, 0};
  ASSERT_TRUE(r.model->Forward({whole}, r.kv.get(), &chunked, r.state.get()).ok());
  const std::vector<int32_t> other = Tokens(40, c.vocab_size, 4);
  std::vector<int32_t> other_table;
  ASSERT_TRUE(r.kv->Allocate(10, &other_table));
  std::vector<float> stepped;
  for (int i = 0; i < 40; ++i) {
    std::vector<float> scratch;
    std::vector<Model::Chunk> batch = {
        {absl::MakeConstSpan(&seq[i], 1), i, &table, Model::Logits::kLast, 0},
        {absl::MakeConstSpan(&other[i], 1), i, &other_table, Model::Logits::kLast, 1}};
    ASSERT_TRUE(r.model->Forward(batch, r.kv.get(), &scratch, r.state.get()).ok());
    stepped.insert(stepped.end(), scratch.begin(), scratch.begin() + c.vocab_size);
  }
  ASSERT_EQ(chunked.size(), stepped.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < chunked.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(chunked[i]) - stepped[i]));
    scale = std::max(scale, std::abs(static_cast<double>(chunked[i])));
  }
  std::printf("chunked vs token by token: max diff / max logit %.3g\n", diff / scale);
  EXPECT_LT(diff / scale, 1e-3);
}

// ---- The banks against their float values, decoded from cpu_moe.h's layout definitions. ----

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

// Element (r, c) of an nvfp4 [rows, cols] matrix in Layout::kPanels (cpu_moe.h): panels of 16
// rows; per 32-column block 256 code bytes (byte 64v + 4j + i: row j's columns 8v + i in the
// low nibble and 8v + 4 + i in the high one) and 32 scale bytes (the 16 rows' e4m3 scales of
// the block's first 16 columns, then of its last 16); blocks in groups of two, the group's codes
// before its scales.
double PanelNvfp4(const uint8_t* m, int64_t cols, int64_t r, int64_t c) {
  const int64_t blocks = cols / 32, panel = r / 16, j = r % 16, b = c / 32, k = c % 32;
  const uint8_t* p = m + panel * blocks * (256 + 32);
  const int64_t g0 = b / 2 * 2, in_group = std::min<int64_t>(2, blocks - g0);
  const uint8_t* group = p + g0 * (256 + 32);
  const uint8_t* codes = group + (b - g0) * 256;
  const uint8_t* scales = group + in_group * 256 + (b - g0) * 32;
  const int64_t v = k / 8, i = k % 8 % 4;
  const bool high = k % 8 >= 4;
  const uint8_t byte = codes[64 * v + 4 * j + i];
  const uint8_t code = high ? byte >> 4 : byte & 15;
  return E2m1(code) * E4m3(scales[(k < 16 ? 0 : 16) + j]);
}

ModelConfig BankConfig(int hidden, int intermediate, int experts) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 16;
  c.hidden_size = hidden;
  c.moe_intermediate_size = intermediate;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  c.qk_norm = true;
  return c;
}

TEST(RandomModelTest, Fp8BlockBankHoldsItsFloatValues) {
  // 2I = 192 and H = 160: partial 128-blocks in both directions.
  const int H = 160, I = 96, E = 3;
  RandomModelOptions o;
  o.expert_format = WeightFormat::kFp8Block;
  absl::StatusOr<RandomModel> rm = MakeRandomModel(BankConfig(H, I, E), o);
  ASSERT_TRUE(rm.ok()) << rm.status();
  RandomModelOptions bo;
  absl::StatusOr<RandomModel> bf = MakeRandomModel(BankConfig(H, I, E), bo);
  ASSERT_TRUE(bf.ok()) << bf.status();
  for (int l = 0; l < 2; ++l) {
    const cpu_moe::ExpertBank& b = rm->banks[l];
    ASSERT_EQ(b.format, WeightFormat::kFp8Block);
    const auto* codes = static_cast<const uint8_t*>(b.gate_up_weights);
    const auto* scales = static_cast<const float*>(b.gate_up_scales);
    const auto* dcodes = static_cast<const uint8_t*>(b.down_weights);
    const auto* dscales = static_cast<const float*>(b.down_scales);
    const int gs = 2 * 2, ds = 2 * 1;  // [ceil(192/128), ceil(160/128)], [ceil(160/128), 1]
    double err = 0, ref = 0;
    for (int e = 0; e < E; ++e) {
      for (int r = 0; r < 2 * I; ++r) {
        for (int c = 0; c < H; ++c) {
          const size_t at = (static_cast<size_t>(e) * 2 * I + r) * H + c;
          const double want = E4m3(codes[at]) * scales[e * gs + (r / 128) * 2 + c / 128];
          ASSERT_NEAR(rm->gate_up[l][at], want, std::abs(want) * 1e-6) << e << " " << r << " " << c;
          err += std::pow(want - bf->gate_up[l][at], 2);
          ref += std::pow(bf->gate_up[l][at], 2);
        }
      }
      for (int r = 0; r < H; ++r) {
        for (int c = 0; c < I; ++c) {
          const size_t at = (static_cast<size_t>(e) * H + r) * I + c;
          const double want = E4m3(dcodes[at]) * dscales[e * ds + (r / 128)];
          ASSERT_NEAR(rm->down[l][at], want, std::abs(want) * 1e-6) << e << " " << r << " " << c;
        }
      }
    }
    // The same draws as the bf16 model's, rounded to e4m3 (3 mantissa bits): a few percent.
    EXPECT_LT(std::sqrt(err / ref), 0.05);
  }
}

TEST(RandomModelTest, Nvfp4BankHoldsItsFloatValuesWithGateUpAndDownScalesApart) {
  const int H = 96, I = 64, E = 3;  // H = 96: a panel row of three blocks, the last group short
  RandomModelOptions o;
  o.expert_format = WeightFormat::kNvfp4;
  absl::StatusOr<RandomModel> rm = MakeRandomModel(BankConfig(H, I, E), o);
  ASSERT_TRUE(rm.ok()) << rm.status();
  absl::StatusOr<RandomModel> bf = MakeRandomModel(BankConfig(H, I, E), RandomModelOptions());
  ASSERT_TRUE(bf.ok()) << bf.status();
  for (int l = 0; l < 2; ++l) {
    const cpu_moe::ExpertBank& b = rm->banks[l];
    ASSERT_EQ(b.format, WeightFormat::kNvfp4);
    ASSERT_EQ(b.layout, cpu_moe::Layout::kPanels);
    ASSERT_NE(b.up_global_scales, nullptr);
    const size_t gu_bytes = b.GateUpBytesPerExpert() - sizeof(float);
    const size_t dn_bytes = b.DownBytesPerExpert() - sizeof(float);
    ASSERT_EQ(gu_bytes, static_cast<size_t>(2 * I) * (H / 2 + H / 16));
    double err = 0, ref = 0;
    for (int e = 0; e < E; ++e) {
      const double g_gate = b.gate_up_global_scales[e], g_up = b.up_global_scales[e],
                   g_down = b.down_global_scales[e];
      EXPECT_NE(g_gate, g_up) << "gate and up share a per-tensor scale";
      const auto* gu = static_cast<const uint8_t*>(b.gate_up_weights) + e * gu_bytes;
      const auto* dn = static_cast<const uint8_t*>(b.down_weights) + e * dn_bytes;
      for (int r = 0; r < 2 * I; ++r) {
        for (int c = 0; c < H; ++c) {
          const size_t at = (static_cast<size_t>(e) * 2 * I + r) * H + c;
          const double want = PanelNvfp4(gu, H, r, c) * (r < I ? g_gate : g_up);
          ASSERT_NEAR(rm->gate_up[l][at], want, std::abs(want) * 1e-6) << e << " " << r << " " << c;
          err += std::pow(want - bf->gate_up[l][at], 2);
          ref += std::pow(bf->gate_up[l][at], 2);
        }
      }
      for (int r = 0; r < H; ++r) {
        for (int c = 0; c < I; ++c) {
          const size_t at = (static_cast<size_t>(e) * H + r) * I + c;
          const double want = PanelNvfp4(dn, I, r, c) * g_down;
          ASSERT_NEAR(rm->down[l][at], want, std::abs(want) * 1e-6) << e << " " << r << " " << c;
        }
      }
    }
    // The same draws as the bf16 model's, in e2m1 with e4m3 scales per 16: within ~10%.
    const double rel = std::sqrt(err / ref);
    EXPECT_GT(rel, 0.01);  // really quantized
    EXPECT_LT(rel, 0.15);
  }
}

// Full-size shapes with fast_fill: Qwen3.6-35B-A3B's hidden, expert, Gated DeltaNet and
// attention sizes (four layers, 16 experts, a short vocabulary to keep the test quick); the
// experts past the distinct ones are byte copies, and a forward runs finite.
TEST(RandomModelTest, FastFillAtQwen36Shapes) {
  ModelConfig c = Qwen36_35B_A3B(/*num_layers=*/4);
  c.num_experts = 16;
  c.vocab_size = 512;
  c.max_position_embeddings = 64;
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(common::WeightFormatName(f));
    common::ThreadPool pool(2);
    RandomModelOptions o;
    o.expert_format = f;
    o.dense_dtype = DType::kBf16;
    o.fast_fill = true;
    o.distinct_experts = 3;
    o.pool = &pool;
    Runner r;
    ASSERT_TRUE(r.Init(c, o, /*slots=*/1).ok());
    ASSERT_EQ(r.rm.banks.size(), 4u);
    EXPECT_TRUE(r.rm.gate_up[0].empty());  // no float copies at this size
    for (const cpu_moe::ExpertBank& b : r.rm.banks) {
      ASSERT_EQ(b.num_experts, 16);
      const size_t gu = b.GateUpBytesPerExpert(), dn = b.DownBytesPerExpert();
      // Weight bytes per expert, without the scales kept apart (fp8's block scales, nvfp4's
      // per-tensor scale).
      const size_t gu_w = f == WeightFormat::kNvfp4 ? gu - 4 : 2 * 512 * 2048;
      const size_t dn_w = f == WeightFormat::kNvfp4 ? dn - 4 : 2048 * 512;
      const auto* gw = static_cast<const uint8_t*>(b.gate_up_weights);
      const auto* dw = static_cast<const uint8_t*>(b.down_weights);
      for (int e = 3; e < 16; ++e) {
        EXPECT_EQ(std::memcmp(gw + e * gu_w, gw + (e % 3) * gu_w, gu_w), 0) << e;
        EXPECT_EQ(std::memcmp(dw + e * dn_w, dw + (e % 3) * dn_w, dn_w), 0) << e;
        if (f == WeightFormat::kNvfp4) {
          EXPECT_EQ(b.gate_up_global_scales[e], b.gate_up_global_scales[e % 3]);
          EXPECT_EQ(b.up_global_scales[e], b.up_global_scales[e % 3]);
          EXPECT_EQ(b.down_global_scales[e], b.down_global_scales[e % 3]);
        } else {
          const auto* s = static_cast<const float*>(b.gate_up_scales);
          EXPECT_EQ(std::memcmp(s + e * 8 * 16, s + (e % 3) * 8 * 16, 8 * 16 * 4), 0) << e;
        }
      }
      EXPECT_NE(std::memcmp(gw, gw + gu_w, gu_w), 0);  // the distinct ones differ
    }
    absl::StatusOr<std::vector<float>> logits =
        r.Run({Tokens(6, c.vocab_size, 1)});
    ASSERT_TRUE(logits.ok()) << logits.status();
    for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(RandomModelTest, BadLinearAttentionSizesAreInvalidArgument) {
  ModelConfig c = TinyQwen35();
  c.linear.num_value_heads = 3;  // not a multiple of 2 key heads
  EXPECT_EQ(MakeRandomModel(c, {}).status().code(), absl::StatusCode::kInvalidArgument);
  c = TinyQwen35();
  c.hidden_size = 48;
  EXPECT_EQ(MakeRandomModel(c, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::engine
