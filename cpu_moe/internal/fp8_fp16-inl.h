// cpu_moe kernels: fp8_block rows by AVX512-FP16 FMAs (ForwardPlan::fp8_fp16; AVX3_DL on CPUs
// with AVX512-FP16 and GFNI), with each route's activations scaled per 128-row scale block into
// fp16's range.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_FP8_FP16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_FP8_FP16_INL_H_
#undef MOE_CPU_MOE_INTERNAL_FP8_FP16_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_FP8_FP16_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "cpu_moe/internal/activations-inl.h"
#include "cpu_moe/internal/fp8_rows-inl.h"
#include "cpu_moe/internal/kernel_common-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// The AVX3_DL extras of every kernel file (kernel_common-inl.h says why).
#pragma GCC target("avx512vnni")
#pragma GCC target("avx512bf16")
#pragma GCC target("amx-tile,amx-bf16")
#endif
namespace moe {
namespace cpu_moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// fp8 by AVX512-FP16 FMAs (ForwardPlan::fp8_fp16): experts not through AMX, on CPUs with
// AVX512-FP16 (Sapphire Rapids on). vdpbf16ps issues about once per two cycles on these cores
// and the table decode spends two vpermi2b per 64 codes; vfmadd231ph multiplies as many
// elements per instruction at twice the rate, and e4m3 -> fp16 is a bit shuffle: sign to bit
// 15, exponent and mantissa to bits 13..7, which is the fp16 of value e4m3 / 256, exact for
// every finite code, subnormals included (fp16 has e4m3's precision and 2^8 of headroom either
// side); the NaN codes 0x7F / 0xFF come out as +-480 / 256 instead, as in the F16C path of the
// other targets. Per 64 codes: two GF(2) affine byte transforms (GFNI, which every CPU with
// AVX512-FP16 has) give each code's fp16 high byte (s 0 e3 e2 e1 e0 m2 m1) and low byte
// (m0 << 7), and two interleaves make the words. (An interleave with zero, an arithmetic shift
// and an AND per 32 codes give the same bits for all 256 codes with two more instructions per
// 64: 6-13% slower on one core in a probe of that loop.) The weights of a 64-column chunk come
// out in the table decode's order (Fp8Pos).
//
// fp16 has 11 significant bits and a range of 2^-24 .. 65504, so the activations are scaled
// before they are rounded to it: for each route and each 128-row scale block rb of the matrix,
// x'[c] = fp16(x[c] * s[rb][c / 128] * 2^(10 - e)), with 2^(e - 1) <= M < 2^e for
// M = max over c of |x[c] * s[rb][c / 128]|, so that |x'| < 1024. The block scale rides in the
// activations (each route's are prepared once per row block, for its 128 rows), and a row's
// dot is sum x' w' * 2^(e - 2) (w' = w / 256). Each lane of the fp16 accumulators adds 8
// products (256 columns: |sum| < 8 * 1.75 * 1024 = 14336, far from fp16's 65504) before the
// 32 lanes are folded to 16 in fp16 and added into fp32 totals. Error against the exact dot,
// relative to the sum of |terms|: the rounding of x' (2^-11), 8 FMA roundings and the fold
// (2^-11 of partial sums each): at most 10 * 2^-11 = 0.5%, typically about 1e-4 (random
// signs). fp8 weights themselves carry about 2^-4.
#define MOE_FP16_FN __attribute__((target("avx512fp16,gfni")))

constexpr size_t kF16FlushCols = 256;  // columns per fp16 accumulation (see above)

// sums[rr][t] = sum over columns of w'[rr] x'[t] (fp16 weights decoded from e4m3 rows w[rr] of
// `cols` columns, a multiple of 32; activations xh[t] prepared by Fp8F16Prepare).
template <int NR, int NT>
MOE_FP16_FN HWY_INLINE void Fp8F16Rows(const uint8_t* const* w, size_t cols, PfDist pf,
                                       const uint16_t* const* xh,
                                       float (*HWY_RESTRICT sums)[kTile]) {
  // Rows of the affine matrices (qword byte 7 - i: the input bits whose parity is output bit i).
  const __m512i hmat = _mm512_set1_epi64(0x0204081020400080LL);  // s 0 e3 e2 e1 e0 m2 m1
  const __m512i lmat = _mm512_set1_epi64(0x0000000000000001LL);  // m0 << 7
  __m512 total[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) total[rr][t] = _mm512_setzero_ps();
  }
  for (size_t c0 = 0; c0 < cols; c0 += kF16FlushCols) {
    const size_t c1 = std::min(cols, c0 + kF16FlushCols);
    __m512h acc[NR][NT];
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) acc[rr][t] = _mm512_setzero_ph();
    }
    for (size_t c = c0; c < c1; c += 64) {
      __m512h wv[NR][2];
      for (int rr = 0; rr < NR; ++rr) {
        PfAhead(pf, w[rr] + c);
        const __m512i code = LoadFp8Codes(w[rr] + c, c + 64 <= c1);
        const __m512i hb = _mm512_gf2p8affine_epi64_epi8(code, hmat, 0);
        const __m512i lb = _mm512_gf2p8affine_epi64_epi8(code, lmat, 0);
        wv[rr][0] = _mm512_castsi512_ph(_mm512_unpacklo_epi8(lb, hb));
        wv[rr][1] = _mm512_castsi512_ph(_mm512_unpackhi_epi8(lb, hb));
      }
      for (int t = 0; t < NT; ++t) {
        const __m512h x0 = _mm512_castsi512_ph(_mm512_load_si512(xh[t] + c));
        const __m512h x1 = _mm512_castsi512_ph(_mm512_load_si512(xh[t] + c + 32));
        for (int rr = 0; rr < NR; ++rr) {
          acc[rr][t] = _mm512_fmadd_ph(wv[rr][0], x0, acc[rr][t]);
          acc[rr][t] = _mm512_fmadd_ph(wv[rr][1], x1, acc[rr][t]);
        }
      }
    }
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) {
        const __m256h lo = _mm512_castph512_ph256(acc[rr][t]);
        const __m256h hi = _mm256_castsi256_ph(
            _mm512_extracti64x4_epi64(_mm512_castph_si512(acc[rr][t]), 1));
        total[rr][t] = _mm512_add_ps(total[rr][t], _mm512_cvtxph_ps(_mm256_add_ph(lo, hi)));
      }
    }
  }
  const hn::ScalableTag<float> df;
  hn::Vec<decltype(df)> v[NR * NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) v[rr * NT + t] = hn::Vec<decltype(df)>{total[rr][t]};
  }
  float part[NR][kTile] = {};
  AddLaneSums(df, v, NR, NT, part);
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) sums[rr][t] = part[rr][t];
  }
}

