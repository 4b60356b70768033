// make_tiny_model: writes a Hugging Face model folder with random weights, for tests, benchmarks
// and trying the engine without a real checkpoint:
//
//   make_tiny_model --family qwen3_moe|qwen2_moe|qwen3_5_moe --out DIR [--seed N] [--layers N
//       --hidden N --experts N --top_k N --moe_intermediate N ...]
//       [--dtype bf16|f32|f16|fp8|nvfp4]
//       [--fused_experts] [--shards N] [--transformers 4|5]
//
// DIR gets config.json (fields transformers reads for the family, in the spelling of the chosen
// transformers major version) and model.safetensors, or N shards and model.safetensors.index.json.
// --dtype fp8 writes every projection matrix as F8_E4M3 with 128x128-block weight_scale_inv
// (as Qwen's FP8 releases do); embeddings, norms, router and biases stay bf16.
// --dtype nvfp4 writes NVIDIA ModelOpt's NVFP4 layout: every projection matrix except lm_head as
// U8 [out, in / 2] packed e2m1 codes (element 2i in the low nibble), `weight_scale` F8_E4M3
// [out, in / 16], `weight_scale_2` F32 scalar (the per-tensor scale, amax / (6 * 448)) and
// `input_scale` F32 scalar (1, unused for weight-only use); experts per expert; an
// hf_quant_config.json and config.json's quantization_config say quant_algo NVFP4, group_size
// 16. up_proj weights are drawn 1.5x wider than gate_proj's so that their per-tensor scales
// differ on purpose (engines that keep one scale for both must not pass unnoticed).
// Weights are N(0, 1/fan_in) from a seeded generator of our own (the same bytes on every
// platform), norms 1 + U(-0.1, 0.1).
//
// qwen3_5_moe (Qwen3.5 / Qwen3.6 MoE) is written as the published checkpoints are: the
// multimodal wrapper's config.json (model_type qwen3_5_moe, the text model under text_config in
// transformers 5 spelling, a vision_config) with tensors under "model.language_model.", a few
// vision-tower and multi-token-prediction tensors the engine ignores, and fused experts (per
// expert with --dtype fp8); --text_only writes the text model alone (qwen3_5_moe_text,
// "model."). Layers are Gated DeltaNet except every --full_attention_interval-th; norms are
// zero-centred (U(-0.1, 0.1), applied as 1 + w) except the DeltaNet's gated norm; A_log is
// log U(0.01, 1), dt_bias N(0, 0.25), conv weights N(0, 0.25).
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/formats.h"
#include "common/status.h"
#include "engine/safetensors.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, family, "", "qwen3_moe, qwen2_moe or qwen3_5_moe");
ABSL_FLAG(std::string, out, "", "output folder (created if missing)");
ABSL_FLAG(uint64_t, seed, 0, "random seed");
ABSL_FLAG(int, layers, 2, "num_hidden_layers");
ABSL_FLAG(int, hidden, 64, "hidden_size");
ABSL_FLAG(int, experts, 8, "num_experts");
ABSL_FLAG(int, top_k, 2, "num_experts_per_tok");
ABSL_FLAG(int, moe_intermediate, 32, "moe_intermediate_size");
ABSL_FLAG(int, intermediate, 128, "intermediate_size (dense MLP layers)");
ABSL_FLAG(int, shared_intermediate, 64, "shared_expert_intermediate_size (qwen2_moe, qwen3_5_moe)");
ABSL_FLAG(int, heads, 4, "num_attention_heads");
ABSL_FLAG(int, kv_heads, 2, "num_key_value_heads");
ABSL_FLAG(int, head_dim, 16, "head_dim (qwen3_moe; qwen2_moe uses hidden / heads)");
ABSL_FLAG(int, vocab, 256, "vocab_size");
ABSL_FLAG(int, max_positions, 512, "max_position_embeddings");
ABSL_FLAG(int, decoder_sparse_step, 1, "decoder_sparse_step");
ABSL_FLAG(std::string, mlp_only_layers, "", "comma-separated dense layer indices");
ABSL_FLAG(bool, tie_embeddings, false, "tie_word_embeddings (no lm_head tensor)");
ABSL_FLAG(bool, norm_topk_prob, true, "norm_topk_prob");
ABSL_FLAG(std::string, dtype, "bf16", "bf16, f32, f16, fp8 or nvfp4 (see the file comment)");
ABSL_FLAG(bool, fused_experts, false, "write experts as fused gate_up_proj / down_proj");
ABSL_FLAG(int, shards, 1, "number of safetensors files (>1 writes an index)");
ABSL_FLAG(int, transformers, 4, "config spelling: 4 (rope_scaling, torch_dtype) or 5");
ABSL_FLAG(int, full_attention_interval, 4, "qwen3_5_moe: every N-th layer is full attention");
ABSL_FLAG(int, linear_key_heads, 2, "qwen3_5_moe: linear_num_key_heads");
ABSL_FLAG(int, linear_value_heads, 4, "qwen3_5_moe: linear_num_value_heads");
ABSL_FLAG(int, linear_key_dim, 16, "qwen3_5_moe: linear_key_head_dim");
ABSL_FLAG(int, linear_value_dim, 16, "qwen3_5_moe: linear_value_head_dim");
ABSL_FLAG(int, linear_conv_kernel, 4, "qwen3_5_moe: linear_conv_kernel_dim");
ABSL_FLAG(double, partial_rotary_factor, 0.25, "qwen3_5_moe: rotary share of head_dim");
ABSL_FLAG(bool, text_only, false,
          "qwen3_5_moe: the text model alone (qwen3_5_moe_text) instead of the multimodal "
          "wrapper");

