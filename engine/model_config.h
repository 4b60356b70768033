// ModelConfig: the architecture of a Hugging Face MoE checkpoint, read from its config.json.
// Families: qwen3_moe (q/k RMSNorm, no shared expert), qwen2_moe (qkv bias, a shared expert
// with a sigmoid gate) and qwen3_5_moe (Qwen3.5 / Qwen3.6 MoE: Gated DeltaNet linear-attention
// layers between gated full-attention layers, see below). Both spellings transformers has used
// are accepted (4.x and 5.x: rope_scaling / rope_parameters, torch_dtype / dtype, eos_token_id as
// int or list, head_dim absent = hidden_size / num_attention_heads).
//
// qwen3_5_moe, as transformers' Qwen3_5MoeTextConfig reads it: model_type "qwen3_5_moe" (the
// multimodal wrapper, whose text_config is the language model served here; its vision tower is
// not) or "qwen3_5_moe_text". Layer kinds from layer_types ("linear_attention" /
// "full_attention") or, without it, every full_attention_interval-th layer (default 4) full
// attention. Every layer is MoE with a sigmoid-gated shared expert and a router that always
// renormalises its top-k (norm_topk_prob is true whatever the file says, as transformers
// ignores it). Full-attention layers: q_proj gives per head the query and an output gate, q/k
// RMSNorm, rotary over the first partial_rotary_factor (default 0.25) of head_dim. The rope
// parameters' multimodal sections (mrope_section, mrope_interleaved) rotate every section by the
// same position for text, so they reduce to plain positions and are not kept. RMSNorm weights
// are zero-centred (applied as 1 + w).
// Plain value type; thread-compatible.
#ifndef MOE_ENGINE_MODEL_CONFIG_H_
#define MOE_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::engine {

struct RopeScaling {
  std::string type;  // "" (none), "yarn", "linear", "dynamic"
  double factor = 1;
  int original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all_dim = 0;
  double attention_factor = 0;  // 0: unset
};

// The token mixer of a layer.
enum class LayerKind {
  kFullAttention,    // softmax attention over the paged KV cache
  kLinearAttention,  // Gated DeltaNet: a fixed-size recurrent state per sequence, no KV cache
};

// Sizes of the Gated DeltaNet layers (qwen3_5_moe's linear_* fields).
struct LinearAttentionConfig {
  int num_key_heads = 0;    // linear_num_key_heads (q and k heads)
  int num_value_heads = 0;  // linear_num_value_heads, a multiple of num_key_heads: key head j
                            // serves value heads [j * r, (j + 1) * r), r = value / key heads
  int key_head_dim = 0;     // linear_key_head_dim
  int value_head_dim = 0;   // linear_value_head_dim
  int conv_kernel = 0;      // linear_conv_kernel_dim: taps of the causal depthwise conv
  int key_dim() const { return num_key_heads * key_head_dim; }
  int value_dim() const { return num_value_heads * value_head_dim; }
  // Channels of in_proj_qkv and of the conv: [q (key_dim); k (key_dim); v (value_dim)].
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
};

struct ModelConfig {
  std::string model_type;  // "qwen3_moe" | "qwen2_moe" | "qwen3_5_moe"
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;                // dense MLP layers (mlp_only_layers, sparse-step gaps)
  int moe_intermediate_size = 0;            // one routed expert
  int shared_expert_intermediate_size = 0;  // 0: no shared expert
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int max_position_embeddings = 0;
  int num_experts = 0;
  int num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  bool attention_bias = false;  // q/k/v projections carry biases (qwen2_moe)
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3_moe)
  bool tie_word_embeddings = false;
  std::vector<int32_t> eos_token_ids;
  int bos_token_id = -1;
  std::string torch_dtype;  // as written in the file ("bfloat16", ...); informational

  // One entry per layer; empty means every layer is full attention (qwen3_moe, qwen2_moe).
  std::vector<LayerKind> layer_types;
  LinearAttentionConfig linear;  // set when any layer is linear attention
  // Rotary dimensions are the first rotary_dim() = int(head_dim * partial_rotary_factor) of each
  // head (from rope_parameters, else the config's own field; 0.25 by default for qwen3_5_moe).
  double partial_rotary_factor = 1.0;
  bool attn_output_gate = false;     // q_proj rows per head: [query (head_dim); gate (head_dim)],
                                     // attention output times sigmoid(gate) before o_proj
  bool zero_centered_norms = false;  // RMSNorm weights w are applied as (1 + w)
  bool multimodal = false;           // the text model of a multimodal wrapper (vision not served)

  // As transformers decides: not in mlp_only_layers, num_experts > 0 and
  // (layer + 1) % decoder_sparse_step == 0.
  bool IsMoeLayer(int layer) const;
  // Index of `layer` among the MoE layers (the ExpertStore's layer index); -1 for dense layers.
  int MoeLayerIndex(int layer) const;
  int NumMoeLayers() const;

  bool IsLinearAttentionLayer(int layer) const;
  int NumLinearAttentionLayers() const;
  // Index of `layer` among the linear-attention layers (its recurrent state's index); -1 for
  // full-attention layers.
  int LinearLayerIndex(int layer) const;
  // Index of `layer` among the full-attention layers (its KV cache layer); -1 for
  // linear-attention layers. Equals `layer` when every layer is full attention.
  int KvLayerIndex(int layer) const;
  int NumKvLayers() const;
  int rotary_dim() const;

  // The model types this parser accepts.
  static const std::vector<std::string>& SupportedModelTypes();

  // Parses config.json text. `origin` names the source in error messages (a path). Errors:
  // InvalidArgument for bad JSON, a missing or ill-typed field, inconsistent sizes, or an
  // unknown model_type (the message lists the supported ones).
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json, std::string_view origin);
  // Reads and parses a file; NotFound if it cannot be opened.
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
};

// The text model of Qwen3.6-35B-A3B (qwen3_5_moe) for benchmarks and random models: hidden 2048,
// vocab 248320; every 4th layer gated full attention (16 query / 2 KV heads, head_dim 256,
// q/k RMSNorm, rotary over a quarter of each head, rope theta 1e7), the others Gated DeltaNet
// (16 key heads / 32 value heads of 128, conv kernel 4); every layer MoE, 256 experts top-8 of
// moe_intermediate 512 with a sigmoid-gated shared expert of 512; zero-centred norms. As
// FromJson reads the published config.json's text_config (model_config_test compares them),
// less its multimodal wrapper and token ids. `num_layers` (40 in the model) keeps the
// every-4th-layer rule, for benchmarks on fewer layers.
ModelConfig Qwen36_35B_A3B(int num_layers = 40);

}  // namespace moe::engine

#endif  // MOE_ENGINE_MODEL_CONFIG_H_
