#include "engine/model_config.h"

#include <string>

#include "gtest/gtest.h"

namespace moe::engine {
namespace {

// Qwen/Qwen3-30B-A3B's config.json as published (transformers 4 spelling).
constexpr char kQwen3_30B[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

// Qwen/Qwen1.5-MoE-A2.7B's config.json as published (no head_dim: hidden / heads).
constexpr char kQwen15Moe[] = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
  "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24,
  "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.39.0.dev0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
  "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
  "norm_topk_prob": false, "output_router_logits": false, "router_aux_loss_coef": 0.001})";

TEST(ModelConfigTest, Qwen3MoeTransformers4) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(kQwen3_30B, "q3.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3_moe");
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->intermediate_size, 6144);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->shared_expert_intermediate_size, 0);
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, "");
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  EXPECT_FALSE(c->attention_bias);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{151645});
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->NumMoeLayers(), 48);
  EXPECT_EQ(c->MoeLayerIndex(47), 47);
}

TEST(ModelConfigTest, Qwen2MoeTransformers4) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(kQwen15Moe, "q15.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2_moe");
  EXPECT_EQ(c->head_dim, 128);  // 2048 / 16
  EXPECT_EQ(c->num_key_value_heads, 16);
  EXPECT_EQ(c->shared_expert_intermediate_size, 5632);
  EXPECT_EQ(c->moe_intermediate_size, 1408);
  EXPECT_EQ(c->num_experts, 60);
  EXPECT_EQ(c->num_experts_per_tok, 4);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_TRUE(c->attention_bias);  // qwen2_moe's q/k/v projections always carry biases in 4.x
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{151643});
  EXPECT_EQ(c->max_position_embeddings, 8192);
}

TEST(ModelConfigTest, Transformers5Spelling) {
  // rope_parameters carries rope_theta; dtype instead of torch_dtype; eos as a list; no head_dim.
  constexpr char kV5[] = R"({
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "num_experts": 16, "num_experts_per_tok": 4,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                        "original_max_position_embeddings": 32768, "beta_fast": 16},
    "dtype": "bfloat16", "eos_token_id": [7, 9], "max_position_embeddings": 131072})";
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(kV5, "v5.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_fast, 16);
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_slow, 1);  // default
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{7, 9}));
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_FALSE(c->norm_topk_prob);  // transformers' default

  // transformers 5's qwen2_moe: qkv_bias can turn the biases off; rope_scaling "type" spelling.
  constexpr char kQ2[] = R"({
    "model_type": "qwen2_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 0, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "qkv_bias": false,
    "rope_scaling": {"type": "linear", "factor": 2.0}})";
  c = ModelConfig::FromJson(kQ2, "q2.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->shared_expert_intermediate_size, 0);
  EXPECT_EQ(c->rope_scaling.type, "linear");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
}

TEST(ModelConfigTest, MoeLayersFollowTransformersRule) {
  // transformers: MoE iff layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0.
  constexpr char kJson[] = R"({
    "model_type": "qwen2_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 2, "mlp_only_layers": [3]})";
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(kJson, "x");
  ASSERT_TRUE(c.ok()) << c.status();
  const bool expect_moe[8] = {false, true, false, false, false, true, false, true};
  const int expect_index[8] = {-1, 0, -1, -1, -1, 1, -1, 2};
  for (int l = 0; l < 8; ++l) {
    EXPECT_EQ(c->IsMoeLayer(l), expect_moe[l]) << l;
    EXPECT_EQ(c->MoeLayerIndex(l), expect_index[l]) << l;
  }
  EXPECT_EQ(c->NumMoeLayers(), 3);
}

TEST(ModelConfigTest, UnknownModelTypeListsSupported) {
  absl::StatusOr<ModelConfig> c =
      ModelConfig::FromJson(R"({"model_type": "llama", "hidden_size": 8})", "dir/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"llama\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("qwen2_moe, qwen3_moe"), std::string::npos) << msg;
}

TEST(ModelConfigTest, BadJsonAndBadFields) {
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {"{\"model_type\": \"qwen3_moe\",", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"model_type": "qwen3_moe", "hidden_size": "big"})",
       "\"hidden_size\" must be an integer"},
      {R"({"model_type": "qwen3_moe", "hidden_size": -4})", "\"hidden_size\" is -4"},
      {R"({"model_type": "qwen3_moe", "num_key_value_heads": 5})", "must divide"},
      {R"({"model_type": "qwen3_moe", "mlp_only_layers": [99]})", "mlp_only_layers"},
      {R"({"model_type": "qwen3_moe", "rope_scaling": {"type": "ntk"}})", "\"ntk\""},
      {R"({"model_type": "qwen3_moe", "eos_token_id": "x"})", "eos_token_id"},
      {R"({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8})",
       "exceeds num_experts"},
      {R"({"model_type": "qwen3_moe", "hidden_act": "gelu"})", "\"gelu\""},
  };
  for (const Case& k : cases) {
    absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(k.json, "cfg.json");
    ASSERT_FALSE(c.ok()) << k.json;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << k.json;
    const std::string msg(c.status().message());
    EXPECT_NE(msg.find(k.needle), std::string::npos) << k.json << " -> " << msg;
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  }
}

TEST(ModelConfigTest, FromFileMissing) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromFile("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(c.status().message()).find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace moe::engine
