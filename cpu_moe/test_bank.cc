#include "cpu_moe/test_bank.h"

#include <immintrin.h>

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

namespace {

// One fp16 ulp at v (an fp16 value).
double F16Ulp(double v) {
  int ex;
  std::frexp(v == 0 ? 1e-30 : v, &ex);
  return std::ldexp(1.0, std::max(ex - 1, -14) - 10);
}

// The fp16 emulation below runs only where the fp16 kernels ran, i.e. on CPUs with AVX512-FP16,
// whose scalar fp16 instructions round exactly as one lane of the kernels' vectors does.
#define MOE_TEST_FP16 __attribute__((target("avx512fp16")))

// Fp8F16Prepare (internal/fp8_fp16-inl.h) in scalar code: xp[c] = fp16(float(x[c] * f_b)), f_b
// the block scale times 2^(10 - e), with the same float operations; returns e.
MOE_TEST_FP16 int EmulateF16Prepare(const float* x, const float* srow, size_t k,
                                    std::vector<double>* xp, std::vector<double>* f) {
  constexpr size_t kB = common::kFp8BlockSize;
  const size_t bcols = (k + kB - 1) / kB;
  float mx = 0.0f;
  bool special = false;
  for (size_t b = 0; b < bcols; ++b) {
    float xm = 0.0f;
    bool nan = false;
    for (size_t c = b * kB; c < std::min(k, (b + 1) * kB); ++c) {
      nan |= std::isnan(x[c]);
      xm = std::max(xm, std::fabs(x[c]));
    }
    const float v = (nan ? std::numeric_limits<float>::quiet_NaN() : xm) * std::fabs(srow[b]);
    special |= !(v <= std::numeric_limits<float>::max());
    mx = std::max(mx, v);
  }
  int e = 10;
  if (!special && mx > 0.0f) std::frexp(mx, &e);
  xp->assign(k, 0.0);
  f->assign(k, 0.0);
  for (size_t c = 0; c < k; ++c) {
    const double lim = std::numeric_limits<float>::max();
    const float fb = static_cast<float>(
        std::max(-lim, std::min(lim, std::ldexp(static_cast<double>(srow[c / kB]), 10 - e))));
    (*f)[c] = fb;
    (*xp)[c] = static_cast<double>(static_cast<_Float16>(x[c] * fb));
  }
  return e;
}

// Fp8F16Rows' dot of the e4m3 row w (k columns) with the prepared activations xp, before its
// 2^(e - 2): each of 32 fp16 lanes adds its products in the kernel's order (lane L takes columns
// 16 (L / 8) + L % 8, then + 8, of each 64-column chunk) with one rounding per FMA over 256
// columns, lanes L and L + 16 are then added in fp16 and the 16 results summed (here exactly;
// the kernel in fp32). *lane_abs: the largest sum of |products| of one lane over 256 columns.
MOE_TEST_FP16 double EmulateF16Dot(const uint8_t* w, const std::vector<double>& xp, size_t k,
                                   double* lane_abs) {
  double total = 0.0, labs = 0.0;
  for (size_t c0 = 0; c0 < k; c0 += 256) {
    __m128h acc[32];
    double ab[32] = {};
    for (__m128h& v : acc) v = _mm_setzero_ph();
    for (size_t c = c0; c < std::min(k, c0 + 256); c += 64) {
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 32; ++l) {
          const size_t col = c + 16 * (l / 8) + 8 * half + l % 8;
          if (col >= k) continue;
          const float wv = common::Fp8E4M3ToFloat(w[col]) / 256.0f;  // exact, and in fp16
          acc[l] = _mm_fmadd_sh(_mm_set_sh(static_cast<_Float16>(wv)),
                                _mm_set_sh(static_cast<_Float16>(xp[col])), acc[l]);
          ab[l] += std::fabs(static_cast<double>(wv) * xp[col]);
        }
      }
    }
    for (int l = 0; l < 16; ++l) {
      total += static_cast<double>(_mm_cvtsh_h(_mm_add_sh(acc[l], acc[l + 16])));
    }
    for (int l = 0; l < 32; ++l) labs = std::max(labs, ab[l]);
  }
  *lane_abs = labs;
  return total;
}
#undef MOE_TEST_FP16

}  // namespace