namespace moe::tools {
namespace {

using engine::SafetensorsWriter;
using engine::StDtype;
using Json = nlohmann::json;

// splitmix64 + Box-Muller: portable, so a seed means the same weights everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  double Normal() {
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t s_;
};

struct Named {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

class Builder {
 public:
  Builder(uint64_t seed, const std::string& dtype) : rng_(seed), dtype_(dtype) {}

  // A projection matrix [rows, cols] in the chosen dtype (fp8 adds its _scale_inv).
  void Matrix(const std::string& name, int64_t rows, int64_t cols) {
    std::vector<float> x(rows * cols);
    double std = 1.0 / std::sqrt(static_cast<double>(cols));
    const bool nvfp4 = dtype_ == "nvfp4" && name != "lm_head.weight";
    if (nvfp4 && name.size() > 16 && name.compare(name.size() - 16, 16, "up_proj.weight") == 0) {
      std *= 1.5;
    }
    for (float& v : x) v = static_cast<float>(rng_.Normal() * std);
    if (nvfp4) {
      AddNvfp4(name, rows, cols, x);
      return;
    }
    AddFloats(name, {rows, cols}, x, /*allow_fp8=*/true);
  }
  // A fused [E, rows, cols] expert tensor.
  void Fused(const std::string& name, int64_t e, int64_t rows, int64_t cols) {
    std::vector<float> x(e * rows * cols);
    const double std = 1.0 / std::sqrt(static_cast<double>(cols));
    for (float& v : x) v = static_cast<float>(rng_.Normal() * std);
    AddFloats(name, {e, rows, cols}, x, /*allow_fp8=*/false);
  }
  void Embedding(const std::string& name, int64_t rows, int64_t cols) {
    std::vector<float> x(rows * cols);
    for (float& v : x) v = static_cast<float>(rng_.Normal());
    AddFloats(name, {rows, cols}, x, false);
  }
  void Norm(const std::string& name, int64_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(1.0 + 0.2 * (rng_.Uniform() - 0.5));
    AddFloats(name, {n}, x, false);
  }
  // A zero-centred norm weight (applied as 1 + w).
  void ZeroCenteredNorm(const std::string& name, int64_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(0.2 * (rng_.Uniform() - 0.5));
    AddFloats(name, {n}, x, false);
  }
  // Any other tensor: N(0, std^2) of `shape`, never fp8.
  void Normal(const std::string& name, std::vector<int64_t> shape, double std) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(rng_.Normal() * std);
    AddFloats(name, std::move(shape), x, false);
  }
  // log U(lo, hi) (A_log).
  void LogUniform(const std::string& name, int64_t n, double lo, double hi) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(std::log(lo + (hi - lo) * rng_.Uniform()));
    AddFloats(name, {n}, x, false);
  }
  void Bias(const std::string& name, int64_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(0.1 * rng_.Normal());
    AddFloats(name, {n}, x, false);
  }
  void Router(const std::string& name, int64_t rows, int64_t cols) {
    std::vector<float> x(rows * cols);
    const double std = 1.0 / std::sqrt(static_cast<double>(cols));
    for (float& v : x) v = static_cast<float>(rng_.Normal() * std);
    AddFloats(name, {rows, cols}, x, false);
  }

