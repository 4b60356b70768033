#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

using Json = nlohmann::json;

// Field readers over a parsed config object. Each returns InvalidArgument naming the origin and
// the field when the value has the wrong type or range; an absent (or null) field keeps the
// default the caller put in `out` (transformers' class defaults).
class Fields {
 public:
  Fields(const Json& obj, std::string_view origin) : obj_(obj), origin_(origin) {}

  bool Has(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }
  const Json* Get(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }

  absl::Status Error(const char* key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": field \"", key, "\" ", what));
  }

  // An integer in [lo, hi]. Accepts JSON integers and floats with an integral value (some
  // exporters write 2048.0).
  absl::Status Int(const char* key, int* out, int64_t lo, int64_t hi, bool required = false) const {
    const Json* v = Get(key);
    if (v == nullptr) return required ? Error(key, "is missing") : absl::OkStatus();
    int64_t i = 0;
    if (v->is_number_integer()) {
      i = v->is_number_unsigned()
              ? static_cast<int64_t>(std::min<uint64_t>(v->get<uint64_t>(), uint64_t{1} << 62))
              : v->get<int64_t>();
    } else if (v->is_number_float()) {
      const double d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 1e15) {
        return Error(key, "must be an integer");
      }
      i = static_cast<int64_t>(d);
    } else {
      return Error(key, absl::StrCat("must be an integer, got ", v->type_name()));
    }
    if (i < lo || i > hi) {
      return Error(key, absl::StrCat("is ", i, ", outside [", lo, ", ", hi, "]"));
    }
    *out = static_cast<int>(i);
    return absl::OkStatus();
  }

  absl::Status Double(const char* key, double* out, double lo, double hi) const {
    const Json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_number()) return Error(key, absl::StrCat("must be a number, got ", v->type_name()));
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < lo || d > hi) {
      return Error(key, absl::StrCat("is ", d, ", outside [", lo, ", ", hi, "]"));
    }
    *out = d;
    return absl::OkStatus();
  }

  absl::Status Bool(const char* key, bool* out) const {
    const Json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean())
      return Error(key, absl::StrCat("must be a boolean, got ", v->type_name()));
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  absl::Status String(const char* key, std::string* out) const {
    const Json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_string()) return Error(key, absl::StrCat("must be a string, got ", v->type_name()));
    *out = v->get<std::string>();
    return absl::OkStatus();
  }

  // An int or a list of ints (eos_token_id).
  absl::Status IntList(const char* key, std::vector<int32_t>* out, int64_t lo, int64_t hi) const {
    const Json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    std::vector<Json> items;
    if (v->is_array()) {
      items.assign(v->begin(), v->end());
    } else {
      items.push_back(*v);
    }
    out->clear();
    for (const Json& item : items) {
      if (!item.is_number_integer()) {
        return Error(key, "must be an integer or a list of integers");
      }
      const int64_t i =
          item.is_number_unsigned()
              ? static_cast<int64_t>(std::min<uint64_t>(item.get<uint64_t>(), uint64_t{1} << 62))
              : item.get<int64_t>();
      if (i < lo || i > hi) {
        return Error(key, absl::StrCat("has ", i, ", outside [", lo, ", ", hi, "]"));
      }
      out->push_back(static_cast<int32_t>(i));
    }
    return absl::OkStatus();
  }

 private:
  const Json& obj_;
  std::string origin_;
};

constexpr int64_t kMaxDim = int64_t{1} << 20;  // any hidden or intermediate size
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 65536;
constexpr int64_t kMaxPositions = int64_t{1} << 30;

