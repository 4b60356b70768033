#include "engine/gated_delta_net.h"

#include <algorithm>
#include <cmath>

namespace moe::engine {
namespace {

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

void CausalConvSilu(const float* x, int64_t x_stride, int n, int channels, int kernel,
                    const float* weight, float* state, float* out) {
  const int hist = kernel - 1;
  // Input row s of the chunk (s < 0: from the state).
  auto in = [&](int s) { return s >= 0 ? x + s * x_stride : state + (hist + s) * channels; };
  for (int t = 0; t < n; ++t) {
    float* o = out + static_cast<int64_t>(t) * channels;
    std::fill(o, o + channels, 0.0f);
    for (int j = 0; j < kernel; ++j) {
      const float* row = in(t - hist + j);
      const float* w = weight + static_cast<int64_t>(j) * channels;
      for (int c = 0; c < channels; ++c) o[c] += w[c] * row[c];
    }
    for (int c = 0; c < channels; ++c) o[c] = Silu(o[c]);
  }
  // The new state: inputs n - hist .. n - 1, which reach back into the old state when n < hist
  // (its rows move up by n, reading ahead of what they overwrite).
  const int keep = std::max(hist - n, 0);
  for (int i = 0; i < keep; ++i) {
    std::copy_n(state + static_cast<int64_t>(i + n) * channels, channels,
                state + static_cast<int64_t>(i) * channels);
  }
  for (int i = keep; i < hist; ++i) {
    std::copy_n(x + (n - hist + i) * x_stride, channels,
                state + static_cast<int64_t>(i) * channels);
  }
}

void DeltaRuleRecurrent(const DeltaRuleArgs& a, float* scratch) {
  const int dk = a.key_dim, dv = a.value_dim;
  float* S = a.state;
  float* kv = scratch;
  for (int t = 0; t < a.n; ++t) {
    const float* q = a.q + t * a.qk_stride;
    const float* k = a.k + t * a.qk_stride;
    const float* v = a.v + t * a.v_stride;
    const float decay = std::exp(a.g[t * a.gb_stride]);
    const float beta = a.beta[t * a.gb_stride];
    // S <- decay S; kv = S^T k.
    std::fill(kv, kv + dv, 0.0f);
    for (int r = 0; r < dk; ++r) {
      float* s = S + static_cast<int64_t>(r) * dv;
      for (int c = 0; c < dv; ++c) {
        s[c] *= decay;
        kv[c] += s[c] * k[r];
      }
    }
    // delta = beta (v - kv); S += k delta^T; o = S^T q.
    for (int c = 0; c < dv; ++c) kv[c] = (v[c] - kv[c]) * beta;
    float* o = a.out + t * a.out_stride;
    std::fill(o, o + dv, 0.0f);
    for (int r = 0; r < dk; ++r) {
      float* s = S + static_cast<int64_t>(r) * dv;
      for (int c = 0; c < dv; ++c) {
        s[c] += k[r] * kv[c];
        o[c] += s[c] * q[r];
      }
    }
  }
}

size_t DeltaRuleChunkedScratch(int chunk, int key_dim, int value_dim) {
  const size_t m = chunk;
  // gc, decays, A [m, m], U [m, dv], W [m, dk], qk [m, m].
  return 2 * m + 2 * m * m + m * value_dim + m * key_dim;
}

void DeltaRuleChunked(const DeltaRuleArgs& a, int chunk, float* scratch) {
  const int dk = a.key_dim, dv = a.value_dim;
  float* S = a.state;
  float* gc = scratch;      // [chunk] cumulative log decay
  float* egc = gc + chunk;  // [chunk] exp(gc)
  float* A = egc + chunk;   // [chunk, chunk] strictly lower: beta_i (k_i . k_j) exp(gc_i - gc_j)
  float* QK = A + static_cast<size_t>(chunk) * chunk;  // [chunk, chunk] (q_i . k_j) exp(...)
  float* U = QK + static_cast<size_t>(chunk) * chunk;  // [chunk, dv] new values, then v_new
  float* W = U + static_cast<size_t>(chunk) * dv;      // [chunk, dk] decayed keys read of S
  for (int t0 = 0; t0 < a.n; t0 += chunk) {
    const int m = std::min(chunk, a.n - t0);
    auto q = [&](int i) { return a.q + (t0 + i) * a.qk_stride; };
    auto k = [&](int i) { return a.k + (t0 + i) * a.qk_stride; };
    auto v = [&](int i) { return a.v + (t0 + i) * a.v_stride; };
    auto beta = [&](int i) { return a.beta[(t0 + i) * a.gb_stride]; };
    float acc = 0.0f;
    for (int i = 0; i < m; ++i) {
      acc += a.g[(t0 + i) * a.gb_stride];
      gc[i] = acc;
      egc[i] = std::exp(acc);
    }
    // Pairwise terms (j <= i) of the UT system and of the intra-chunk attention.
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j <= i; ++j) {
        float kk = 0.0f, qk = 0.0f;
        for (int r = 0; r < dk; ++r) {
          kk += k(i)[r] * k(j)[r];
          qk += q(i)[r] * k(j)[r];
        }
        const float d = std::exp(gc[i] - gc[j]);
        A[i * chunk + j] = beta(i) * kk * d;
        QK[i * chunk + j] = qk * d;
      }
    }
    // (I + strictly_lower(A)) U = beta v and (I + strictly_lower(A)) W = beta exp(gc) k, by
    // forward substitution (transformers: solve_triangular(..., unitriangular=True)).
    for (int i = 0; i < m; ++i) {
      float* u = U + static_cast<size_t>(i) * dv;
      float* w = W + static_cast<size_t>(i) * dk;
      for (int c = 0; c < dv; ++c) u[c] = beta(i) * v(i)[c];
      for (int r = 0; r < dk; ++r) w[r] = beta(i) * egc[i] * k(i)[r];
      for (int j = 0; j < i; ++j) {
        const float aij = A[i * chunk + j];
        const float* uj = U + static_cast<size_t>(j) * dv;
        const float* wj = W + static_cast<size_t>(j) * dk;
        for (int c = 0; c < dv; ++c) u[c] -= aij * uj[c];
        for (int r = 0; r < dk; ++r) w[r] -= aij * wj[r];
      }
    }
    // v_new = U - W S (in U); out = exp(gc) q^T S + sum_{j <= i} QK[i, j] v_new[j].
    for (int i = 0; i < m; ++i) {
      float* u = U + static_cast<size_t>(i) * dv;
      const float* w = W + static_cast<size_t>(i) * dk;
      float* o = a.out + (t0 + i) * a.out_stride;
      std::fill(o, o + dv, 0.0f);
      for (int r = 0; r < dk; ++r) {
        const float* s = S + static_cast<int64_t>(r) * dv;
        const float wr = w[r], qr = q(i)[r] * egc[i];
        for (int c = 0; c < dv; ++c) {
          u[c] -= wr * s[c];
          o[c] += qr * s[c];
        }
      }
    }
    for (int i = 0; i < m; ++i) {
      float* o = a.out + (t0 + i) * a.out_stride;
      for (int j = 0; j <= i; ++j) {
        const float qk = QK[i * chunk + j];
        const float* u = U + static_cast<size_t>(j) * dv;
        for (int c = 0; c < dv; ++c) o[c] += qk * u[c];
      }
    }
    // S <- exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j v_new_j^T.
    const float last = gc[m - 1], elast = egc[m - 1];
    for (int r = 0; r < dk; ++r) {
      float* s = S + static_cast<int64_t>(r) * dv;
      for (int c = 0; c < dv; ++c) s[c] *= elast;
    }
    for (int j = 0; j < m; ++j) {
      const float d = std::exp(last - gc[j]);
      const float* u = U + static_cast<size_t>(j) * dv;
      for (int r = 0; r < dk; ++r) {
        float* s = S + static_cast<int64_t>(r) * dv;
        const float kr = k(j)[r] * d;
        for (int c = 0; c < dv; ++c) s[c] += kr * u[c];
      }
    }
  }
}

}  // namespace moe::engine