  std::vector<Named>& tensors() { return tensors_; }

 private:
  // NVIDIA's NVFP4 layout of `name` (see the file comment).
  void AddNvfp4(const std::string& name, int64_t rows, int64_t cols, const std::vector<float>& x) {
    const std::string base = name.substr(0, name.size() - std::string("weight").size());
    const float global = common::Nvfp4GlobalScale(x.data(), rows * cols);
    Named w{name, StDtype::kU8, {rows, cols / 2}, std::vector<uint8_t>(rows * cols / 2)};
    Named sc{name + "_scale", StDtype::kF8E4M3, {rows, cols / common::kNvfp4Block},
             std::vector<uint8_t>(rows * cols / common::kNvfp4Block)};
    for (int64_t r = 0; r < rows; ++r) {
      common::QuantizeRowNvfp4(x.data() + r * cols, cols, global, w.bytes.data() + r * cols / 2,
                               sc.bytes.data() + r * cols / common::kNvfp4Block);
    }
    auto scalar = [](const std::string& n, float v) {
      Named t{n, StDtype::kF32, {}, std::vector<uint8_t>(4)};
      std::memcpy(t.bytes.data(), &v, 4);
      return t;
    };
    tensors_.push_back(std::move(w));
    tensors_.push_back(std::move(sc));
    tensors_.push_back(scalar(name + "_scale_2", global));
    tensors_.push_back(scalar(base + "input_scale", 1.0f));
  }

  void AddFloats(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& x,
                 bool allow_fp8) {
    Named t{name, StDtype::kBf16, shape, {}};
    if (dtype_ == "f32") {
      t.dtype = StDtype::kF32;
      t.bytes.resize(x.size() * 4);
      std::memcpy(t.bytes.data(), x.data(), t.bytes.size());
    } else if (dtype_ == "f16") {
      t.dtype = StDtype::kF16;
      t.bytes.resize(x.size() * 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = common::FloatToFp16(x[i]);
        std::memcpy(t.bytes.data() + 2 * i, &h, 2);
      }
    } else if (dtype_ == "fp8" && allow_fp8) {
      const int64_t rows = shape[0], cols = shape[1];
      const int64_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
      t.dtype = StDtype::kF8E4M3;
      t.bytes.resize(x.size());
      std::vector<float> scales(sr * sc);
      common::QuantizeFp8Block(x.data(), rows, cols, t.bytes.data(), scales.data());
      Named s{name + "_scale_inv", StDtype::kF32, {sr, sc}, {}};
      s.bytes.resize(scales.size() * 4);
      std::memcpy(s.bytes.data(), scales.data(), s.bytes.size());
      tensors_.push_back(std::move(t));
      tensors_.push_back(std::move(s));
      return;
    } else {
      t.bytes.resize(x.size() * 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = common::FloatToBf16(x[i]);
        std::memcpy(t.bytes.data() + 2 * i, &h, 2);
      }
    }
    tensors_.push_back(std::move(t));
  }

  Rng rng_;
  std::string dtype_;
  std::vector<Named> tensors_;
};

