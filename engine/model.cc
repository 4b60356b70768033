#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/status.h"
#include "engine/kernels.h"

namespace moe::engine {
namespace {

float Silu(float x) { return x / (1.0f + std::exp(-x)); }
float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void EmbeddingRow(const Tensor& e, int32_t id, float* out) {
  const int64_t h = e.cols;
  if (e.dtype == DType::kF32) {
    std::copy_n(e.f32() + id * h, h, out);
  } else {
    const uint16_t* r = e.bf16() + id * h;
    for (int64_t i = 0; i < h; ++i) out[i] = common::Bf16ToFloat(r[i]);
  }
}

}  // namespace

Model::Model(const ModelWeights* weights, ExpertBackend* experts, common::ThreadPool* pool,
             bool deterministic)
    : w_(*weights),
      experts_(experts),
      pool_(pool),
      deterministic_(deterministic),
      dense_(pool, deterministic) {}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelWeights* weights,
                                                     ExpertBackend* experts,
                                                     common::ThreadPool* pool, bool deterministic,
                                                     int max_positions) {
  const ModelConfig& c = weights->config;
  if (c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 ||
      c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_attention_heads ", c.num_attention_heads,
                                                   " must be a positive multiple of ",
                                                   "num_key_value_heads ", c.num_key_value_heads));
  }
  if (static_cast<int>(weights->layers.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("weights hold ", weights->layers.size(),
                                                   " layers, config ", c.num_hidden_layers));
  }
  if (max_positions <= 0) return absl::InvalidArgumentError("max_positions must be > 0");
  ASSIGN_OR_RETURN(RopeParams rp, ComputeRopeParams(c));
  std::unique_ptr<Model> m(new Model(weights, experts, pool, deterministic));
  m->rope_ = std::make_unique<RopeTable>(rp, c.head_dim, max_positions);
  return m;
}

absl::Status Model::Mlp(const Tensor& gate, const Tensor& up, const Tensor& down, int rows,
                        const float* x, float* out) {
  const int inter = static_cast<int>(gate.rows);
  gate_.resize(static_cast<size_t>(rows) * inter);
  up_.resize(gate_.size());
  RETURN_IF_ERROR(dense_.Apply(gate, x, rows, gate_.data()));
  RETURN_IF_ERROR(dense_.Apply(up, x, rows, up_.data()));
  for (size_t i = 0; i < gate_.size(); ++i) gate_[i] = Silu(gate_[i]) * up_[i];
  return dense_.Apply(down, gate_.data(), rows, out);
}

