// The CPU forward pass against the float64 reference (reference_forward.h) on random models of
// both families, batched with sequences of different lengths, chunked, and decoding over the
// paged KV cache; and the deterministic mode's batch independence.
#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/random_model.h"
#include "engine/reference_forward.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

ModelConfig Qwen3Config() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 101;
  c.hidden_size = 64;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 96;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;  // GQA
  c.head_dim = 16;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 128;
  c.num_experts = 8;
  c.num_experts_per_tok = 3;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  return c;
}

ModelConfig Qwen2Config() {
  ModelConfig c;
  c.model_type = "qwen2_moe";
  c.vocab_size = 77;
  c.hidden_size = 64;
  c.moe_intermediate_size = 32;
  c.shared_expert_intermediate_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1000000.0;
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 16;
  c.max_position_embeddings = 64;
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = false;
  c.decoder_sparse_step = 2;  // layers 1 and 3 are MoE ...
  c.mlp_only_layers = {3};    // ... but 3 is dense
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  return c;
}

std::vector<int32_t> Tokens(int n, int vocab, int seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 31 + i * 17 + i * i * 7) % vocab;
  return t;
}

// max |a - b| / max |b|
double RelErr(const float* a, const double* b, size_t n) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

struct Fixture {
  RandomModel rm;
  common::ThreadPool pool{2};
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;

  Fixture(const ModelConfig& c, bool deterministic, int kv_blocks = 64, int block_size = 4) {
    RandomModelOptions o;
    o.dense_dtype = DType::kF32;
    auto m = MakeRandomModel(c, o);
    EXPECT_TRUE(m.ok()) << m.status();
    rm = std::move(*m);
    backend = std::make_unique<CpuExpertBackend>(
        rm.banks, CpuExpertBackend::DefaultOptions(deterministic, /*f32_activations=*/true), &pool);
    auto md = Model::Create(rm.weights.get(), backend.get(), &pool, deterministic,
                            c.max_position_embeddings);
    EXPECT_TRUE(md.ok()) << md.status();
    model = std::move(*md);
    auto k = KvCache::Create(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size,
                             kv_blocks);
    EXPECT_TRUE(k.ok()) << k.status();
    kv = std::move(*k);
  }
};

void CheckAgainstReference(const ModelConfig& c) {
  Fixture f(c, /*deterministic=*/false);
  const int V = c.vocab_size;
  const std::vector<std::vector<int32_t>> seqs = {Tokens(5, V, 1), Tokens(11, V, 2),
                                                  Tokens(3, V, 3)};
  std::vector<std::vector<int32_t>> tables(seqs.size());
  std::vector<Model::Chunk> chunks;
  for (size_t s = 0; s < seqs.size(); ++s) {
    ASSERT_TRUE(f.kv->Allocate((static_cast<int>(seqs[s].size()) + 4 + 3) / 4, &tables[s]));
    chunks.push_back({seqs[s], 0, &tables[s], Model::Logits::kAll});
  }
  std::vector<float> logits;
  ASSERT_TRUE(f.model->Forward(chunks, f.kv.get(), &logits).ok());
  size_t row = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const std::vector<double> ref = ReferenceForward(f.rm, seqs[s]);
    const double err = RelErr(logits.data() + row * V, ref.data(), ref.size());
    std::printf("sequence %zu: max abs diff / max abs logit %.3g\n", s, err);
    EXPECT_LT(err, 1e-4) << "sequence " << s;
    row += seqs[s].size();
  }
  // Decode one more token per sequence, batched, over the KV cache.
  std::vector<std::vector<int32_t>> next(seqs.size());
  chunks.clear();
  for (size_t s = 0; s < seqs.size(); ++s) {
    next[s] = {static_cast<int32_t>((s * 13 + 5) % V)};
    chunks.push_back({next[s], static_cast<int>(seqs[s].size()), &tables[s], Model::Logits::kLast});
  }
  logits.clear();
  ASSERT_TRUE(f.model->Forward(chunks, f.kv.get(), &logits).ok());
  for (size_t s = 0; s < seqs.size(); ++s) {
    std::vector<int32_t> full = seqs[s];
    full.push_back(next[s][0]);
    const std::vector<double> ref = ReferenceForward(f.rm, full);
    EXPECT_LT(RelErr(logits.data() + s * V, ref.data() + (full.size() - 1) * V, V), 1e-4)
        << "decode, sequence " << s;
  }
}