// config.json's quantization_config of an NVFP4 checkpoint (ModelOpt's spelling).
Json Nvfp4QuantizationConfig() {
  return {{"quant_method", "modelopt"},
          {"quant_algo", "NVFP4"},
          {"group_size", 16},
          {"ignore", {"lm_head", "*.mlp.gate", "*.shared_expert_gate", "*conv1d*"}}};
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

// config.json and the tensors, in one file or `shards` files with an index.
absl::Status WriteFolder(const std::string& out, const Json& cfg, std::vector<Named>& all,
                         int shards) {
  ::mkdir(out.c_str(), 0755);
  RETURN_IF_ERROR(WriteText(out + "/config.json", cfg.dump(2) + "\n"));
  if (shards == 1) {
    SafetensorsWriter w;
    w.SetMetadata("format", "pt");
    for (const Named& t : all) RETURN_IF_ERROR(w.Add(t.name, t.dtype, t.shape, t.bytes));
    return w.WriteFile(out + "/model.safetensors");
  }
  // Shards of about equal size, tensors in order (a weight and its scale may straddle two
  // shards, as in real sharded checkpoints).
  uint64_t total = 0;
  for (const Named& t : all) total += t.bytes.size();
  std::vector<SafetensorsWriter> writers(shards);
  Json weight_map = Json::object();
  uint64_t done = 0;
  for (const Named& t : all) {
    const int s = static_cast<int>(std::min<uint64_t>(shards - 1, done * shards / total));
    done += t.bytes.size();
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s + 1, shards);
    weight_map[t.name] = name;
    RETURN_IF_ERROR(writers[s].Add(t.name, t.dtype, t.shape, t.bytes));
  }
  for (int s = 0; s < shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s + 1, shards);
    writers[s].SetMetadata("format", "pt");
    RETURN_IF_ERROR(writers[s].WriteFile(out + "/" + name));
  }
  Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteText(out + "/model.safetensors.index.json", index.dump(2) + "\n");
}