// xmax[b] = max |x[c]| over the 128-column block b of x[k] (NaN where the block holds one).
HWY_INLINE void BlockAbsMax(const float* HWY_RESTRICT x, size_t k, float* HWY_RESTRICT xmax) {
  for (size_t c0 = 0, b = 0; c0 < k; c0 += common::kFp8BlockSize, ++b) {
    const size_t n = std::min<size_t>(common::kFp8BlockSize, k - c0);
    __m512 m = _mm512_setzero_ps();
    bool nan = false;
    for (size_t j = 0; j < n; j += 16) {
      const __mmask16 mk = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, x + c0 + j));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
      m = _mm512_max_ps(m, v);
    }
    xmax[b] = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m);
  }
}

// Fills xh[0, 64 * ceil(k / 64)) (fp16 bits, the table decode's order per 64-column chunk,
// zero past k) with x[c] * srow[c / 128] * 2^(10 - e) (see above; xmax from BlockAbsMax) and
// returns e: the row dots times 2^(e - 2) are the dots of x with the e4m3 rows times their
// block scales. Where M is 0, NaN or infinite, e = 10 (x' = x * s, so NaN and inf reach the
// outputs as they would in fp32).
MOE_FP16_FN HWY_INLINE int Fp8F16Prepare(const float* HWY_RESTRICT x, const float* xmax,
                                          const float* srow, size_t k,
                                          uint16_t* HWY_RESTRICT xh) {
  const size_t bcols = (k + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
  float mx = 0.0f;
  bool special = false;
  for (size_t b = 0; b < bcols; ++b) {
    const float v = xmax[b] * std::fabs(srow[b]);
    special |= !(v <= std::numeric_limits<float>::max());  // NaN or inf
    mx = std::max(mx, v);
  }
  int e = 10;
  if (!special && mx > 0.0f) std::frexp(mx, &e);
  for (size_t c0 = 0, b = 0; c0 < k; c0 += common::kFp8BlockSize, ++b) {
    // s * 2^(10 - e), in double (2^(10 - e) alone can exceed float's range when M is tiny),
    // clamped to float's range: where that clamps, the block's terms are below 2^-100 of the
    // largest and count for nothing.
    const double lim = std::numeric_limits<float>::max();
    const __m512 f = _mm512_set1_ps(static_cast<float>(
        std::max(-lim, std::min(lim, std::ldexp(static_cast<double>(srow[b]), 10 - e)))));
    for (size_t c = c0; c < std::min(k, c0 + common::kFp8BlockSize); c += 64) {
      __m256i y[4];
      for (size_t a = 0; a < 4; ++a) {
        const size_t j = c + 16 * a;
        const size_t n = j < k ? std::min<size_t>(16, k - j) : 0;
        const __mmask16 mk = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + j), f);
        y[a] = _mm256_castph_si256(_mm512_cvtxps_ph(v));
      }
      // y[a] holds columns 16a .. 16a + 15: its low 8 go to positions 8a.., its high 8 to
      // 32 + 8a.. (Fp8Pos).
      const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(y[0]), y[1], 1);
      const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(y[2]), y[3], 1);
      _mm512_store_si512(xh + c, _mm512_shuffle_i64x2(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_store_si512(xh + c + 32, _mm512_shuffle_i64x2(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
  return e;
}

// out = v * 2^p: a multiplication where 2^p is a normal float (always, but for activations
// below 2^-120), else ldexp.
struct Pow2 {
  float f = 1.0f;
  int p = 0;
  bool normal = true;
  Pow2() = default;
  explicit Pow2(int p_) : p(p_), normal(p_ >= -126 && p_ <= 127) {
    if (normal) f = std::ldexp(1.0f, p_);
  }
  HWY_INLINE float Apply(float v) const { return normal ? v * f : std::ldexp(v, p); }
};

// Rows [a, b) of matrix m of expert e (all in one 128-row scale block) against the nc prepared
// activations xh: store(row, i, dot) with the dot before its 2^(e - 2). Rows p and p + n/2
// together (two weight streams, as the other kernels read them; an odd last row alone), the
// routes 4 at a time.
// Rows rows[0, NR) of matrix m of expert e against the nc prepared activations xh, 4 routes at
// a time: store(row, i, dot), the dot before its 2^(e - 2).
template <int NR, class Store>
MOE_FP16_FN HWY_INLINE void Fp8F16Tiles(const MatrixRef& m, size_t e, const size_t* rows,
                                        const uint16_t* const* xh, int nc, const Store& store) {
  const size_t k = m.cols;
  const uint8_t* w[NR];
  for (int rr = 0; rr < NR; ++rr) {
    w[rr] = static_cast<const uint8_t*>(m.weights) + (e * m.rows + rows[rr]) * k;
  }
  float sums[NR][kTile];
  for (int t = 0; t < nc; t += 4) {
    const int nt = std::min(4, nc - t);
    switch (nt) {
      case 4: Fp8F16Rows<NR, 4>(w, k, m.prefetch, xh + t, sums); break;
      case 3: Fp8F16Rows<NR, 3>(w, k, m.prefetch, xh + t, sums); break;
      case 2: Fp8F16Rows<NR, 2>(w, k, m.prefetch, xh + t, sums); break;
      default: Fp8F16Rows<NR, 1>(w, k, m.prefetch, xh + t, sums); break;
    }
    for (int rr = 0; rr < NR; ++rr) {
      for (int i = 0; i < nt; ++i) store(rows[rr], t + i, sums[rr][i]);
    }
  }
}

// Rows [a, b) of matrix m of expert e (all in one 128-row scale block) against the nc prepared
// activations xh: rows p and p + n/2 together (two weight streams, as the other kernels read
// them; an odd last row alone).
template <class Store>
MOE_FP16_FN HWY_INLINE void Fp8F16RowRange(const MatrixRef& m, size_t e, size_t a, size_t b,
                                           const uint16_t* const* xh, int nc,
                                           const Store& store) {
  const size_t half = (b - a) / 2;
  for (size_t p = 0; p < half; ++p) {
    const size_t rows[2] = {a + p, a + half + p};
    Fp8F16Tiles<2>(m, e, rows, xh, nc, store);
  }
  if ((b - a) % 2 != 0) {
    const size_t rows[1] = {b - 1};
    Fp8F16Tiles<1>(m, e, rows, xh, nc, store);
  }
}

// The fp16 path's per-worker scratch: nc prepared activation vectors of kp u16 and nc x bcols
// block maxima.
struct F16Scratch {
  uint16_t* xh[64];
  float* xmax;
  F16Scratch(int nc, size_t kp, size_t bcols) {
    static thread_local common::AlignedBuffer<uint8_t> buf;
    const size_t vec = kp * sizeof(uint16_t);  // a multiple of 128 bytes
    const size_t need = nc * vec + nc * bcols * sizeof(float);
    if (buf.size() < need) buf = common::AlignedBuffer<uint8_t>(need);
    for (int i = 0; i < nc; ++i) xh[i] = reinterpret_cast<uint16_t*>(buf.data() + i * vec);
    xmax = reinterpret_cast<float*>(buf.data() + nc * vec);
  }
};

// The routes' activations of one fp16 pass-1 or pass-2 item: each route's fp32 row (m.cols
// long) with its block maxima, prepared per 128-row scale block of m (expert e) on demand.
class F16Acts {
 public:
  MOE_FP16_FN F16Acts(const MatrixRef& m, size_t e, const float* const* x, int nc)
      : m_(m),
        x_(x),
        nc_(nc),
        bcols_((m.cols + common::kFp8BlockSize - 1) / common::kFp8BlockSize),
        scales_(static_cast<const float*>(m.scales) +
                e * ((m.rows + common::kFp8BlockSize - 1) / common::kFp8BlockSize) * bcols_),
        s_(nc, (m.cols + 63) / 64 * 64, bcols_) {
    for (int i = 0; i < nc; ++i) BlockAbsMax(x[i], m.cols, s_.xmax + i * bcols_);
  }

  // Dots rows [a, b) of m (all in scale block a / 128) with the routes: store(row, i, dot).
  template <class Store>
  MOE_FP16_FN HWY_INLINE void Rows(size_t e, size_t a, size_t b, const Store& store) {
    const size_t rb = a / common::kFp8BlockSize;
    for (int i = 0; i < nc_; ++i) {
      post_[i] = Pow2(Fp8F16Prepare(x_[i], s_.xmax + i * bcols_, scales_ + rb * bcols_, m_.cols,
                                    s_.xh[i]) - 2);
    }
    Fp8F16RowRange(m_, e, a, b, s_.xh, nc_,
                   [&](size_t row, int i, float v) { store(row, i, post_[i].Apply(v)); });
  }

 private:
  const MatrixRef& m_;
  const float* const* x_;
  int nc_;
  size_t bcols_;
  const float* scales_;
  F16Scratch s_;
  Pow2 post_[64];
};

// Pass 1 through fp16: rows [r0, r1) of the gate half (rows r) and of the up half (rows I + r)
// of m (gate_up, expert e) against the nc (<= 64) routes' x rows x[i] (fp32, m.cols long):
// hrow[i][r] = the gate dot, urow[i][r] = the up dot.
MOE_FP16_FN HWY_NOINLINE void Fp8F16Pass1(const MatrixRef& m, size_t e, size_t I, size_t r0,
                                          size_t r1, const float* const* x, int nc,
                                          float* const* hrow, float* const* urow) {
  constexpr size_t kB = common::kFp8BlockSize;
  F16Acts acts(m, e, x, nc);
  for (size_t a = r0; a < r1;) {
    // Rows where both the gate's and the up half's scale block stay the same.
    const size_t b = std::min({r1, (a / kB + 1) * kB, ((I + a) / kB + 1) * kB - I});
    acts.Rows(e, a, b, [&](size_t row, int i, float v) { hrow[i][row] = v; });
    acts.Rows(e, I + a, I + b, [&](size_t row, int i, float v) { urow[i][row - I] = v; });
    a = b;
  }
}

// Pass 2 through fp16: rows [h0, h1) of m (down, expert e) against the nc (<= 64) routes'
// activated h rows hin[i] (fp32, m.cols long): dst[i][r] = wt[i] * the dot of row r.
MOE_FP16_FN HWY_NOINLINE void Fp8F16Pass2(const MatrixRef& m, size_t e, size_t h0, size_t h1,
                                          const float* const* hin, const float* wt, int nc,
                                          float* const* dst) {
  constexpr size_t kB = common::kFp8BlockSize;
  F16Acts acts(m, e, hin, nc);
  for (size_t a = h0; a < h1;) {
    const size_t b = std::min(h1, (a / kB + 1) * kB);
    acts.Rows(e, a, b, [&](size_t row, int i, float v) { dst[i][row] = wt[i] * v; });
    a = b;
  }
}
#undef MOE_FP16_FN
#endif

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_FP8_FP16_INL_H_ toggle guard