// rope_scaling (transformers 4) or rope_parameters (5; it also carries rope_theta). "type" and
// "rope_type" are both spellings of the kind; "default" means none.
absl::Status ParseRope(const Json& rope, const std::string& origin, const char* key,
                       ModelConfig* c) {
  if (!rope.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": field \"", key, "\" must be an object, got ", rope.type_name()));
  }
  const std::string sub_origin = absl::StrCat(origin, ": ", key);
  Fields f(rope, sub_origin);
  RopeScaling& r = c->rope_scaling;
  std::string type;
  RETURN_IF_ERROR(f.String("type", &type));
  RETURN_IF_ERROR(f.String("rope_type", &type));
  // "mrope" (multimodal sections) is the default rotation for text positions.
  if (type == "default" || type == "mrope") type.clear();
  if (!type.empty() && type != "yarn" && type != "linear" && type != "dynamic") {
    return absl::InvalidArgumentError(
        absl::StrCat(sub_origin, ": rope type \"", type,
                     "\" is not supported (supported: default, linear, dynamic, yarn)"));
  }
  r.type = type;
  RETURN_IF_ERROR(f.Double("rope_theta", &c->rope_theta, 1e-3, 1e12));
  RETURN_IF_ERROR(f.Double("factor", &r.factor, 1e-6, 1e6));
  RETURN_IF_ERROR(f.Int("original_max_position_embeddings", &r.original_max_position_embeddings, 0,
                        kMaxPositions));
  RETURN_IF_ERROR(f.Double("beta_fast", &r.beta_fast, -1e6, 1e6));
  RETURN_IF_ERROR(f.Double("beta_slow", &r.beta_slow, -1e6, 1e6));
  RETURN_IF_ERROR(f.Double("mscale", &r.mscale, -1e6, 1e6));
  RETURN_IF_ERROR(f.Double("mscale_all_dim", &r.mscale_all_dim, -1e6, 1e6));
  RETURN_IF_ERROR(f.Double("attention_factor", &r.attention_factor, 0, 1e6));
  RETURN_IF_ERROR(f.Double("partial_rotary_factor", &c->partial_rotary_factor, 0, 1));
  return absl::OkStatus();
}

// layer_types, or transformers' full_attention_interval rule without it (qwen3_5_moe).
absl::Status ParseLayerTypes(const Fields& f, ModelConfig* c) {
  c->layer_types.assign(c->num_hidden_layers, LayerKind::kFullAttention);
  if (const Json* v = f.Get("layer_types")) {
    if (!v->is_array() || static_cast<int>(v->size()) != c->num_hidden_layers) {
      return f.Error("layer_types", absl::StrCat("must be a list of ", c->num_hidden_layers,
                                                 " layer kinds (one per layer)"));
    }
    for (int l = 0; l < c->num_hidden_layers; ++l) {
      const Json& item = (*v)[l];
      const std::string kind = item.is_string() ? item.get<std::string>() : "";
      if (kind == "linear_attention") {
        c->layer_types[l] = LayerKind::kLinearAttention;
      } else if (kind != "full_attention") {
        return f.Error("layer_types",
                       absl::StrCat("entry ", l, " is ", item.dump(),
                                    ", not \"linear_attention\" or \"full_attention\""));
      }
    }
    return absl::OkStatus();
  }
  int interval = 4;
  RETURN_IF_ERROR(f.Int("full_attention_interval", &interval, 1, kMaxLayers));
  for (int l = 0; l < c->num_hidden_layers; ++l) {
    if ((l + 1) % interval != 0) c->layer_types[l] = LayerKind::kLinearAttention;
  }
  return absl::OkStatus();
}