// qwen3_5_moe: config.json (the multimodal wrapper, or the text model alone with --text_only)
// and its tensors into `b` (see the file comment).
absl::Status BuildQwen35(const std::string& dtype, Builder& b, Json& cfg) {
  const int L = absl::GetFlag(FLAGS_layers), H = absl::GetFlag(FLAGS_hidden);
  const int E = absl::GetFlag(FLAGS_experts), I = absl::GetFlag(FLAGS_moe_intermediate);
  const int V = absl::GetFlag(FLAGS_vocab), S = absl::GetFlag(FLAGS_shared_intermediate);
  const int heads = absl::GetFlag(FLAGS_heads), kv = absl::GetFlag(FLAGS_kv_heads);
  const int hd = absl::GetFlag(FLAGS_head_dim), K = absl::GetFlag(FLAGS_top_k);
  const int interval = absl::GetFlag(FLAGS_full_attention_interval);
  const int nk = absl::GetFlag(FLAGS_linear_key_heads),
            nv = absl::GetFlag(FLAGS_linear_value_heads);
  const int dk = absl::GetFlag(FLAGS_linear_key_dim), dv = absl::GetFlag(FLAGS_linear_value_dim);
  const int conv = absl::GetFlag(FLAGS_linear_conv_kernel);
  const double prf = absl::GetFlag(FLAGS_partial_rotary_factor);
  const bool text_only = absl::GetFlag(FLAGS_text_only);
  if (L <= 0 || H <= 0 || E <= 0 || I <= 0 || S <= 0 || V <= 1 || heads <= 0 || kv <= 0 ||
      heads % kv != 0 || hd <= 0 || K <= 0 || K > E || interval <= 0 || nk <= 0 || nv <= 0 ||
      nv % nk != 0 || dk <= 0 || dv <= 0 || conv <= 0 || !(prf > 0 && prf <= 1)) {
    return absl::InvalidArgumentError(
        "sizes must be positive, heads a multiple of kv_heads, linear_value_heads a multiple of "
        "linear_key_heads, top_k at most experts, partial_rotary_factor in (0, 1]");
  }
  const int rotary = static_cast<int>(hd * prf);
  if (rotary < 2 || rotary % 2 != 0) {
    return absl::InvalidArgumentError("head_dim * partial_rotary_factor must be even and >= 2");
  }
  const int conv_dim = 2 * nk * dk + nv * dv;
  const char* dtype_name = dtype == "f32" ? "float32" : dtype == "f16" ? "float16" : "bfloat16";
  Json text;
  text["model_type"] = "qwen3_5_moe_text";
  text["vocab_size"] = V;
  text["hidden_size"] = H;
  text["num_hidden_layers"] = L;
  text["num_attention_heads"] = heads;
  text["num_key_value_heads"] = kv;
  text["head_dim"] = hd;
  text["hidden_act"] = "silu";
  text["max_position_embeddings"] = absl::GetFlag(FLAGS_max_positions);
  text["rms_norm_eps"] = 1e-6;
  text["attention_bias"] = false;
  text["attention_dropout"] = 0.0;
  text["attn_output_gate"] = true;
  text["full_attention_interval"] = interval;
  Json layer_types = Json::array();
  for (int l = 0; l < L; ++l) {
    layer_types.push_back((l + 1) % interval != 0 ? "linear_attention" : "full_attention");
  }
  text["layer_types"] = layer_types;
  text["linear_conv_kernel_dim"] = conv;
  text["linear_key_head_dim"] = dk;
  text["linear_value_head_dim"] = dv;
  text["linear_num_key_heads"] = nk;
  text["linear_num_value_heads"] = nv;
  text["mamba_ssm_dtype"] = "float32";
  text["moe_intermediate_size"] = I;
  text["shared_expert_intermediate_size"] = S;
  text["num_experts"] = E;
  text["num_experts_per_tok"] = K;
  text["router_aux_loss_coef"] = 0.001;
  text["output_router_logits"] = false;
  text["mtp_num_hidden_layers"] = 1;
  text["initializer_range"] = 0.02;
  text["use_cache"] = true;
  text["tie_word_embeddings"] = absl::GetFlag(FLAGS_tie_embeddings);
  text["bos_token_id"] = V - 2;
  text["eos_token_id"] = V - 1;
  text["dtype"] = dtype_name;
  const int half = rotary / 2;
  text["rope_parameters"] = {{"rope_type", "default"},
                             {"rope_theta", 10000000.0},
                             {"partial_rotary_factor", prf},
                             {"mrope_interleaved", true},
                             {"mrope_section", {half - 2 * (half / 3), half / 3, half / 3}}};
  if (dtype == "fp8") {
    text["quantization_config"] = {{"quant_method", "fp8"},
                                   {"fmt", "e4m3"},
                                   {"activation_scheme", "dynamic"},
                                   {"weight_block_size", {128, 128}}};
  }
  if (dtype == "nvfp4") text["quantization_config"] = Nvfp4QuantizationConfig();
  std::string root = "model.";
  if (text_only) {
    cfg = text;
    cfg["architectures"] = {"Qwen3_5MoeForCausalLM"};
    cfg["transformers_version"] = "5.0.0";
  } else {
    root = "model.language_model.";
    cfg["architectures"] = {"Qwen3_5MoeForConditionalGeneration"};
    cfg["model_type"] = "qwen3_5_moe";
    cfg["tie_word_embeddings"] = absl::GetFlag(FLAGS_tie_embeddings);
    cfg["text_config"] = text;
    cfg["vision_config"] = {{"model_type", "qwen3_5_moe_vision"},
                            {"depth", 1},
                            {"hidden_size", 16},
                            {"intermediate_size", 32},
                            {"num_heads", 2},
                            {"out_hidden_size", H}};
    cfg["image_token_id"] = V - 4;
    cfg["video_token_id"] = V - 3;
    cfg["transformers_version"] = "5.0.0";
    if (dtype == "fp8" || dtype == "nvfp4") {
      cfg["quantization_config"] = text["quantization_config"];
    }
  }

  b.Embedding(root + "embed_tokens.weight", V, H);
  for (int l = 0; l < L; ++l) {
    const std::string p = absl::StrCat(root, "layers.", l, ".");
    b.ZeroCenteredNorm(p + "input_layernorm.weight", H);
    if ((l + 1) % interval != 0) {
      const std::string a = p + "linear_attn.";
      b.Matrix(a + "in_proj_qkv.weight", conv_dim, H);
      b.Matrix(a + "in_proj_z.weight", nv * dv, H);
      b.Router(a + "in_proj_b.weight", nv, H);
      b.Router(a + "in_proj_a.weight", nv, H);
      b.Normal(a + "conv1d.weight", {conv_dim, 1, conv}, 0.5);
      b.Normal(a + "dt_bias", {nv}, 0.5);
      b.LogUniform(a + "A_log", nv, 0.01, 1.0);
      b.Norm(a + "norm.weight", dv);
      b.Matrix(a + "out_proj.weight", H, nv * dv);
    } else {
      const std::string a = p + "self_attn.";
      b.Matrix(a + "q_proj.weight", heads * hd * 2, H);
      b.Matrix(a + "k_proj.weight", kv * hd, H);
      b.Matrix(a + "v_proj.weight", kv * hd, H);
      b.Matrix(a + "o_proj.weight", H, heads * hd);
      b.ZeroCenteredNorm(a + "q_norm.weight", hd);
      b.ZeroCenteredNorm(a + "k_norm.weight", hd);
    }
    b.ZeroCenteredNorm(p + "post_attention_layernorm.weight", H);
    const std::string m = p + "mlp.";
    b.Router(m + "gate.weight", E, H);
    if (dtype == "fp8" || dtype == "nvfp4") {
      for (int e = 0; e < E; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        b.Matrix(x + "gate_proj.weight", I, H);
        b.Matrix(x + "up_proj.weight", I, H);
        b.Matrix(x + "down_proj.weight", H, I);
      }
    } else {
      b.Fused(m + "experts.gate_up_proj", E, 2 * I, H);
      b.Fused(m + "experts.down_proj", E, H, I);
    }
    b.Matrix(m + "shared_expert.gate_proj.weight", S, H);
    b.Matrix(m + "shared_expert.up_proj.weight", S, H);
    b.Matrix(m + "shared_expert.down_proj.weight", H, S);
    b.Router(m + "shared_expert_gate.weight", 1, H);
  }
  b.ZeroCenteredNorm(root + "norm.weight", H);
  if (!absl::GetFlag(FLAGS_tie_embeddings)) b.Matrix("lm_head.weight", V, H);
  if (!text_only) {
    // What the published checkpoints carry beside the text model.
    b.Normal("model.visual.pos_embed.weight", {4, 16}, 1.0);
    b.Normal("model.visual.patch_embed.proj.bias", {16}, 1.0);
    b.Normal("mtp.fc.weight", {H, 2 * H}, 1.0 / std::sqrt(2.0 * H));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string family = absl::GetFlag(FLAGS_family);
  const std::string out = absl::GetFlag(FLAGS_out);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (family != "qwen3_moe" && family != "qwen2_moe" && family != "qwen3_5_moe") {
    return absl::InvalidArgumentError("--family must be qwen3_moe, qwen2_moe or qwen3_5_moe");
  }
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  if (dtype != "bf16" && dtype != "f32" && dtype != "f16" && dtype != "fp8" &&
      dtype != "nvfp4") {
    return absl::InvalidArgumentError("--dtype must be bf16, f32, f16, fp8 or nvfp4");
  }
  if (dtype == "nvfp4") {
    // ModelOpt writes both: hf_quant_config.json (older readers) and quantization_config.
    const Json exclude = Nvfp4QuantizationConfig()["ignore"];
    const Json hq = {{"producer", {{"name", "modelopt"}, {"version", "0.37.0"}}},
                     {"quantization",
                      {{"quant_algo", "NVFP4"},
                       {"kv_cache_quant_algo", nullptr},
                       {"group_size", 16},
                       {"exclude_modules", exclude}}}};
    ::mkdir(out.c_str(), 0755);
    RETURN_IF_ERROR(WriteText(out + "/hf_quant_config.json", hq.dump(2) + "\n"));
  }
  if (family == "qwen3_5_moe") {
    Builder b(absl::GetFlag(FLAGS_seed), dtype);
    Json cfg;
    RETURN_IF_ERROR(BuildQwen35(dtype, b, cfg));
    return WriteFolder(out, cfg, b.tensors(), absl::GetFlag(FLAGS_shards));
  }
  const bool qwen3 = family == "qwen3_moe";
  const int L = absl::GetFlag(FLAGS_layers), H = absl::GetFlag(FLAGS_hidden);
  const int E = absl::GetFlag(FLAGS_experts), I = absl::GetFlag(FLAGS_moe_intermediate);
  const int D = absl::GetFlag(FLAGS_intermediate), V = absl::GetFlag(FLAGS_vocab);
  const int heads = absl::GetFlag(FLAGS_heads), kv = absl::GetFlag(FLAGS_kv_heads);
  const int S = qwen3 ? 0 : absl::GetFlag(FLAGS_shared_intermediate);
  const int step = absl::GetFlag(FLAGS_decoder_sparse_step);
  const int shards = absl::GetFlag(FLAGS_shards);
  if (L <= 0 || H <= 0 || E <= 0 || I <= 0 || D <= 0 || V <= 1 || heads <= 0 || kv <= 0 ||
      heads % kv != 0 || step <= 0 || shards <= 0 || absl::GetFlag(FLAGS_top_k) <= 0 ||
      absl::GetFlag(FLAGS_top_k) > E) {
    return absl::InvalidArgumentError(
        "sizes must be positive, heads a multiple of kv_heads, "
        "top_k at most experts");
  }
  if (!qwen3 && H % heads != 0) {
    return absl::InvalidArgumentError("qwen2_moe needs hidden to be a multiple of heads");
  }
  const int hd = qwen3 ? absl::GetFlag(FLAGS_head_dim) : H / heads;
  std::vector<int> mlp_only;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_mlp_only_layers), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 0 || v >= L) {
      return absl::InvalidArgumentError("--mlp_only_layers takes layer indices in [0, layers)");
    }
    mlp_only.push_back(v);
  }
  auto is_moe = [&](int l) {
    for (int d : mlp_only) {
      if (d == l) return false;
    }
    return (l + 1) % step == 0;
  };

  // config.json
  const int tv = absl::GetFlag(FLAGS_transformers);
  Json cfg;
  cfg["architectures"] = {qwen3 ? "Qwen3MoeForCausalLM" : "Qwen2MoeForCausalLM"};
  cfg["model_type"] = family;
  cfg["vocab_size"] = V;
  cfg["hidden_size"] = H;
  cfg["intermediate_size"] = D;
  cfg["moe_intermediate_size"] = I;
  if (!qwen3) cfg["shared_expert_intermediate_size"] = S;
  cfg["num_hidden_layers"] = L;
  cfg["num_attention_heads"] = heads;
  cfg["num_key_value_heads"] = kv;
  if (qwen3) cfg["head_dim"] = hd;
  cfg["hidden_act"] = "silu";
  cfg["max_position_embeddings"] = absl::GetFlag(FLAGS_max_positions);
  cfg["rms_norm_eps"] = 1e-6;
  cfg["num_experts"] = E;
  cfg["num_experts_per_tok"] = absl::GetFlag(FLAGS_top_k);
  cfg["norm_topk_prob"] = absl::GetFlag(FLAGS_norm_topk_prob);
  cfg["decoder_sparse_step"] = step;
  cfg["mlp_only_layers"] = mlp_only;
  cfg["tie_word_embeddings"] = absl::GetFlag(FLAGS_tie_embeddings);
  cfg["use_sliding_window"] = false;
  cfg["sliding_window"] = nullptr;
  cfg["attention_dropout"] = 0.0;
  cfg["initializer_range"] = 0.02;
  cfg["use_cache"] = true;
  cfg["bos_token_id"] = V - 2;
  cfg["eos_token_id"] = V - 1;
  if (qwen3) cfg["attention_bias"] = false;
  if (!qwen3) cfg["max_window_layers"] = L;
  cfg["router_aux_loss_coef"] = 0.001;
  cfg["output_router_logits"] = false;
  const char* dtype_name = dtype == "f32" ? "float32" : dtype == "f16" ? "float16" : "bfloat16";
  if (tv >= 5) {
    cfg["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
    cfg["dtype"] = dtype_name;
    cfg["transformers_version"] = "5.0.0";
  } else {
    cfg["rope_theta"] = 10000.0;
    cfg["rope_scaling"] = nullptr;
    cfg["torch_dtype"] = dtype_name;
    cfg["transformers_version"] = "4.51.0";
  }
  if (dtype == "fp8") {
    cfg["quantization_config"] = {{"quant_method", "fp8"},
                                  {"fmt", "e4m3"},
                                  {"activation_scheme", "dynamic"},
                                  {"weight_block_size", {128, 128}}};
  }
  if (dtype == "nvfp4") cfg["quantization_config"] = Nvfp4QuantizationConfig();

  Builder b(absl::GetFlag(FLAGS_seed), dtype);
  b.Embedding("model.embed_tokens.weight", V, H);
  for (int l = 0; l < L; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    b.Norm(p + "input_layernorm.weight", H);
    b.Matrix(p + "self_attn.q_proj.weight", heads * hd, H);
    b.Matrix(p + "self_attn.k_proj.weight", kv * hd, H);
    b.Matrix(p + "self_attn.v_proj.weight", kv * hd, H);
    b.Matrix(p + "self_attn.o_proj.weight", H, heads * hd);
    if (qwen3) {
      b.Norm(p + "self_attn.q_norm.weight", hd);
      b.Norm(p + "self_attn.k_norm.weight", hd);
    } else {
      b.Bias(p + "self_attn.q_proj.bias", heads * hd);
      b.Bias(p + "self_attn.k_proj.bias", kv * hd);
      b.Bias(p + "self_attn.v_proj.bias", kv * hd);
    }
    b.Norm(p + "post_attention_layernorm.weight", H);
    const std::string m = p + "mlp.";
    if (!is_moe(l)) {
      b.Matrix(m + "gate_proj.weight", D, H);
      b.Matrix(m + "up_proj.weight", D, H);
      b.Matrix(m + "down_proj.weight", H, D);
      continue;
    }
    b.Router(m + "gate.weight", E, H);
    if (absl::GetFlag(FLAGS_fused_experts) && dtype != "nvfp4") {
      b.Fused(m + "experts.gate_up_proj", E, 2 * I, H);
      b.Fused(m + "experts.down_proj", E, H, I);
    } else {
      for (int e = 0; e < E; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        b.Matrix(x + "gate_proj.weight", I, H);
        b.Matrix(x + "up_proj.weight", I, H);
        b.Matrix(x + "down_proj.weight", H, I);
      }
    }
    if (S > 0) {
      b.Matrix(m + "shared_expert.gate_proj.weight", S, H);
      b.Matrix(m + "shared_expert.up_proj.weight", S, H);
      b.Matrix(m + "shared_expert.down_proj.weight", H, S);
      b.Router(m + "shared_expert_gate.weight", 1, H);
    }
  }
  b.Norm("model.norm.weight", H);
  if (!absl::GetFlag(FLAGS_tie_embeddings)) b.Matrix("lm_head.weight", V, H);

  return WriteFolder(out, cfg, b.tensors(), shards);
}

}  // namespace
}  // namespace moe::tools

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "make_tiny_model --family qwen3_moe|qwen2_moe|qwen3_5_moe --out DIR [--seed N] "
      "[--layers N ...]");
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = moe::tools::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "make_tiny_model: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
