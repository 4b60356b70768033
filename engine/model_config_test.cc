#include "engine/model_config.h"

#include <string>

#include "absl/strings/str_cat.h"
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

// A Qwen3.6-35B-A3B-shaped config in the multimodal wrapper's layout (transformers 5 spelling:
// text_config with rope_parameters and its multimodal sections, a vision_config, explicit
// layer_types; the sizes are Qwen3_5MoeTextConfig's defaults, which describe that model).
// extra_text (", \"key\": value") is appended to text_config, overriding a field given before.
std::string Qwen35Wrapper(const std::string& extra_text = "") {
  std::string layer_types;
  for (int l = 0; l < 40; ++l) {
    absl::StrAppend(&layer_types, l ? ", " : "",
                    (l + 1) % 4 ? "\"linear_attention\"" : "\"full_attention\"");
  }
  return absl::StrCat(R"({
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": false,
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152},
    "text_config": {
      "model_type": "qwen3_5_moe_text", "attention_bias": false, "attn_output_gate": true,
      "bos_token_id": 248044, "eos_token_id": 248044, "dtype": "bfloat16",
      "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
      "layer_types": [)",
                      layer_types, R"(],
      "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
      "linear_num_value_heads": 32, "linear_value_head_dim": 128,
      "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
      "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "num_attention_heads": 16,
      "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "shared_expert_intermediate_size": 512,
      "vocab_size": 248320,
      "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                          "rope_type": "default", "rope_theta": 10000000,
                          "partial_rotary_factor": 0.25})",
                      extra_text, "}}");
}

TEST(ModelConfigTest, Qwen35MoeWrapper) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(Qwen35Wrapper(), "q36.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3_5_moe");
  EXPECT_TRUE(c->multimodal);
  EXPECT_EQ(c->vocab_size, 248320);
  EXPECT_EQ(c->num_hidden_layers, 40);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->num_attention_heads, 16);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->max_position_embeddings, 262144);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e7);
  EXPECT_EQ(c->rope_scaling.type, "");  // the multimodal sections reduce to plain positions
  EXPECT_DOUBLE_EQ(c->partial_rotary_factor, 0.25);
  EXPECT_EQ(c->rotary_dim(), 64);
  EXPECT_TRUE(c->attn_output_gate);
  EXPECT_TRUE(c->zero_centered_norms);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 512);
  EXPECT_EQ(c->shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c->norm_topk_prob);  // the router always renormalises
  EXPECT_EQ(c->NumMoeLayers(), 40);
  EXPECT_EQ(c->linear.num_key_heads, 16);
  EXPECT_EQ(c->linear.num_value_heads, 32);
  EXPECT_EQ(c->linear.key_head_dim, 128);
  EXPECT_EQ(c->linear.value_head_dim, 128);
  EXPECT_EQ(c->linear.conv_kernel, 4);
  EXPECT_EQ(c->linear.conv_dim(), 8192);
  EXPECT_EQ(c->NumLinearAttentionLayers(), 30);
  EXPECT_EQ(c->NumKvLayers(), 10);
  EXPECT_TRUE(c->IsLinearAttentionLayer(0));
  EXPECT_FALSE(c->IsLinearAttentionLayer(3));
  EXPECT_EQ(c->KvLayerIndex(3), 0);
  EXPECT_EQ(c->KvLayerIndex(39), 9);
  EXPECT_EQ(c->KvLayerIndex(38), -1);
  EXPECT_EQ(c->LinearLayerIndex(38), 29);
  EXPECT_EQ(c->LinearLayerIndex(39), -1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{248044});
}