TEST(ModelTest, Qwen3MoeMatchesFloat64Reference) { CheckAgainstReference(Qwen3Config()); }

TEST(ModelTest, Qwen2MoeWithYarnBiasSharedExpertAndDenseLayersMatchesReference) {
  CheckAgainstReference(Qwen2Config());
}

TEST(ModelTest, LinearRopeTiedEmbeddingsAndMoeEveryOtherLayerMatchReference) {
  ModelConfig c = Qwen3Config();
  c.rope_scaling.type = "linear";
  c.rope_scaling.factor = 2.0;
  c.tie_word_embeddings = true;
  c.decoder_sparse_step = 2;  // layer 1 MoE, layers 0 and 2 dense
  c.norm_topk_prob = false;
  CheckAgainstReference(c);
}

TEST(ModelTest, RejectsTokensOutsideTheVocabulary) {
  const ModelConfig c = Qwen3Config();
  Fixture f(c, false);
  std::vector<int32_t> table, tokens = {1, c.vocab_size};
  ASSERT_TRUE(f.kv->Allocate(1, &table));
  std::vector<float> logits;
  Model::Chunk chunk{tokens, 0, &table, Model::Logits::kLast};
  EXPECT_EQ(f.model->Forward({&chunk, 1}, f.kv.get(), &logits).code(),
            absl::StatusCode::kInvalidArgument);
}

// Deterministic mode: a sequence's logits are bit-identical whether it runs alone or in a batch
// with others, prefilled in one chunk or several.
TEST(ModelTest, DeterministicModeIsIndependentOfTheBatch) {
  const ModelConfig c = Qwen3Config();
  Fixture f(c, /*deterministic=*/true);
  const int V = c.vocab_size;
  const std::vector<int32_t> a = Tokens(9, V, 4), b = Tokens(14, V, 5), d = Tokens(6, V, 6);
  std::vector<int32_t> ta, tb, td;
  ASSERT_TRUE(f.kv->Allocate(4, &ta) && f.kv->Allocate(4, &tb) && f.kv->Allocate(4, &td));
  std::vector<float> solo, batched;
  Model::Chunk ca{a, 0, &ta, Model::Logits::kAll};
  ASSERT_TRUE(f.model->Forward({&ca, 1}, f.kv.get(), &solo).ok());
  // Same sequence in other blocks, in two chunks, beside others.
  std::vector<Model::Chunk> first = {
      {b, 0, &tb, Model::Logits::kAll},
      {absl::MakeConstSpan(a).subspan(0, 4), 0, &td, Model::Logits::kAll}};
  ASSERT_TRUE(f.model->Forward(first, f.kv.get(), &batched).ok());
  std::vector<int32_t> te;
  ASSERT_TRUE(f.kv->Allocate(2, &te));
  std::vector<Model::Chunk> second = {
      {d, 0, &te, Model::Logits::kAll},
      {absl::MakeConstSpan(a).subspan(4), 4, &td, Model::Logits::kAll}};
  ASSERT_TRUE(f.model->Forward(second, f.kv.get(), &batched).ok());
  // batched: b (14 rows), a[0:4], d (6 rows), a[4:9]
  std::vector<float> a_rows(batched.begin() + 14 * V, batched.begin() + 18 * V);
  a_rows.insert(a_rows.end(), batched.begin() + 24 * V, batched.end());
  ASSERT_EQ(a_rows.size(), solo.size());
  for (size_t i = 0; i < solo.size(); ++i) ASSERT_EQ(solo[i], a_rows[i]) << "index " << i;
}

}  // namespace
}  // namespace moe::engine
