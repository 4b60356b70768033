// One core, weights in L2: fp8 e4m3 rows dotted against NT activations by the library's two
// AVX3_DL kernels' inner loops, side by side (session 12):
//   table: the table decode (two vpermi2b per 64 codes) into bf16, vdpbf16ps, a scale FMA per
//          128-column block (Fp8DotRowsBf16);
//   f16/N: e4m3 -> fp16 by an interleave, a shift and an AND, vfmadd231ph into fp16 lanes that
//          are folded and added into fp32 every N 128-column blocks (Fp8F16Rows takes N = 2;
//          its activations carry the block scale);
//   f16s:  the same with the block scale applied at each block's flush instead (one more
//          multiply per block and route).
// Prints ns per 64 codes and row at NT = 1, 2, 4 and each kernel's largest error against a
// float64 dot over the sum of |terms| (all kernels see the same codes and activations; the
// fp16 activations are the bf16 ones converted, so the inputs agree exactly).
// Also the issue rate of vfmadd231ph against vdpbf16ps (12 independent chains).
// Build: tools/bazel build --config=opt //cpu_moe:fp16_dot_probe
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include "common/formats.h"

namespace {

constexpr int kK = 2048, kRows = 64, kNtMax = 4;
alignas(64) uint8_t g_w[kRows * kK];
alignas(64) uint16_t g_xb[kNtMax][kK];  // bf16 activations, table order (see Pos)
alignas(64) uint16_t g_xh[kNtMax][kK];  // fp16, the same values
float g_scale[kK / 128];
float g_out[kRows][kNtMax];

// Sum of the 16 lanes (stored and added in order; GCC 12's _mm512_reduce_add_ps trips
// -Werror=uninitialized in its own header).
float Sum(__m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0;
  for (float x : t) s += x;
  return s;
}

// Column jj of a 64-column chunk -> its position in both decodes' order.
int Pos(int jj) { return 32 * ((jj >> 3) & 1) + 8 * (jj >> 4) + (jj & 7); }

struct Lut {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
} g_lut;

void InitLut() {
  for (int m = 0; m < 128; ++m) {
    const int e = m >> 3, f = m & 7;
    int b = 0;
    if (m == 0x7F) {
      b = 0x7FC0;
    } else if (e != 0) {
      b = (e + 120) << 7 | f << 4;
    } else if (f != 0) {
      const int p = f >= 4 ? 2 : f >= 2 ? 1 : 0;
      b = (118 + p) << 7 | (f - (1 << p)) << (7 - p);
    }
    g_lut.lo[m] = b & 0xFF;
    g_lut.hi[m] = b >> 8;
  }
}

template <int NT>
__attribute__((noinline)) void Table() {
  const __m512i lo0 = _mm512_load_si512(g_lut.lo), lo1 = _mm512_load_si512(g_lut.lo + 64);
  const __m512i hi0 = _mm512_load_si512(g_lut.hi), hi1 = _mm512_load_si512(g_lut.hi + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int r = 0; r < kRows; r += 2) {
    __m512 tot[2][NT];
    for (auto& a : tot) for (auto& v : a) v = _mm512_setzero_ps();
    for (int c0 = 0; c0 < kK; c0 += 128) {
      __m512 acc[2][NT];
      for (auto& a : acc) for (auto& v : a) v = _mm512_setzero_ps();
      for (int c = c0; c < c0 + 128; c += 64) {
        __m512i wv[2][2];
        for (int a = 0; a < 2; ++a) {
          const __m512i code = _mm512_loadu_si512(g_w + (r + a) * kK + c);
          const __m512i l = _mm512_permutex2var_epi8(lo0, code, lo1);
          const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, code, hi1),
                                                      code, sign, 0xF8);
          wv[a][0] = _mm512_unpacklo_epi8(l, h);
          wv[a][1] = _mm512_unpackhi_epi8(l, h);
        }
        for (int t = 0; t < NT; ++t) {
          const __m512i x0 = _mm512_load_si512(g_xb[t] + c);
          const __m512i x1 = _mm512_load_si512(g_xb[t] + c + 32);
          for (int a = 0; a < 2; ++a) {
            acc[a][t] = _mm512_dpbf16_ps(acc[a][t], (__m512bh)wv[a][0], (__m512bh)x0);
            acc[a][t] = _mm512_dpbf16_ps(acc[a][t], (__m512bh)wv[a][1], (__m512bh)x1);
          }
        }
      }
      const __m512 s = _mm512_set1_ps(g_scale[c0 / 128]);
      for (int a = 0; a < 2; ++a) {
        for (int t = 0; t < NT; ++t) tot[a][t] = _mm512_fmadd_ps(acc[a][t], s, tot[a][t]);
      }
    }
    for (int a = 0; a < 2; ++a) {
      for (int t = 0; t < NT; ++t) g_out[r + a][t] = Sum(tot[a][t]);
    }
  }
}

