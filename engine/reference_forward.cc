#include "engine/reference_forward.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moe::engine {
namespace {

using Vec = std::vector<double>;

Vec Row(const Tensor& t, int64_t r) {
  Vec v(t.cols);
  for (int64_t c = 0; c < t.cols; ++c) v[c] = t.At(r, c);
  return v;
}

// y = W x, W [out, in].
Vec MatVec(const Tensor& w, const Vec& x) {
  Vec y(w.rows, 0.0);
  for (int64_t r = 0; r < w.rows; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < w.cols; ++c) s += static_cast<double>(w.At(r, c)) * x[c];
    y[r] = s;
  }
  return y;
}

Vec RmsNorm(const Vec& x, const Tensor& w, double eps, size_t offset = 0, size_t n = 0) {
  if (n == 0) n = x.size();
  double ms = 0.0;
  for (size_t i = 0; i < n; ++i) ms += x[offset + i] * x[offset + i];
  ms /= static_cast<double>(n);
  const double inv = 1.0 / std::sqrt(ms + eps);
  Vec y(n);
  for (size_t i = 0; i < n; ++i) y[i] = x[offset + i] * inv * w.At(0, i);
  return y;
}

double Silu(double x) { return x / (1.0 + std::exp(-x)); }

Vec Mlp(const Tensor& g, const Tensor& u, const Tensor& d, const Vec& x) {
  Vec a = MatVec(g, x), b = MatVec(u, x);
  for (size_t i = 0; i < a.size(); ++i) a[i] = Silu(a[i]) * b[i];
  return MatVec(d, a);
}

// inv_freq and attention scaling, straight from the YaRN paper's formulas as transformers
// writes them (in double here).
void Rope(const ModelConfig& c, Vec* inv_freq, double* attention) {
  const int dim = c.head_dim;
  const double base = c.rope_theta;
  inv_freq->resize(dim / 2);
  *attention = 1.0;
  for (int i = 0; i < dim / 2; ++i) (*inv_freq)[i] = 1.0 / std::pow(base, 2.0 * i / dim);
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == "linear") {
    for (double& f : *inv_freq) f /= rs.factor;
  } else if (rs.type == "yarn") {
    double factor = rs.factor;
    double orig = c.max_position_embeddings;
    if (rs.original_max_position_embeddings > 0) {
      orig = rs.original_max_position_embeddings;
      factor = c.max_position_embeddings / orig;
    }
    auto mscale = [](double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; };
    *attention = rs.attention_factor > 0 ? rs.attention_factor
                 : (rs.mscale != 0 && rs.mscale_all_dim != 0)
                     ? mscale(factor, rs.mscale) / mscale(factor, rs.mscale_all_dim)
                     : mscale(factor, 1.0);
    auto corr = [&](double rot) {
      return dim * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = std::max(std::floor(corr(rs.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr(rs.beta_slow)), dim - 1.0);
    if (low == high) high += 0.001;
    for (int i = 0; i < dim / 2; ++i) {
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double extra = 1.0 / std::pow(base, 2.0 * i / dim);
      const double inter = extra / factor;
      (*inv_freq)[i] = inter * ramp + extra * (1.0 - ramp);
    }
  }
}

}  // namespace

