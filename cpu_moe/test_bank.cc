#include "cpu_moe/test_bank.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "common/formats.h"

namespace moe::cpu_moe::testing {

double RelFrobenius(const std::vector<float>& y, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    num += (y[i] - ref[i]) * (y[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

Routing MakeRouting(int T, int E, int k, double skew_exponent, std::mt19937_64& rng) {
  Routing r;
  std::vector<double> p(E);
  for (int e = 0; e < E; ++e) {
    p[e] = skew_exponent > 0 ? 1.0 / std::pow(e + 1.0, skew_exponent) : 1.0;
  }
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int t = 0; t < T; ++t) {
    std::vector<double> q = p;
    for (int j = 0; j < k; ++j) {
      std::discrete_distribution<int> d(q.begin(), q.end());
      const int e = d(rng);
      q[e] = 0.0;
      r.ids.push_back(e);
      r.weights.push_back(uw(rng));
    }
  }
  return r;
}


namespace {

using common::WeightFormat;

bool IsQuant(WeightFormat f) {
  return f == WeightFormat::kQ4_0 || f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4;
}

// Quantizes one [rows, cols] expert matrix m into the format's storage at expert index e.
void QuantizeMatrix(WeightFormat f, const float* m, size_t rows, size_t cols, size_t e,
                    std::vector<uint8_t>& w, std::vector<uint8_t>& s, std::vector<float>& g,
                    float* deq) {
  const size_t n = rows * cols;
  switch (f) {
    case WeightFormat::kBf16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(w.data()) + e * n;
      for (size_t i = 0; i < n; ++i) o[i] = common::FloatToBf16(m[i]);
      if (deq) for (size_t i = 0; i < n; ++i) deq[i] = common::Bf16ToFloat(o[i]);
      break;
    }
    case WeightFormat::kFp8Block: {
      const size_t bs = common::kFp8BlockSize;
      const size_t ns = ((rows + bs - 1) / bs) * ((cols + bs - 1) / bs);
      uint8_t* q = w.data() + e * n;
      float* sc = reinterpret_cast<float*>(s.data()) + e * ns;
      common::QuantizeFp8Block(m, rows, cols, q, sc);
      if (deq) common::DequantizeFp8Block(q, sc, rows, cols, deq);
      break;
    }
    case WeightFormat::kQ4_0: {
      auto* b = reinterpret_cast<common::BlockQ4_0*>(w.data()) + e * (n / 32);
      common::QuantizeRowQ4_0(m, n, b);
      if (deq) common::DequantizeRowQ4_0(b, n, deq);
      break;
    }
    case WeightFormat::kMxfp4: {
      uint8_t* p = w.data() + e * (n / 2);
      uint8_t* sc = s.data() + e * (n / 32);
      common::QuantizeRowMxfp4(m, n, p, sc);
      if (deq) common::DequantizeRowMxfp4(p, sc, n, deq);
      break;
    }
    case WeightFormat::kNvfp4: {
      uint8_t* p = w.data() + e * (n / 2);
      uint8_t* sc = s.data() + e * (n / 16);
      g[e] = common::Nvfp4GlobalScale(m, n);
      common::QuantizeRowNvfp4(m, n, g[e], p, sc);
      if (deq) common::DequantizeRowNvfp4(p, sc, g[e], n, deq);
      break;
    }
  }
}

void Allocate(WeightFormat f, size_t num_experts, size_t rows, size_t cols,
              std::vector<uint8_t>& w, std::vector<uint8_t>& s, std::vector<float>& g) {
  const size_t n = rows * cols;
  switch (f) {
    case WeightFormat::kBf16: w.resize(num_experts * n * 2); break;
    case WeightFormat::kFp8Block: {
      const size_t bs = common::kFp8BlockSize;
      w.resize(num_experts * n);
      s.resize(num_experts * ((rows + bs - 1) / bs) * ((cols + bs - 1) / bs) * sizeof(float));
      break;
    }
    case WeightFormat::kQ4_0: w.resize(num_experts * (n / 32) * sizeof(common::BlockQ4_0)); break;
    case WeightFormat::kMxfp4:
      w.resize(num_experts * n / 2);
      s.resize(num_experts * n / 32);
      break;
    case WeightFormat::kNvfp4:
      w.resize(num_experts * n / 2);
      s.resize(num_experts * n / 16);
      g.resize(num_experts);
      break;
  }
}

}  // namespace

HostBank MakeRandomBank(WeightFormat format, int num_experts, int hidden, int intermediate,
                        uint64_t seed, bool keep_float) {
  HostBank hb;
  const size_t E = num_experts, H = hidden, I = intermediate;
  Allocate(format, E, 2 * I, H, hb.gate_up_w, hb.gate_up_s, hb.gate_up_g);
  Allocate(format, E, H, I, hb.down_w, hb.down_s, hb.down_g);
  if (keep_float) {
    hb.gate_up_f.resize(E * 2 * I * H);
    hb.down_f.resize(E * H * I);
  }
  std::mt19937_64 rng(seed);
  std::vector<float> m(std::max(2 * I * H, H * I));
  for (size_t e = 0; e < E; ++e) {
    const float a1 = std::sqrt(3.0f / H), a2 = std::sqrt(3.0f / I);
    std::uniform_real_distribution<float> u1(-a1, a1), u2(-a2, a2);
    for (size_t i = 0; i < 2 * I * H; ++i) m[i] = u1(rng);
    QuantizeMatrix(format, m.data(), 2 * I, H, e, hb.gate_up_w, hb.gate_up_s, hb.gate_up_g,
                   keep_float ? hb.gate_up_f.data() + e * 2 * I * H : nullptr);
    for (size_t i = 0; i < H * I; ++i) m[i] = u2(rng);
    QuantizeMatrix(format, m.data(), H, I, e, hb.down_w, hb.down_s, hb.down_g,
                   keep_float ? hb.down_f.data() + e * H * I : nullptr);
  }
  ExpertBank& b = hb.bank;
  b.format = format;
  b.num_experts = num_experts;
  b.hidden = hidden;
  b.intermediate = intermediate;
  b.gate_up_weights = hb.gate_up_w.data();
  b.gate_up_scales = hb.gate_up_s.empty() ? nullptr : hb.gate_up_s.data();
  b.gate_up_global_scales = hb.gate_up_g.empty() ? nullptr : hb.gate_up_g.data();
  b.down_weights = hb.down_w.data();
  b.down_scales = hb.down_s.empty() ? nullptr : hb.down_s.data();
  b.down_global_scales = hb.down_g.empty() ? nullptr : hb.down_g.data();
  return hb;
}

void EmulateActQuant(const float* x, size_t n, double* out, double* step) {
  for (size_t b = 0; b < n / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; ++j) {
      const float q = std::nearbyint(std::min(127.0f, std::max(-127.0f, xb[j] * inv)));
      out[32 * b + j] = static_cast<double>(q) * d;
      if (step) step[32 * b + j] = d;
    }
  }
}

void EmulateActBf16(const float* x, size_t n, double* out, double* step) {
  for (size_t i = 0; i < n; ++i) {
    const float r = common::Bf16ToFloat(common::FloatToBf16(x[i]));
    const bool denormal = r != 0.0f && std::fabs(r) < std::numeric_limits<float>::min();
    out[i] = denormal ? 0.0 : r;
    int e = 0;
    std::frexp(r, &e);  // |r| in [2^(e-1), 2^e): bf16's 8 significant bits give ulp 2^(e-8)
    if (step) step[i] = r == 0.0f ? 0.0 : std::ldexp(1.0, e - 8);
  }
}

void ReferenceForward(const HostBank& hb, int num_tokens, int top_k,
                      const std::vector<int32_t>& ids, const std::vector<float>& weights,
                      const std::vector<float>& x, const Options& options,
                      bool emulate_act_quant, std::vector<double>* y,
                      std::vector<double>* abs_scale, std::vector<double>* flip) {
  const ExpertBank& b = hb.bank;
  const size_t H = b.hidden, I = b.intermediate;
  const bool quant = emulate_act_quant && IsQuant(b.format);
  const bool bf16_round = emulate_act_quant && options.bf16_dot_product &&
                          (b.format == WeightFormat::kBf16 || b.format == WeightFormat::kFp8Block);
  y->assign(num_tokens * H, 0.0);
  abs_scale->assign(num_tokens * H, 0.0);
  flip->assign(num_tokens * H, 0.0);
  std::vector<double> xq(H), h(I), hstep(I, 0.0);
  std::vector<float> hf(I);
  for (int t = 0; t < num_tokens; ++t) {
    const float* xt = x.data() + t * H;
    if (quant) {
      EmulateActQuant(xt, H, xq.data(), nullptr);
    } else if (bf16_round) {
      EmulateActBf16(xt, H, xq.data(), nullptr);
    } else {
      for (size_t i = 0; i < H; ++i) xq[i] = xt[i];
    }
    for (int j = 0; j < top_k; ++j) {
      const int e = ids[t * top_k + j];
      if (e < 0) continue;
      const double w = weights[t * top_k + j];
      const float* gu = hb.gate_up_f.data() + static_cast<size_t>(e) * 2 * I * H;
      for (size_t r = 0; r < I; ++r) {
        double g = 0, u = 0;
        for (size_t c = 0; c < H; ++c) {
          g += static_cast<double>(gu[r * H + c]) * xq[c];
          u += static_cast<double>(gu[(I + r) * H + c]) * xq[c];
        }
        double v;
        if (options.activation == Activation::kSwiGlu) {
          v = g / (1.0 + std::exp(-g)) * u;
        } else {
          const double lim = options.swiglu_limit;
          const double gc = std::min(g, lim), uc = std::min(std::max(u, -lim), lim);
          v = gc / (1.0 + std::exp(-options.swiglu_alpha * gc)) * (uc + 1.0);
        }
        h[r] = v;
        hf[r] = static_cast<float>(v);
      }
      if (quant) EmulateActQuant(hf.data(), I, h.data(), hstep.data());
      if (bf16_round) EmulateActBf16(hf.data(), I, h.data(), hstep.data());
      const float* dn = hb.down_f.data() + static_cast<size_t>(e) * H * I;
      for (size_t r = 0; r < H; ++r) {
        double s = 0, a = 0, mx = 0;
        for (size_t c = 0; c < I; ++c) {
          const double d = dn[r * I + c];
          s += d * h[c];
          a += std::fabs(d * h[c]);
          mx = std::max(mx, std::fabs(d) * hstep[c]);
        }
        (*y)[t * H + r] += w * s;
        (*abs_scale)[t * H + r] += std::fabs(w) * a;
        (*flip)[t * H + r] += std::fabs(w) * mx;
      }
    }
  }
}

}  // namespace moe::cpu_moe::testing