// The Gated DeltaNet sizes (transformers' defaults, then the file's).
absl::Status ParseLinearAttention(const Fields& f, ModelConfig* c) {
  LinearAttentionConfig& la = c->linear;
  la = {16, 32, 128, 128, 4};
  RETURN_IF_ERROR(f.Int("linear_num_key_heads", &la.num_key_heads, 1, 65536));
  RETURN_IF_ERROR(f.Int("linear_num_value_heads", &la.num_value_heads, 1, 65536));
  RETURN_IF_ERROR(f.Int("linear_key_head_dim", &la.key_head_dim, 1, 65536));
  RETURN_IF_ERROR(f.Int("linear_value_head_dim", &la.value_head_dim, 1, 65536));
  RETURN_IF_ERROR(f.Int("linear_conv_kernel_dim", &la.conv_kernel, 1, 1024));
  if (la.num_value_heads % la.num_key_heads != 0) {
    return f.Error(
        "linear_num_value_heads",
        absl::StrCat("(", la.num_value_heads, ") must be a multiple of ", "linear_num_key_heads (",
                     la.num_key_heads, "): each key head serves a whole group of value heads"));
  }
  if (static_cast<int64_t>(la.conv_dim()) > kMaxDim) {
    return f.Error("linear_num_key_heads",
                   absl::StrCat("gives a conv width of ", la.conv_dim(), ", above ", kMaxDim));
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& ModelConfig::SupportedModelTypes() {
  static const auto* kTypes = new std::vector<std::string>{"qwen2_moe", "qwen3_moe", "qwen3_5_moe"};
  return *kTypes;
}

bool ModelConfig::IsLinearAttentionLayer(int layer) const {
  return layer >= 0 && layer < static_cast<int>(layer_types.size()) &&
         layer_types[layer] == LayerKind::kLinearAttention;
}

int ModelConfig::NumLinearAttentionLayers() const {
  int n = 0;
  for (int l = 0; l < num_hidden_layers; ++l) n += IsLinearAttentionLayer(l) ? 1 : 0;
  return n;
}

int ModelConfig::LinearLayerIndex(int layer) const {
  if (!IsLinearAttentionLayer(layer)) return -1;
  int index = 0;
  for (int l = 0; l < layer; ++l) index += IsLinearAttentionLayer(l) ? 1 : 0;
  return index;
}

int ModelConfig::KvLayerIndex(int layer) const {
  if (layer < 0 || layer >= num_hidden_layers || IsLinearAttentionLayer(layer)) return -1;
  int index = 0;
  for (int l = 0; l < layer; ++l) index += IsLinearAttentionLayer(l) ? 0 : 1;
  return index;
}

int ModelConfig::NumKvLayers() const { return num_hidden_layers - NumLinearAttentionLayers(); }

int ModelConfig::rotary_dim() const {
  // transformers: int(head_dim * partial_rotary_factor).
  return static_cast<int>(head_dim * partial_rotary_factor);
}

bool ModelConfig::IsMoeLayer(int layer) const {
  if (layer < 0 || layer >= num_hidden_layers) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return num_experts > 0 && decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

int ModelConfig::MoeLayerIndex(int layer) const {
  if (!IsMoeLayer(layer)) return -1;
  int index = 0;
  for (int l = 0; l < layer; ++l) index += IsMoeLayer(l) ? 1 : 0;
  return index;
}

int ModelConfig::NumMoeLayers() const {
  int n = 0;
  for (int l = 0; l < num_hidden_layers; ++l) n += IsMoeLayer(l) ? 1 : 0;
  return n;
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(std::string_view json,
                                                  std::string_view origin_view) {
  // Debian's Abseil keeps its own string_view, so messages are built from a std::string.
  const std::string origin_path(origin_view);
  Json root = Json::parse(json.begin(), json.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(origin_path, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(origin_path, ": config must be a JSON object"));
  }
  // Multimodal wrappers keep the language model's config under text_config; the wrapper's own
  // tie_word_embeddings applies where the text config has none.
  std::string origin = origin_path;
  bool multimodal = false;
  const Json* wrapper_tie = nullptr;
  Json wrapper;
  if (root.contains("text_config") && root["text_config"].is_object() &&
      !root.contains("num_hidden_layers")) {
    wrapper = std::move(root);
    Json text = wrapper["text_config"];
    if (!text.contains("model_type") && wrapper.contains("model_type")) {
      text["model_type"] = wrapper["model_type"];
    }
    auto tie = wrapper.find("tie_word_embeddings");
    if (tie != wrapper.end() && !tie->is_null()) wrapper_tie = &*tie;
    multimodal = wrapper.contains("vision_config");
    root = std::move(text);
    origin = absl::StrCat(origin_path, ": text_config");
  }
  Fields f(root, origin);
  ModelConfig c;
  RETURN_IF_ERROR(f.String("model_type", &c.model_type));
  // The text model's own spelling.
  if (c.model_type == "qwen3_5_moe_text") c.model_type = "qwen3_5_moe";
  const auto& types = SupportedModelTypes();
  if (std::find(types.begin(), types.end(), c.model_type) == types.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": model_type \"", c.model_type,
                     "\" is not supported (supported: ", absl::StrJoin(types, ", "), ")"));
  }
  c.multimodal = multimodal;
  const bool qwen35 = c.model_type == "qwen3_5_moe";
  const bool qwen3 = c.model_type == "qwen3_moe";

  // transformers' class defaults, then the file's values.
  c.vocab_size = qwen35 ? 248320 : 151936;
  c.hidden_size = 2048;
  c.intermediate_size = qwen3 ? 6144 : 5632;
  c.num_hidden_layers = qwen35 ? 40 : 24;
  c.num_attention_heads = qwen3 ? 32 : 16;
  c.num_key_value_heads = qwen3 ? 4 : qwen35 ? 2 : 16;
  c.max_position_embeddings = 32768;
  c.moe_intermediate_size = qwen3 ? 768 : qwen35 ? 512 : 1408;
  c.shared_expert_intermediate_size = qwen3 ? 0 : qwen35 ? 512 : 5632;
  c.num_experts_per_tok = qwen3 || qwen35 ? 8 : 4;
  c.num_experts = qwen3 ? 128 : qwen35 ? 256 : 60;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6f;
  c.partial_rotary_factor = qwen35 ? 0.25 : 1.0;

  RETURN_IF_ERROR(f.Int("vocab_size", &c.vocab_size, 1, kMaxVocab));
  RETURN_IF_ERROR(f.Int("hidden_size", &c.hidden_size, 1, kMaxDim));
  RETURN_IF_ERROR(f.Int("intermediate_size", &c.intermediate_size, 0, kMaxDim));
  RETURN_IF_ERROR(f.Int("moe_intermediate_size", &c.moe_intermediate_size, 1, kMaxDim));
  if (qwen35) {
    // Every layer's MoE block has the gated shared expert.
    RETURN_IF_ERROR(
        f.Int("shared_expert_intermediate_size", &c.shared_expert_intermediate_size, 1, kMaxDim));
  } else if (!qwen3) {
    RETURN_IF_ERROR(
        f.Int("shared_expert_intermediate_size", &c.shared_expert_intermediate_size, 0, kMaxDim));
  } else if (f.Has("shared_expert_intermediate_size")) {
    int shared = 0;
    RETURN_IF_ERROR(f.Int("shared_expert_intermediate_size", &shared, 0, kMaxDim));
    if (shared != 0) {
      return f.Error("shared_expert_intermediate_size",
                     "must be 0 for qwen3_moe (no shared expert)");
    }
  }
  RETURN_IF_ERROR(f.Int("num_hidden_layers", &c.num_hidden_layers, 1, kMaxLayers));
  RETURN_IF_ERROR(f.Int("num_attention_heads", &c.num_attention_heads, 1, 65536));
  RETURN_IF_ERROR(f.Int("num_key_value_heads", &c.num_key_value_heads, 1, 65536));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return f.Error("num_key_value_heads",
                   absl::StrCat("(", c.num_key_value_heads, ") must divide num_attention_heads (",
                                c.num_attention_heads, ")"));
  }
  c.head_dim = qwen35 ? 256 : 0;  // Qwen3_5MoeTextConfig's default
  RETURN_IF_ERROR(f.Int("head_dim", &c.head_dim, 1, 65536));
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return f.Error(
          "hidden_size",
          absl::StrCat("(", c.hidden_size, ") is not a multiple of num_attention_heads (",
                       c.num_attention_heads, ") and head_dim is absent"));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) return f.Error("head_dim", "must be even (rotary pairs)");

  double eps = c.rms_norm_eps;
  RETURN_IF_ERROR(f.Double("rms_norm_eps", &eps, 0, 1));
  c.rms_norm_eps = static_cast<float>(eps);
  RETURN_IF_ERROR(f.Double("rope_theta", &c.rope_theta, 1e-3, 1e12));
  // The config's own partial_rotary_factor; one in the rope parameters takes precedence.
  RETURN_IF_ERROR(f.Double("partial_rotary_factor", &c.partial_rotary_factor, 0, 1));
  if (const Json* rope = f.Get("rope_scaling")) {
    RETURN_IF_ERROR(ParseRope(*rope, origin, "rope_scaling", &c));
  }
  if (const Json* rope = f.Get("rope_parameters")) {
    RETURN_IF_ERROR(ParseRope(*rope, origin, "rope_parameters", &c));
  }
  RETURN_IF_ERROR(f.Int("max_position_embeddings", &c.max_position_embeddings, 1, kMaxPositions));
  if (c.rotary_dim() < 2 || c.rotary_dim() % 2 != 0) {
    return f.Error(
        "partial_rotary_factor",
        absl::StrCat("(", c.partial_rotary_factor, ") of head_dim ", c.head_dim, " gives ",
                     c.rotary_dim(), " rotary dimensions; they must be even and at least 2"));
  }

  // transformers 5 maps num_local_experts onto num_experts.
  RETURN_IF_ERROR(f.Int("num_local_experts", &c.num_experts, 0, kMaxExperts));
  RETURN_IF_ERROR(f.Int("num_experts", &c.num_experts, 0, kMaxExperts));
  RETURN_IF_ERROR(f.Int("num_experts_per_tok", &c.num_experts_per_tok, 1, kMaxExperts));
  if (c.num_experts > 0 && c.num_experts_per_tok > c.num_experts) {
    return f.Error(
        "num_experts_per_tok",
        absl::StrCat("(", c.num_experts_per_tok, ") exceeds num_experts (", c.num_experts, ")"));
  }
  RETURN_IF_ERROR(f.Bool("norm_topk_prob", &c.norm_topk_prob));
  if (qwen35) {
    // Every layer is MoE and the router always renormalises its top-k; transformers reads
    // neither norm_topk_prob, decoder_sparse_step nor mlp_only_layers for this family.
    if (c.num_experts < 1) return f.Error("num_experts", "must be at least 1 for qwen3_5_moe");
    c.norm_topk_prob = true;
  } else {
    RETURN_IF_ERROR(f.Int("decoder_sparse_step", &c.decoder_sparse_step, 1, kMaxLayers));
  }
  if (const Json* v = qwen35 ? nullptr : f.Get("mlp_only_layers")) {
    if (!v->is_array()) return f.Error("mlp_only_layers", "must be a list of layer indices");
    for (const Json& item : *v) {
      if (!item.is_number_integer() || item.get<int64_t>() < 0 ||
          item.get<int64_t>() >= c.num_hidden_layers) {
        return f.Error("mlp_only_layers",
                       absl::StrCat("must hold layer indices in [0, ", c.num_hidden_layers, ")"));
      }
      c.mlp_only_layers.push_back(item.get<int>());
    }
  }

  if (qwen3 || qwen35) {
    c.qk_norm = true;
    RETURN_IF_ERROR(f.Bool("attention_bias", &c.attention_bias));
    if (c.attention_bias) {
      // attention_bias also puts a bias on o_proj, which LayerWeights does not hold.
      return f.Error("attention_bias", absl::StrCat("= true is not supported for ", c.model_type));
    }
  } else {
    c.qk_norm = false;
    c.attention_bias = true;
    RETURN_IF_ERROR(f.Bool("qkv_bias", &c.attention_bias));
  }
  bool sliding = false;
  RETURN_IF_ERROR(f.Bool("use_sliding_window", &sliding));
  if (sliding) return f.Error("use_sliding_window", "= true is not supported");
  std::string act = "silu";
  RETURN_IF_ERROR(f.String("hidden_act", &act));
  if (act != "silu") {
    return f.Error("hidden_act", absl::StrCat("\"", act, "\" is not supported (supported: silu)"));
  }
  if (wrapper_tie != nullptr) {
    Fields wf(wrapper, origin_path);
    RETURN_IF_ERROR(wf.Bool("tie_word_embeddings", &c.tie_word_embeddings));
    if (f.Has("tie_word_embeddings")) {
      bool text_tie = false;
      RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &text_tie));
      if (text_tie != c.tie_word_embeddings) {
        return f.Error("tie_word_embeddings",
                       absl::StrCat("is ", text_tie ? "true" : "false",
                                    " but the wrapper's tie_word_embeddings is ",
                                    c.tie_word_embeddings ? "true" : "false"));
      }
    }
  } else {
    RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  }
  RETURN_IF_ERROR(f.IntList("eos_token_id", &c.eos_token_ids, 0, c.vocab_size - 1));
  RETURN_IF_ERROR(f.Int("bos_token_id", &c.bos_token_id, 0, c.vocab_size - 1));
  RETURN_IF_ERROR(f.String("torch_dtype", &c.torch_dtype));
  RETURN_IF_ERROR(f.String("dtype", &c.torch_dtype));

  if (qwen35) {
    c.attn_output_gate = true;
    c.zero_centered_norms = true;
    RETURN_IF_ERROR(ParseLayerTypes(f, &c));
    if (c.NumLinearAttentionLayers() > 0) RETURN_IF_ERROR(ParseLinearAttention(f, &c));
  } else if (f.Has("layer_types")) {
    // transformers 5 writes layer_types for every model; these families have full attention
    // only.
    const Json* v = f.Get("layer_types");
    if (!v->is_array()) return f.Error("layer_types", "must be a list");
    for (const Json& item : *v) {
      if (!item.is_string() || item.get<std::string>() != "full_attention") {
        return f.Error("layer_types", absl::StrCat("has ", item.dump(), "; ", c.model_type,
                                                   " has full-attention layers only"));
      }
    }
  }

  // Dense layers need a dense MLP size.
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsMoeLayer(l) && c.intermediate_size <= 0) {
      return f.Error("intermediate_size",
                     absl::StrCat("must be positive: layer ", l, " is a dense MLP layer"));
    }
  }
  return c;
}

ModelConfig Qwen36_35B_A3B(int num_layers) {
  ModelConfig c;
  c.model_type = "qwen3_5_moe";
  c.vocab_size = 248320;
  c.hidden_size = 2048;
  // Unused (every layer is MoE); transformers' class default, as FromJson leaves it.
  c.intermediate_size = 5632;
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  c.num_hidden_layers = num_layers;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 2;
  c.head_dim = 256;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e7;
  c.max_position_embeddings = 262144;
  c.num_experts = 256;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  c.tie_word_embeddings = false;
  c.torch_dtype = "bfloat16";
  c.layer_types.assign(num_layers, LayerKind::kLinearAttention);
  for (int l = 3; l < num_layers; l += 4) c.layer_types[l] = LayerKind::kFullAttention;
  c.linear = {/*num_key_heads=*/16, /*num_value_heads=*/32, /*key_head_dim=*/128,
              /*value_head_dim=*/128, /*conv_kernel=*/4};
  c.partial_rotary_factor = 0.25;
  c.attn_output_gate = true;
  c.zero_centered_norms = true;
  return c;
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return FromJson(ss.str(), path);
}

}  // namespace moe::engine