void ReferenceForward(const HostBank& hb, int num_tokens, int top_k,
                      const std::vector<int32_t>& ids, const std::vector<float>& weights,
                      const std::vector<float>& x, const Options& options,
                      bool emulate_act_quant, std::vector<double>* y,
                      std::vector<double>* abs_scale, std::vector<double>* flip,
                      const internal::Tuning& tuning) {
  const ExpertBank& b = hb.bank;
  const size_t H = b.hidden, I = b.intermediate;
  constexpr size_t kB = common::kFp8BlockSize;
  const bool quant = emulate_act_quant && IsQuant(b.format);
  const bool fp16 = tuning.fp8_fp16 && b.format == WeightFormat::kFp8Block;
  const bool bf16_round = emulate_act_quant && options.bf16_dot_product && !fp16 &&
                          (b.format == WeightFormat::kBf16 || b.format == WeightFormat::kFp8Block);
  // fp16 runs: the experts that went through AMX instead (bf16-rounded activations), by the
  // kernels' rule: tuning.amx (ForwardStats::amx of the run) and at least amx_min_routes
  // routes in the call's group of the expert (one route per group without dedup).
  std::vector<int> routes_of(b.num_experts, 0);
  int valid = 0, unique = 0;
  for (int32_t e : ids) {
    if (e < 0) continue;
    ++valid;
    unique += routes_of[e]++ == 0;
  }
  const bool grouped = options.dedup && unique < valid;
  const int amx_min =
      tuning.amx_min_routes == internal::Tuning::kAuto ? 5 : tuning.amx_min_routes;
  auto via_amx = [&](int e) {
    return fp16 && tuning.amx && amx_min > 0 && (grouped ? routes_of[e] : 1) >= amx_min;
  };
  y->assign(num_tokens * H, 0.0);
  abs_scale->assign(num_tokens * H, 0.0);
  flip->assign(num_tokens * H, 0.0);
  std::vector<double> xq(H), xb(H), h(I), hstep(I, 0.0), xp, f;
  std::vector<float> hf(I);
  const float* gus = reinterpret_cast<const float*>(hb.gate_up_s.data());
  const float* dns = reinterpret_cast<const float*>(hb.down_s.data());
  for (int t = 0; t < num_tokens; ++t) {
    const float* xt = x.data() + t * H;
    if (quant) {
      EmulateActQuant(xt, H, xq.data(), nullptr);
    } else if (bf16_round) {
      EmulateActBf16(xt, H, xq.data(), nullptr);
    } else {
      for (size_t i = 0; i < H; ++i) xq[i] = xt[i];
    }
    if (fp16) EmulateActBf16(xt, H, xb.data(), nullptr);  // for experts through AMX
    for (int j = 0; j < top_k; ++j) {
      const int e = ids[t * top_k + j];
      if (e < 0) continue;
      const double w = weights[t * top_k + j];
      const bool amx16 = via_amx(e);       // fp16 run, this expert through AMX
      const bool f16 = fp16 && !amx16;     // this expert through the fp16 kernels
      const double* xe = amx16 ? xb.data() : xq.data();
      const float* gu = hb.gate_up_f.data() + static_cast<size_t>(e) * 2 * I * H;
      // fp16: gate and up rows by emulating the kernels, activations prepared per scale block.
      const size_t bcols_h = (H + kB - 1) / kB, brows_gu = (2 * I + kB - 1) / kB;
      const uint8_t* guw = hb.gate_up_w.data() + static_cast<size_t>(e) * 2 * I * H;
      size_t prepared_rb = SIZE_MAX;  // the scale block whose activations xp holds
      int prepared_e = 0;
      auto f16_row = [&](size_t r) {
        const size_t rb = r / kB;
        if (rb != prepared_rb) {
          prepared_rb = rb;
          prepared_e = EmulateF16Prepare(xt, gus + (e * brows_gu + rb) * bcols_h, H, &xp, &f);
        }
        double labs;
        return std::ldexp(EmulateF16Dot(guw + r * H, xp, H, &labs), prepared_e - 2);
      };
      for (size_t r = 0; r < I; ++r) {
        double g = 0;
        if (f16) {
          g = f16_row(r);
        } else {
          for (size_t c = 0; c < H; ++c) g += static_cast<double>(gu[r * H + c]) * xe[c];
        }
        h[r] = g;
      }
      for (size_t r = 0; r < I; ++r) {
        const double g = h[r];
        double u = 0;
        if (f16) {
          u = f16_row(I + r);
        } else {
          for (size_t c = 0; c < H; ++c) u += static_cast<double>(gu[(I + r) * H + c]) * xe[c];
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
      std::fill(hstep.begin(), hstep.end(), 0.0);
      if (quant) EmulateActQuant(hf.data(), I, h.data(), hstep.data());
      if (bf16_round || amx16) EmulateActBf16(hf.data(), I, h.data(), hstep.data());
      if (f16) {
        for (size_t c = 0; c < I; ++c) h[c] = hf[c];
      }
      const float* dn = hb.down_f.data() + static_cast<size_t>(e) * H * I;
      const uint8_t* dnw = hb.down_w.data() + static_cast<size_t>(e) * H * I;
      const size_t bcols_i = (I + kB - 1) / kB, brows_d = (H + kB - 1) / kB;
      int pe = 0;
      for (size_t r = 0; r < H; ++r) {
        double s = 0, a = 0, mx = 0;
        if (f16 && r % kB == 0) {
          pe = EmulateF16Prepare(hf.data(), dns + (e * brows_d + r / kB) * bcols_i, I, &xp, &f);
        }
        for (size_t c = 0; c < I; ++c) {
          const double d = dn[r * I + c];
          s += d * h[c];
          a += std::fabs(d * h[c]);
          mx = std::max(mx, std::fabs(d) * hstep[c]);
        }
        if (f16) {
          // What one fp16 rounding flip of h (the kernel's fp32 h against this float64 one) can
          // move the dot by: the flipped product, and one ulp of the lane's partial sums for each
          // of its later roundings (at most 8 FMAs and the fold).
          double labs, fl = 0;
          s = std::ldexp(EmulateF16Dot(dnw + r * I, xp, I, &labs), pe - 2);
          for (size_t c = 0; c < I; ++c) {
            fl = std::max(fl, std::fabs(common::Fp8E4M3ToFloat(dnw[r * I + c]) / 256.0) *
                                  F16Ulp(xp[c]));
          }
          mx = std::ldexp(fl + 10.0 * std::ldexp(labs, -10), pe - 2);
        }
        (*y)[t * H + r] += w * s;
        (*abs_scale)[t * H + r] += std::fabs(w) * a;
        (*flip)[t * H + r] += std::fabs(w) * mx;
      }
    }
  }
}

}  // namespace moe::cpu_moe::testing