std::vector<double> ReferenceForward(const RandomModel& model, const std::vector<int32_t>& tokens) {
  const ModelWeights& w = *model.weights;
  const ModelConfig& c = w.config;
  const int T = static_cast<int>(tokens.size());
  const int H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
            hd = c.head_dim, E = c.num_experts, K = c.num_experts_per_tok,
            I = c.moe_intermediate_size;
  Vec inv_freq;
  double att = 1.0;
  Rope(c, &inv_freq, &att);
  auto rotate = [&](double* x, int pos) {
    for (int i = 0; i < hd / 2; ++i) {
      const double f = pos * inv_freq[i];
      const double cs = std::cos(f) * att, sn = std::sin(f) * att;
      const double a = x[i], b = x[i + hd / 2];
      x[i] = a * cs - b * sn;
      x[i + hd / 2] = b * cs + a * sn;
    }
  };
  std::vector<Vec> h(T);
  for (int t = 0; t < T; ++t) h[t] = Row(w.embed_tokens, tokens[t]);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    std::vector<Vec> q(T), k(T), v(T);
    for (int t = 0; t < T; ++t) {
      const Vec x = RmsNorm(h[t], lw.input_layernorm, c.rms_norm_eps);
      q[t] = MatVec(lw.q_proj, x);
      k[t] = MatVec(lw.k_proj, x);
      v[t] = MatVec(lw.v_proj, x);
      if (c.attention_bias) {
        for (int i = 0; i < nh * hd; ++i) q[t][i] += lw.q_bias.At(0, i);
        for (int i = 0; i < nkv * hd; ++i) k[t][i] += lw.k_bias.At(0, i);
        for (int i = 0; i < nkv * hd; ++i) v[t][i] += lw.v_bias.At(0, i);
      }
      for (int hh = 0; hh < nh; ++hh) {
        if (c.qk_norm) {
          const Vec n = RmsNorm(q[t], lw.q_norm, c.rms_norm_eps, hh * hd, hd);
          std::copy(n.begin(), n.end(), q[t].begin() + hh * hd);
        }
        rotate(q[t].data() + hh * hd, t);
      }
      for (int hh = 0; hh < nkv; ++hh) {
        if (c.qk_norm) {
          const Vec n = RmsNorm(k[t], lw.k_norm, c.rms_norm_eps, hh * hd, hd);
          std::copy(n.begin(), n.end(), k[t].begin() + hh * hd);
        }
        rotate(k[t].data() + hh * hd, t);
      }
    }
    for (int t = 0; t < T; ++t) {
      Vec attn(nh * hd, 0.0);
      for (int hh = 0; hh < nh; ++hh) {
        const int g = hh / (nh / nkv);
        Vec s(t + 1);
        for (int j = 0; j <= t; ++j) {
          double d = 0.0;
          for (int i = 0; i < hd; ++i) d += q[t][hh * hd + i] * k[j][g * hd + i];
          s[j] = d / std::sqrt(static_cast<double>(hd));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int j = 0; j <= t; ++j) {
          for (int i = 0; i < hd; ++i) attn[hh * hd + i] += s[j] / sum * v[j][g * hd + i];
        }
      }
      const Vec o = MatVec(lw.o_proj, attn);
      for (int i = 0; i < H; ++i) h[t][i] += o[i];
    }
    for (int t = 0; t < T; ++t) {
      const Vec x = RmsNorm(h[t], lw.post_attention_layernorm, c.rms_norm_eps);
      Vec out(H, 0.0);
      if (lw.is_moe) {
        const Vec logits = MatVec(lw.router, x);
        const double mx = *std::max_element(logits.begin(), logits.end());
        Vec p(E);
        double sum = 0.0;
        for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - mx));
        for (double& y : p) y /= sum;
        std::vector<int> ids(E);
        std::iota(ids.begin(), ids.end(), 0);
        std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return p[a] > p[b]; });
        double top = 0.0;
        for (int j = 0; j < K; ++j) top += p[ids[j]];
        const std::vector<float>& gu = model.gate_up[lw.moe_index];
        const std::vector<float>& dn = model.down[lw.moe_index];
        for (int j = 0; j < K; ++j) {
          const int e = ids[j];
          const double rw = c.norm_topk_prob ? p[e] / top : p[e];
          Vec a(I);
          for (int r = 0; r < I; ++r) {
            double g = 0.0, u = 0.0;
            const float* gr = gu.data() + (static_cast<size_t>(e) * 2 * I + r) * H;
            const float* ur = gu.data() + (static_cast<size_t>(e) * 2 * I + I + r) * H;
            for (int i = 0; i < H; ++i) {
              g += gr[i] * x[i];
              u += ur[i] * x[i];
            }
            a[r] = Silu(g) * u;
          }
          for (int r = 0; r < H; ++r) {
            const float* dr = dn.data() + (static_cast<size_t>(e) * H + r) * I;
            double d = 0.0;
            for (int i = 0; i < I; ++i) d += dr[i] * a[i];
            out[r] += rw * d;
          }
        }
        if (c.shared_expert_intermediate_size > 0) {
          const Vec s = Mlp(lw.shared_gate_proj, lw.shared_up_proj, lw.shared_down_proj, x);
          const double g = 1.0 / (1.0 + std::exp(-MatVec(lw.shared_expert_gate, x)[0]));
          for (int i = 0; i < H; ++i) out[i] += g * s[i];
        }
      } else {
        out = Mlp(lw.mlp_gate_proj, lw.mlp_up_proj, lw.mlp_down_proj, x);
      }
      for (int i = 0; i < H; ++i) h[t][i] += out[i];
    }
  }
  const Tensor& head = w.lm_head.empty() ? w.embed_tokens : w.lm_head;
  std::vector<double> logits;
  logits.reserve(static_cast<size_t>(T) * c.vocab_size);
  for (int t = 0; t < T; ++t) {
    const Vec x = RmsNorm(h[t], w.final_norm, c.rms_norm_eps);
    const Vec l = MatVec(head, x);
    logits.insert(logits.end(), l.begin(), l.end());
  }
  return logits;
}

}  // namespace moe::engine
