#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "common/status.h"
#include "engine/gated_delta_net.h"
#include "engine/kernels.h"

namespace moe::engine {
namespace {

float Silu(float x) { return x / (1.0f + std::exp(-x)); }
float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// torch's softplus (beta 1, threshold 20).
float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// x * rsqrt(sum(x^2) + 1e-6), as transformers' l2norm for the DeltaNet's q and k.
void L2NormInPlace(float* x, int n) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

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
  if (c.NumLinearAttentionLayers() > 0) {
    const LinearAttentionConfig& la = c.linear;
    if (la.num_key_heads <= 0 || la.num_value_heads <= 0 || la.key_head_dim <= 0 ||
        la.value_head_dim <= 0 || la.conv_kernel <= 0 ||
        la.num_value_heads % la.num_key_heads != 0) {
      return absl::InvalidArgumentError("bad linear-attention sizes");
    }
  }
  ASSIGN_OR_RETURN(RopeParams rp, ComputeRopeParams(c));
  std::unique_ptr<Model> m(new Model(weights, experts, pool, deterministic));
  m->rope_ = std::make_unique<RopeTable>(rp, c.head_dim, max_positions);
  m->delta_scratch_.resize(pool->num_workers());
  for (auto& scratch : m->delta_scratch_) {
    scratch.resize(
        DeltaRuleChunkedScratch(kDeltaRuleChunk, c.linear.key_head_dim, c.linear.value_head_dim));
  }
  return m;
}

absl::Status Model::LinearAttention(const LayerWeights& lw, absl::Span<const Chunk> chunks,
                                    int rows, int linear_layer, LinearAttentionState* state) {
  const ModelConfig& c = w_.config;
  const LinearAttentionConfig& la = c.linear;
  const int C = la.conv_dim(), nk = la.num_key_heads, nv = la.num_value_heads;
  const int dk = la.key_head_dim, dv = la.value_head_dim, Kd = la.key_dim(), Vd = la.value_dim();
  const size_t T = rows;
  qkv_.resize(T * C);
  conv_.resize(T * C);
  z_.resize(T * Vd);
  lin_b_.resize(T * nv);
  lin_a_.resize(T * nv);
  g_.resize(T * nv);
  beta_.resize(T * nv);
  core_.resize(T * Vd);
  RETURN_IF_ERROR(dense_.Apply(lw.in_proj_qkv, xn_.data(), rows, qkv_.data()));
  RETURN_IF_ERROR(dense_.Apply(lw.in_proj_z, xn_.data(), rows, z_.data()));
  RETURN_IF_ERROR(dense_.Apply(lw.in_proj_b, xn_.data(), rows, lin_b_.data()));
  RETURN_IF_ERROR(dense_.Apply(lw.in_proj_a, xn_.data(), rows, lin_a_.data()));
  // The causal conv (with each sequence's last inputs) and SiLU; then per token L2-normalised
  // q and k heads, q scaled by dk^-0.5, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias).
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  pool_->ParallelFor(chunks.size(), [&](uint64_t ci, int) {
    const Chunk& ch = chunks[ci];
    const int r0 = chunk_rows_[ci], n = static_cast<int>(ch.tokens.size());
    CausalConvSilu(qkv_.data() + static_cast<size_t>(r0) * C, C, n, C, la.conv_kernel,
                   lw.conv1d.f32(), state->conv(linear_layer, ch.state_slot),
                   conv_.data() + static_cast<size_t>(r0) * C);
    for (int r = r0; r < r0 + n; ++r) {
      float* row = conv_.data() + static_cast<size_t>(r) * C;
      for (int h = 0; h < nk; ++h) {
        float* q = row + h * dk;
        L2NormInPlace(q, dk);
        for (int i = 0; i < dk; ++i) q[i] *= q_scale;
        L2NormInPlace(row + Kd + h * dk, dk);
      }
      for (int h = 0; h < nv; ++h) {
        const size_t at = static_cast<size_t>(r) * nv + h;
        beta_[at] = Sigmoid(lin_b_[at]);
        g_[at] = -std::exp(lw.a_log.f32()[h]) * Softplus(lin_a_[at] + lw.dt_bias.f32()[h]);
      }
    }
  });
  // The gated delta rule per (sequence, value head); key head h / (nv / nk) serves value head h.
  const int group = nv / nk;
  pool_->ParallelFor(chunks.size() * nv, [&](uint64_t task, int worker) {
    const size_t ci = task / nv;
    const int h = static_cast<int>(task % nv), kh = h / group;
    const Chunk& ch = chunks[ci];
    const size_t r0 = chunk_rows_[ci];
    DeltaRuleArgs a;
    a.n = static_cast<int>(ch.tokens.size());
    a.key_dim = dk;
    a.value_dim = dv;
    a.q = conv_.data() + r0 * C + kh * dk;
    a.k = conv_.data() + r0 * C + Kd + kh * dk;
    a.qk_stride = C;
    a.v = conv_.data() + r0 * C + 2 * Kd + h * dv;
    a.v_stride = C;
    a.g = g_.data() + r0 * nv + h;
    a.beta = beta_.data() + r0 * nv + h;
    a.gb_stride = nv;
    a.state = state->recurrent(linear_layer, ch.state_slot) + static_cast<size_t>(h) * dk * dv;
    a.out = core_.data() + r0 * Vd + h * dv;
    a.out_stride = Vd;
    if (a.n == 1) {
      DeltaRuleRecurrent(a, delta_scratch_[worker].data());
    } else {
      DeltaRuleChunked(a, kDeltaRuleChunk, delta_scratch_[worker].data());
    }
  });
  // RMSNormGated per value head: norm over dv, times its weight, times silu(z); then out_proj.
  const float* nw = lw.linear_norm.f32();
  pool_->ParallelFor(T, [&](uint64_t r, int) {
    for (int h = 0; h < nv; ++h) {
      float* o = core_.data() + r * Vd + h * dv;
      const float* z = z_.data() + r * Vd + h * dv;
      float ss = 0.0f;
      for (int i = 0; i < dv; ++i) ss += o[i] * o[i];
      const float inv = 1.0f / std::sqrt(ss / dv + c.rms_norm_eps);
      for (int i = 0; i < dv; ++i) o[i] = nw[i] * (o[i] * inv) * Silu(z[i]);
    }
  });
  return dense_.Apply(lw.out_proj, core_.data(), rows, h_.data(), /*accumulate=*/true);
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

absl::Status Model::Forward(absl::Span<const Chunk> chunks, KvCache* kv, std::vector<float>* logits,
                            LinearAttentionState* state) {
  const ModelConfig& c = w_.config;
  const int H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
            hd = c.head_dim, V = c.vocab_size;
  const bool linear = c.NumLinearAttentionLayers() > 0;
  if (linear) {
    if (state == nullptr || state->num_layers() != c.NumLinearAttentionLayers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model's ", c.NumLinearAttentionLayers(),
                       " linear-attention layers need a LinearAttentionState of as many layers"));
    }
    std::vector<bool> used(state->num_slots(), false);
    for (const Chunk& ch : chunks) {
      if (ch.state_slot < 0 || ch.state_slot >= state->num_slots() || used[ch.state_slot]) {
        return absl::InvalidArgumentError(absl::StrCat("chunk state slot ", ch.state_slot,
                                                       ": not in [0, ", state->num_slots(),
                                                       ") or used by two chunks of one batch"));
      }
      used[ch.state_slot] = true;
    }
  }
  int rows = 0;
  chunk_rows_.clear();
  for (const Chunk& ch : chunks) {
    chunk_rows_.push_back(rows);
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
  if (linear) {
    // A sequence's first chunk starts from the zero state (conv inputs before it are zeros).
    for (const Chunk& ch : chunks) {
      if (ch.start == 0 && !ch.tokens.empty()) state->Reset(ch.state_slot);
    }
  }
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
    if (c.IsLinearAttentionLayer(layer)) {
      RETURN_IF_ERROR(LinearAttention(lw, chunks, rows, c.LinearLayerIndex(layer), state));
    } else {
      const int kv_layer = c.KvLayerIndex(layer);
      if (c.attn_output_gate) {
        // q_proj rows per head: head_dim query rows, then head_dim gate rows.
        q_gated_.resize(T * nh * 2 * hd);
        attn_gate_.resize(T * nh * hd);
        RETURN_IF_ERROR(dense_.Apply(lw.q_proj, xn_.data(), rows, q_gated_.data()));
        for (size_t r = 0; r < T; ++r) {
          for (int h = 0; h < nh; ++h) {
            const float* src = q_gated_.data() + (r * nh + h) * 2 * hd;
            std::copy_n(src, hd, q_.data() + (r * nh + h) * hd);
            std::copy_n(src + hd, hd, attn_gate_.data() + (r * nh + h) * hd);
          }
        }
      } else {
        RETURN_IF_ERROR(dense_.Apply(lw.q_proj, xn_.data(), rows, q_.data()));
      }
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
        kv->Store(kv_layer, tables_[r], positions_[r], k_.data() + r * nkv * hd,
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
      args.k_cache = kv->keys(kv_layer);
      args.v_cache = kv->values(kv_layer);
      args.block_stride = kv->block_stride();
      args.max_positions = max_positions();
      Attention(args, *pool_);
      if (c.attn_output_gate) {
        for (size_t i = 0; i < T * nh * hd; ++i) attn_[i] *= Sigmoid(attn_gate_[i]);
      }
      RETURN_IF_ERROR(dense_.Apply(lw.o_proj, attn_.data(), rows, h_.data(), /*accumulate=*/true));
    }

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