// The in-code Qwen3.6-35B-A3B config is what the published config.json parses to, field by
// field (less the wrapper's multimodal flag and the token ids, which it leaves unset).
TEST(ModelConfigTest, Qwen36HelperMatchesThePublishedConfig) {
  absl::StatusOr<ModelConfig> parsed = ModelConfig::FromJson(Qwen35Wrapper(), "q36.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ModelConfig& p = *parsed;
  const ModelConfig c = Qwen36_35B_A3B();
  EXPECT_EQ(c.model_type, p.model_type);
  EXPECT_EQ(c.vocab_size, p.vocab_size);
  EXPECT_EQ(c.hidden_size, p.hidden_size);
  EXPECT_EQ(c.intermediate_size, p.intermediate_size);
  EXPECT_EQ(c.moe_intermediate_size, p.moe_intermediate_size);
  EXPECT_EQ(c.shared_expert_intermediate_size, p.shared_expert_intermediate_size);
  EXPECT_EQ(c.num_hidden_layers, p.num_hidden_layers);
  EXPECT_EQ(c.num_attention_heads, p.num_attention_heads);
  EXPECT_EQ(c.num_key_value_heads, p.num_key_value_heads);
  EXPECT_EQ(c.head_dim, p.head_dim);
  EXPECT_EQ(c.rms_norm_eps, p.rms_norm_eps);
  EXPECT_EQ(c.rope_theta, p.rope_theta);
  EXPECT_EQ(c.rope_scaling.type, p.rope_scaling.type);
  EXPECT_EQ(c.max_position_embeddings, p.max_position_embeddings);
  EXPECT_EQ(c.num_experts, p.num_experts);
  EXPECT_EQ(c.num_experts_per_tok, p.num_experts_per_tok);
  EXPECT_EQ(c.norm_topk_prob, p.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, p.decoder_sparse_step);
  EXPECT_EQ(c.mlp_only_layers, p.mlp_only_layers);
  EXPECT_EQ(c.attention_bias, p.attention_bias);
  EXPECT_EQ(c.qk_norm, p.qk_norm);
  EXPECT_EQ(c.tie_word_embeddings, p.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, p.torch_dtype);
  EXPECT_EQ(c.layer_types, p.layer_types);
  EXPECT_EQ(c.linear.num_key_heads, p.linear.num_key_heads);
  EXPECT_EQ(c.linear.num_value_heads, p.linear.num_value_heads);
  EXPECT_EQ(c.linear.key_head_dim, p.linear.key_head_dim);
  EXPECT_EQ(c.linear.value_head_dim, p.linear.value_head_dim);
  EXPECT_EQ(c.linear.conv_kernel, p.linear.conv_kernel);
  EXPECT_EQ(c.partial_rotary_factor, p.partial_rotary_factor);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.attn_output_gate, p.attn_output_gate);
  EXPECT_EQ(c.zero_centered_norms, p.zero_centered_norms);
  EXPECT_FALSE(c.multimodal);
  EXPECT_TRUE(c.eos_token_ids.empty());
  // FACTS.md's shape: 3 of 4 layers Gated DeltaNet, 256 x top-8, every layer MoE.
  EXPECT_EQ(c.NumLinearAttentionLayers(), 30);
  EXPECT_EQ(c.NumKvLayers(), 10);
  EXPECT_EQ(c.NumMoeLayers(), 40);
  // Fewer layers keep the rule.
  const ModelConfig four = Qwen36_35B_A3B(4);
  EXPECT_EQ(four.num_hidden_layers, 4);
  EXPECT_EQ(four.NumKvLayers(), 1);
  EXPECT_TRUE(four.IsLinearAttentionLayer(2));
  EXPECT_FALSE(four.IsLinearAttentionLayer(3));
}