// kScaleAtFlush: f16s (FL must be 1); otherwise the block scale is in the activations (here:
// all blocks share one scale, applied at the end). kGfni: the decode by two GF(2) affine byte
// transforms (the fp16's high and low byte of each code) and two interleaves, instead of two
// interleaves, two shifts and two ANDs (the same bits for all 256 codes).
template <int NT, int FL, bool kScaleAtFlush, bool kGfni = false>
__attribute__((noinline)) void F16() {
  const __m512i z = _mm512_setzero_si512(), keep = _mm512_set1_epi16(static_cast<short>(0xBFFF));
  // Rows of the affine matrices (byte 7 - i: the input bits whose parity is output bit i): high
  // byte s 0 e3 e2 e1 e0 m2 m1 (bit 7 from bit 7, bits 5..0 from bits 6..1); low byte m0 << 7.
  const __m512i hmat = _mm512_set1_epi64(0x0204081020400080LL);
  const __m512i lmat = _mm512_set1_epi64(0x0000000000000001LL);
  for (int r = 0; r < kRows; r += 2) {
    __m512 tot[2][NT];
    for (auto& a : tot) for (auto& v : a) v = _mm512_setzero_ps();
    for (int c0 = 0; c0 < kK; c0 += 128 * FL) {
      __m512h acc[2][NT];
      for (auto& a : acc) for (auto& v : a) v = _mm512_setzero_ph();
      for (int c = c0; c < c0 + 128 * FL; c += 64) {
        __m512h wv[2][2];
        for (int a = 0; a < 2; ++a) {
          const __m512i code = _mm512_loadu_si512(g_w + (r + a) * kK + c);
          if (kGfni) {
            const __m512i hb = _mm512_gf2p8affine_epi64_epi8(code, hmat, 0);
            const __m512i lb = _mm512_gf2p8affine_epi64_epi8(code, lmat, 0);
            wv[a][0] = _mm512_castsi512_ph(_mm512_unpacklo_epi8(lb, hb));
            wv[a][1] = _mm512_castsi512_ph(_mm512_unpackhi_epi8(lb, hb));
          } else {
            wv[a][0] = _mm512_castsi512_ph(
                _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(z, code), 1), keep));
            wv[a][1] = _mm512_castsi512_ph(
                _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(z, code), 1), keep));
          }
        }
        for (int t = 0; t < NT; ++t) {
          const __m512h x0 = _mm512_castsi512_ph(_mm512_load_si512(g_xh[t] + c));
          const __m512h x1 = _mm512_castsi512_ph(_mm512_load_si512(g_xh[t] + c + 32));
          for (int a = 0; a < 2; ++a) {
            acc[a][t] = _mm512_fmadd_ph(wv[a][0], x0, acc[a][t]);
            acc[a][t] = _mm512_fmadd_ph(wv[a][1], x1, acc[a][t]);
          }
        }
      }
      for (int a = 0; a < 2; ++a) {
        for (int t = 0; t < NT; ++t) {
          const __m256h f = _mm256_add_ph(
              _mm512_castph512_ph256(acc[a][t]),
              _mm256_castsi256_ph(
                  _mm512_maskz_extracti64x4_epi64(0xFF, _mm512_castph_si512(acc[a][t]), 1)));
          const __m512 v = _mm512_cvtxph_ps(f);
          const __m512 s = _mm512_set1_ps(256.0f * g_scale[c0 / 128]);
          tot[a][t] =
              kScaleAtFlush ? _mm512_fmadd_ps(v, s, tot[a][t]) : _mm512_add_ps(tot[a][t], v);
        }
      }
    }
    for (int a = 0; a < 2; ++a) {
      for (int t = 0; t < NT; ++t) {
        g_out[r + a][t] =
            Sum(tot[a][t]) * (kScaleAtFlush ? 1.0f : 256.0f * g_scale[0]);
      }
    }
  }
}