absl::Status Model::MoeBlock(const LayerWeights& lw, int rows, const float* x, float* h) {
  const ModelConfig& c = w_.config;
  const int H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  router_.resize(static_cast<size_t>(rows) * E);
  RETURN_IF_ERROR(dense_.Apply(lw.router, x, rows, router_.data()));
  route_ids_.assign(static_cast<size_t>(rows) * K, -1);
  route_w_.assign(static_cast<size_t>(rows) * K, 0.0f);
  std::vector<int32_t> order(E);
  std::vector<float> p(E);
  for (int r = 0; r < rows; ++r) {
    // As transformers: softmax in f32, top-k, renormalise when norm_topk_prob.
    const float* l = router_.data() + static_cast<size_t>(r) * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - mx);
      sum += p[e];
    }
    for (int e = 0; e < E; ++e) p[e] /= sum;
    if (routing_ != nullptr) {
      const size_t at = static_cast<size_t>(r) * K;
      std::copy_n(forced_ids_.data() + (static_cast<size_t>(lw.moe_index) * rows + r) * K, K,
                  route_ids_.data() + at);
      RETURN_IF_ERROR(ForcedRouteWeights(p, absl::MakeConstSpan(route_ids_.data() + at, K),
                                         c.norm_topk_prob,
                                         absl::MakeSpan(route_w_.data() + at, K)));
      continue;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float topsum = 0.0f;
    for (int j = 0; j < K; ++j) topsum += p[order[j]];
    for (int j = 0; j < K; ++j) {
      route_ids_[static_cast<size_t>(r) * K + j] = order[j];
      route_w_[static_cast<size_t>(r) * K + j] =
          c.norm_topk_prob ? p[order[j]] / topsum : p[order[j]];
    }
  }
  RETURN_IF_ERROR(experts_->Forward(lw.moe_index, rows, K, route_ids_, route_w_, x, h));
  if (!lw.shared_gate_proj.empty()) {
    mlp_out_.resize(static_cast<size_t>(rows) * H);
    RETURN_IF_ERROR(
        Mlp(lw.shared_gate_proj, lw.shared_up_proj, lw.shared_down_proj, rows, x, mlp_out_.data()));
    sgate_.resize(rows);
    RETURN_IF_ERROR(dense_.Apply(lw.shared_expert_gate, x, rows, sgate_.data()));
    for (int r = 0; r < rows; ++r) {
      const float g = Sigmoid(sgate_[r]);
      for (int i = 0; i < H; ++i) {
        h[static_cast<size_t>(r) * H + i] += g * mlp_out_[static_cast<size_t>(r) * H + i];
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Model::Forward(absl::Span<const Chunk> chunks, KvCache* kv,
                            std::vector<float>* logits) {
  const ModelConfig& c = w_.config;
  const int H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
            hd = c.head_dim, V = c.vocab_size;
  int rows = 0;
  for (const Chunk& ch : chunks) {
    if (ch.block_table == nullptr) return absl::InvalidArgumentError("chunk without blocks");
    const int end = ch.start + static_cast<int>(ch.tokens.size());
    if (ch.start < 0 || end > max_positions()) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions [", ch.start, ", ", end, ") outside [0, ", max_positions(), ")"));
    }
    if (static_cast<int64_t>(ch.block_table->size()) * kv->block_size() < end) {
      return absl::InternalError("block table does not cover the chunk");
    }
    for (int32_t t : ch.tokens) {
      if (t < 0 || t >= V) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " outside the vocabulary [0, ", V, ")"));
      }
    }
    rows += static_cast<int>(ch.tokens.size());
  }
  if (rows == 0) return absl::OkStatus();
  if (routing_ != nullptr) {
    if (routing_->moe_layers() != c.NumMoeLayers() || routing_->k() != c.num_experts_per_tok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "routing override of ", routing_->moe_layers(), " MoE layers x top-", routing_->k(),
          " for a model of ", c.NumMoeLayers(), " x top-", c.num_experts_per_tok));
    }
    forced_ids_.resize(static_cast<size_t>(c.NumMoeLayers()) * rows * c.num_experts_per_tok);
    RETURN_IF_ERROR(routing_->Next(rows, absl::MakeSpan(forced_ids_)));
  }
  const size_t T = rows;
  h_.resize(T * H);
  xn_.resize(T * H);
  q_.resize(T * nh * hd);
  k_.resize(T * nkv * hd);
  v_.resize(T * nkv * hd);
  attn_.resize(T * nh * hd);
  positions_.resize(T);
  tables_.resize(T);
  {
    size_t r = 0;
    for (const Chunk& ch : chunks) {
      for (size_t i = 0; i < ch.tokens.size(); ++i, ++r) {
        EmbeddingRow(w_.embed_tokens, ch.tokens[i], h_.data() + r * H);
        positions_[r] = ch.start + static_cast<int>(i);
        tables_[r] = ch.block_table->data();
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& lw = w_.layers[layer];
    RmsNormRows(h_.data(), rows, H, lw.input_layernorm.f32(), c.rms_norm_eps, xn_.data());
    RETURN_IF_ERROR(dense_.Apply(lw.q_proj, xn_.data(), rows, q_.data()));
    RETURN_IF_ERROR(dense_.Apply(lw.k_proj, xn_.data(), rows, k_.data()));
    RETURN_IF_ERROR(dense_.Apply(lw.v_proj, xn_.data(), rows, v_.data()));
    auto add_bias = [&](std::vector<float>& y, const Tensor& b) {
      if (b.empty()) return;
      const int n = static_cast<int>(b.cols);
      for (size_t r = 0; r < T; ++r) {
        for (int i = 0; i < n; ++i) y[r * n + i] += b.f32()[i];
      }
    };
    add_bias(q_, lw.q_bias);
    add_bias(k_, lw.k_bias);
    add_bias(v_, lw.v_bias);
    if (!lw.q_norm.empty()) {
      RmsNormRows(q_.data(), rows * nh, hd, lw.q_norm.f32(), c.rms_norm_eps, q_.data());
    }
    if (!lw.k_norm.empty()) {
      RmsNormRows(k_.data(), rows * nkv, hd, lw.k_norm.f32(), c.rms_norm_eps, k_.data());
    }
    for (size_t r = 0; r < T; ++r) {
      rope_->Apply(q_.data() + r * nh * hd, nh, positions_[r]);
      rope_->Apply(k_.data() + r * nkv * hd, nkv, positions_[r]);
      kv->Store(layer, tables_[r], positions_[r], k_.data() + r * nkv * hd,
                v_.data() + r * nkv * hd);
    }
    AttentionArgs args;
    args.rows = rows;
    args.num_heads = nh;
    args.num_kv_heads = nkv;
    args.head_dim = hd;
    args.block_size = kv->block_size();
    args.scale = scale;
    args.q = q_.data();
    args.out = attn_.data();
    args.positions = positions_.data();
    args.block_tables = tables_.data();
    args.k_cache = kv->keys(layer);
    args.v_cache = kv->values(layer);
    args.block_stride = kv->block_stride();
    args.max_positions = max_positions();
    Attention(args, *pool_);
    RETURN_IF_ERROR(dense_.Apply(lw.o_proj, attn_.data(), rows, h_.data(), /*accumulate=*/true));

    RmsNormRows(h_.data(), rows, H, lw.post_attention_layernorm.f32(), c.rms_norm_eps, xn_.data());
    if (lw.is_moe) {
      RETURN_IF_ERROR(MoeBlock(lw, rows, xn_.data(), h_.data()));
    } else {
      mlp_out_.resize(T * H);
      RETURN_IF_ERROR(Mlp(lw.mlp_gate_proj, lw.mlp_up_proj, lw.mlp_down_proj, rows, xn_.data(),
                          mlp_out_.data()));
      for (size_t i = 0; i < T * H; ++i) h_[i] += mlp_out_[i];
    }
  }
  // Final norm and LM head, only for the rows that want logits.
  std::vector<float> sel;
  {
    size_t r = 0;
    for (const Chunk& ch : chunks) {
      const size_t n = ch.tokens.size();
      size_t first = n;
      if (ch.logits == Logits::kLast) first = n - 1;
      if (ch.logits == Logits::kAll) first = 0;
      for (size_t i = first; i < n; ++i) {
        sel.insert(sel.end(), h_.begin() + (r + i) * H, h_.begin() + (r + i + 1) * H);
      }
      r += n;
    }
  }
  const int out_rows = static_cast<int>(sel.size() / H);
  if (out_rows == 0) return absl::OkStatus();
  RmsNormRows(sel.data(), out_rows, H, w_.final_norm.f32(), c.rms_norm_eps, sel.data());
  const Tensor& head = w_.lm_head.empty() ? w_.embed_tokens : w_.lm_head;
  const size_t base = logits->size();
  logits->resize(base + static_cast<size_t>(out_rows) * V);
  return dense_.Apply(head, sel.data(), out_rows, logits->data() + base);
}

}  // namespace moe::engine
