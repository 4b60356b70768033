// ModelConfig: the architecture of a Hugging Face MoE checkpoint, read from its config.json.
// Families: qwen3_moe (q/k RMSNorm, no shared expert) and qwen2_moe (qkv bias, a shared expert
// with a sigmoid gate). Both spellings transformers has used are accepted (4.x and 5.x:
// rope_scaling / rope_parameters, torch_dtype / dtype, eos_token_id as int or list, head_dim
// absent = hidden_size / num_attention_heads).
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

struct ModelConfig {
  std::string model_type;  // "qwen3_moe" | "qwen2_moe"
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

  // As transformers decides: not in mlp_only_layers, num_experts > 0 and
  // (layer + 1) % decoder_sparse_step == 0.
  bool IsMoeLayer(int layer) const;
  // Index of `layer` among the MoE layers (the ExpertStore's layer index); -1 for dense layers.
  int MoeLayerIndex(int layer) const;
  int NumMoeLayers() const;

  // The model types this parser accepts.
  static const std::vector<std::string>& SupportedModelTypes();

  // Parses config.json text. `origin` names the source in error messages (a path). Errors:
  // InvalidArgument for bad JSON, a missing or ill-typed field, inconsistent sizes, or an
  // unknown model_type (the message lists the supported ones).
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json, std::string_view origin);
  // Reads and parses a file; NotFound if it cannot be opened.
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_MODEL_CONFIG_H_