TEST(ModelConfigTest, Qwen35MoeTextConfigDefaultsAndIntervalRule) {
  // The text model alone, no layer_types: transformers' rule, full attention where
  // (layer + 1) % full_attention_interval == 0; partial_rotary_factor 0.25 by default;
  // norm_topk_prob false in the file is still a renormalising router.
  constexpr char kText[] = R"({
    "model_type": "qwen3_5_moe_text", "num_hidden_layers": 6, "full_attention_interval": 3,
    "hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 32,
    "norm_topk_prob": false, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3})";
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(kText, "t.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3_5_moe");
  EXPECT_FALSE(c->multimodal);
  const bool linear[6] = {true, true, false, true, true, false};
  for (int l = 0; l < 6; ++l) EXPECT_EQ(c->IsLinearAttentionLayer(l), linear[l]) << l;
  EXPECT_EQ(c->rotary_dim(), 8);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->linear.conv_dim(), 2 * 32 + 48);
  EXPECT_EQ(c->shared_expert_intermediate_size, 512);  // the class default
  EXPECT_EQ(c->NumMoeLayers(), 6);

  // The default interval is 4; a top-level partial_rotary_factor applies without one in the
  // rope parameters, and the rope parameters' wins over it.
  constexpr char kDefaults[] = R"({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 8,
    "partial_rotary_factor": 0.5})";
  c = ModelConfig::FromJson(kDefaults, "d.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->NumKvLayers(), 2);
  EXPECT_EQ(c->KvLayerIndex(7), 1);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->rotary_dim(), 128);
  EXPECT_EQ(c->linear.conv_dim(), 2 * 16 * 128 + 32 * 128);
  constexpr char kBoth[] = R"({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
    "partial_rotary_factor": 0.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000, "partial_rotary_factor": 0.25}})";
  c = ModelConfig::FromJson(kBoth, "b.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rotary_dim(), 64);
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000);

  // Other families keep every dimension rotary and take no linear-attention layers.
  absl::StatusOr<ModelConfig> q3 = ModelConfig::FromJson(kQwen3_30B, "q3.json");
  ASSERT_TRUE(q3.ok());
  EXPECT_EQ(q3->rotary_dim(), q3->head_dim);
  EXPECT_EQ(q3->NumKvLayers(), 48);
  EXPECT_EQ(q3->KvLayerIndex(47), 47);
  EXPECT_EQ(q3->NumLinearAttentionLayers(), 0);
  EXPECT_FALSE(q3->zero_centered_norms);
  EXPECT_FALSE(q3->attn_output_gate);
}

TEST(ModelConfigTest, Qwen35MoeInconsistentConfigs) {
  const std::string base = R"("model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, )";
  struct Case {
    std::string json;
    const char* needle;
  } cases[] = {
      {absl::StrCat("{", base, R"("linear_num_key_heads": 4, "linear_num_value_heads": 6})"),
       "must be a multiple of linear_num_key_heads"},
      {absl::StrCat("{", base, R"("layer_types": ["linear_attention", "full_attention"]})"),
       "list of 4 layer kinds"},
      {absl::StrCat("{", base,
                    R"("layer_types": ["linear_attention", "sliding_attention",
                                       "linear_attention", "full_attention"]})"),
       "entry 1 is \"sliding_attention\""},
      {absl::StrCat("{", base, R"("head_dim": 16, "partial_rotary_factor": 0.1})"),
       "gives 1 rotary dimensions"},
      {absl::StrCat("{", base, R"("partial_rotary_factor": 1.5})"), "partial_rotary_factor"},
      {absl::StrCat("{", base, R"("shared_expert_intermediate_size": 0})"),
       "shared_expert_intermediate_size"},
      {absl::StrCat("{", base, R"("num_experts": 0})"), "at least 1 for qwen3_5_moe"},
      {absl::StrCat("{", base, R"("attention_bias": true})"), "not supported for qwen3_5_moe"},
      {absl::StrCat("{", base, R"("full_attention_interval": 0})"), "full_attention_interval"},
      {absl::StrCat("{", base, R"("linear_conv_kernel_dim": 0})"), "linear_conv_kernel_dim"},
      {R"({"model_type": "qwen3_moe", "layer_types": ["linear_attention"]})",
       "full-attention layers only"},
  };
  for (const Case& k : cases) {
    absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(k.json, "cfg.json");
    ASSERT_FALSE(c.ok()) << k.json;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << k.json;
    const std::string msg(c.status().message());
    EXPECT_NE(msg.find(k.needle), std::string::npos) << k.json << " -> " << msg;
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  }
  // The wrapper's and the text model's tie_word_embeddings must agree where both are given;
  // errors inside text_config say so.
  absl::StatusOr<ModelConfig> c =
      ModelConfig::FromJson(Qwen35Wrapper(R"(, "tie_word_embeddings": true)"), "w.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(std::string(c.status().message())
                .find("w.json: text_config: field "
                      "\"tie_word_embeddings\" is true"),
            std::string::npos)
      << c.status();
  c = ModelConfig::FromJson(Qwen35Wrapper(R"(, "linear_num_value_heads": 17)"), "w.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(std::string(c.status().message()).find("text_config"), std::string::npos) << c.status();
}

TEST(ModelConfigTest, FromFileMissing) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromFile("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(c.status().message()).find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace moe::engine