// Best of 7 rounds of 200 calls: ns per 64 codes and row.
template <class F>
double Time(F f) {
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) f();
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ns / 200);
  }
  return best / (kRows * kK / 64.0);
}

// Largest |out - exact| / sum |terms| over rows and activations.
double Error(int nt) {
  double worst = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < nt; ++t) {
      double s = 0, a = 0;
      for (int c = 0; c < kK; ++c) {
        const int pos = c / 64 * 64 + Pos(c % 64);
        const double v = static_cast<double>(moe::common::Fp8E4M3ToFloat(g_w[r * kK + c])) *
                         g_scale[c / 128] * moe::common::Bf16ToFloat(g_xb[t][pos]);
        s += v;
        a += std::fabs(v);
      }
      worst = std::max(worst, std::fabs(g_out[r][t] - s) / a);
    }
  }
  return worst;
}

template <int NT>
void Row() {
  double ns[6], err[6];
  Table<NT>(); err[0] = Error(NT); ns[0] = Time(Table<NT>);
  F16<NT, 1, false>(); err[1] = Error(NT); ns[1] = Time(F16<NT, 1, false>);
  F16<NT, 2, false>(); err[2] = Error(NT); ns[2] = Time(F16<NT, 2, false>);
  F16<NT, 4, false>(); err[3] = Error(NT); ns[3] = Time(F16<NT, 4, false>);
  F16<NT, 1, true>(); err[4] = Error(NT); ns[4] = Time(F16<NT, 1, true>);
  F16<NT, 2, false, true>(); err[5] = Error(NT); ns[5] = Time(F16<NT, 2, false, true>);
  std::printf("NT=%d  table %.3f  f16/1 %.3f  f16/2 %.3f  f16/4 %.3f  f16s %.3f  f16/2 gfni %.3f   "
              "(max error / sum|terms|: %.1e %.1e %.1e %.1e %.1e %.1e)\n",
              NT, ns[0], ns[1], ns[2], ns[3], ns[4], ns[5], err[0], err[1], err[2], err[3], err[4],
              err[5]);
}

template <class F>
double PerInst(F f) {
  const long n = 20000000;
  const auto t0 = std::chrono::steady_clock::now();
  f(n);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
         n / 12;
}

}  // namespace

int main() {
  InitLut();
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (uint8_t& b : g_w) {
    b = static_cast<uint8_t>(rng());
    if ((b & 0x7F) == 0x7F) b = 0x10;  // no NaN codes
  }
  for (float& s : g_scale) s = 0.01f;  // one scale, so f16/N may carry it outside the loop
  for (int t = 0; t < kNtMax; ++t) {
    for (int c = 0; c < kK; ++c) {
      // bf16 values (8 significant bits) are exact in fp16 within its range.
      const uint16_t b = moe::common::FloatToBf16(nd(rng));
      g_xb[t][c] = b;
      g_xh[t][c] = _cvtss_sh(moe::common::Bf16ToFloat(b), _MM_FROUND_TO_NEAREST_INT);
    }
  }
  std::printf("ns per 64 codes and row (one core, %d KiB of weights, in L2)\n", kRows * kK / 1024);
  for (int pass = 0; pass < 2; ++pass) {
    Row<1>();
    Row<2>();
    Row<4>();
  }
  const double ph = PerInst([](long n) {
    __m512h acc[12];
    const __m512h x = _mm512_set1_ph(static_cast<_Float16>(1.0001f));
    for (auto& a : acc) a = _mm512_setzero_ph();
    for (long k = 0; k < n; ++k) {
      for (auto& a : acc) a = _mm512_fmadd_ph(x, x, a);
      __asm__ volatile("" : : "v"(acc[0]));
    }
    volatile float sink = Sum(_mm512_cvtxph_ps(_mm512_castph512_ph256(acc[0])));
    (void)sink;
  });
  const double bf = PerInst([](long n) {
    __m512 acc[12];
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80);
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (long k = 0; k < n; ++k) {
      for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, x);
      __asm__ volatile("" : : "v"(acc[0]));
    }
    volatile float sink = Sum(acc[0]);
    (void)sink;
  });
  std::printf("ns per instruction, 12 chains: vfmadd231ph %.3f, vdpbf16ps %.3f\n", ph, bf);
  return 0;
}
