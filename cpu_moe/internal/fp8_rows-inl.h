// cpu_moe kernels: fp8_block (e4m3, 128x128 block scales) rows by vector instructions. On
// AVX3_DL an exact e4m3 -> bf16 table decode (also used by the AMX kernels) feeding vdpbf16ps or
// fp32 FMAs; elsewhere e4m3 -> f16 bit pattern -> f32 (F16C). The AVX512-FP16 kernels are in
// fp8_fp16-inl.h.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_FP8_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_FP8_ROWS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_FP8_ROWS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_FP8_ROWS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/formats.h"
#include "cpu_moe/internal/activations-inl.h"
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
// fp8 e4m3 -> f32 by table lookup (AVX3_DL: AVX-512 VBMI). Every e4m3 value is exactly a bf16
// (bf16 has f32's 8-bit exponent, and 7 mantissa bits for e4m3's 3, subnormals included), so
// the weights come out exact and the block scale multiplies exact values. The 7-bit magnitude
// (code & 0x7F) indexes 128-byte tables of the low and high bytes of those bf16 bits; the sign
// (code & 0x80) is ORed into the high byte. 0x7F / 0xFF give 0x7FC0 / 0xFFC0: NaN, as e4m3fn
// has it; every other code gives common::Fp8E4M3ToFloat's f32 bits exactly (checked for all 256).
struct Fp8Bf16Lut {
  alignas(64) uint8_t lo[128];  // low byte of the bf16 bits of magnitude code m
  alignas(64) uint8_t hi[128];  // high byte (sign clear)
  constexpr Fp8Bf16Lut() : lo(), hi() {
    for (int m = 0; m < 128; ++m) {
      const int e = m >> 3, f = m & 7;
      int b = 0;  // bf16 bits; +0 for m = 0
      if (m == 0x7F) {
        b = 0x7FC0;
      } else if (e != 0) {
        // (1 + f/8) 2^(e - 7): bf16 biased exponent e - 7 + 127, mantissa f in its top 3 bits.
        b = (e + 120) << 7 | f << 4;
      } else if (f != 0) {
        // Subnormal f 2^-9 = (f / 2^p) 2^(p - 9), 2^p the leading bit of f; normal in bf16.
        const int p = f >= 4 ? 2 : f >= 2 ? 1 : 0;
        b = (118 + p) << 7 | (f - (1 << p)) << (7 - p);
      }
      lo[m] = static_cast<uint8_t>(b & 0xFF);
      hi[m] = static_cast<uint8_t>(b >> 8);
    }
  }
};
alignas(64) static constexpr Fp8Bf16Lut kFp8Bf16Lut{};

// The 64 e4m3 codes at p, or where !full (a row's last 32 columns) its 32 codes zero-extended
// (code 0: +0 weights against the activations' zero padding).
HWY_INLINE __m512i LoadFp8Codes(const uint8_t* p, bool full) {
  return full ? _mm512_loadu_si512(p)
              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The decode's tables and masks, loaded once per Fp8DotRows call and held in registers.
struct Fp8Decoder {
  __m512i lo0, lo1, hi0, hi1, sign, hi16;
  Fp8Decoder()
      : lo0(_mm512_load_si512(kFp8Bf16Lut.lo)),
        lo1(_mm512_load_si512(kFp8Bf16Lut.lo + 64)),
        hi0(_mm512_load_si512(kFp8Bf16Lut.hi)),
        hi1(_mm512_load_si512(kFp8Bf16Lut.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))),
        hi16(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u))) {}

  // 64 codes -> 4 x 16 f32 weights in 9 instructions (13 uops: vpermi2b is 3), against about 22
  // uops through f16: two vpermi2b lookups (they index with the low 7 bits of each byte, bit 6
  // choosing the table register), the sign OR (one vpternlogd), two byte interleaves and the
  // bf16 -> f32 widening of the bf16 path (u32 lane: low half << 16, high half & 0xFFFF0000).
  // unpacklo/hi_epi8 work per 128-bit lane q: word i of lane q of p0 is the bf16 of code
  // 16q + i, of p1 code 16q + 8 + i (i < 8). So lane j = 4q + m (m < 4) of wv[v] is the weight
  // of column 16q + 8(v / 2) + 2m + v % 2 of the chunk: the order in which
  // ActSet<kFp8Block>::Prepare lays out the activations.
  // The bf16 bits of the 64 codes as two vectors of 32 (p0: words i < 8 of each 128-bit lane q
  // from code 16q + i; p1: from code 16q + 8 + i).
  HWY_INLINE void DecodeBf16(__m512i code, __m512i& p0, __m512i& p1) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, code, lo1);
    // hi | (code & sign): vpternlogd truth table A | (B & C) = 0xF0 | (0xCC & 0xAA).
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, code, hi1), code,
                                                 sign, 0xF8);
    p0 = _mm512_unpacklo_epi8(lo, hi);
    p1 = _mm512_unpackhi_epi8(lo, hi);
  }

  HWY_INLINE void Decode(__m512i code, __m512 (&wv)[4]) const {
    __m512i p0, p1;
    DecodeBf16(code, p0, p1);
    wv[0] = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
    wv[1] = _mm512_castsi512_ps(_mm512_and_si512(p0, hi16));
    wv[2] = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
    wv[3] = _mm512_castsi512_ps(_mm512_and_si512(p1, hi16));
  }
};

// NR rows x NT activations over the 64 columns [c, c + 64) (kTail: the last 32 columns of a row
// whose length is not a multiple of 64; cols is a multiple of 32). The tail's codes fill the low
// 256 bits (the rest zero, weights +0), i.e. lanes 0..7 of each wv[v] (q < 2 above), and its
// activations are 4 vectors of 8 floats; the FMAs are masked to those lanes, so the upper lanes
// of the accumulators are left as they are. One accumulator per (row, token): at NT = 1 its chain
// of 4 FMAs per chunk is about as long as the decode of the chunk's NR = 2 rows, and at NT = 4
// the accumulators and block totals (16 + 16 registers with two) would not fit in 32 registers.
template <int NR, int NT, bool kTail>
HWY_INLINE void Fp8DotChunk(const Fp8Decoder& dec, const uint8_t* const* w, size_t c, PfDist pf,
                            const ActView* acts, __m512 (*HWY_RESTRICT acc)[NT]) {
  constexpr size_t kL = kTail ? 8 : 16;  // floats per activation vector
  constexpr __mmask16 kM = kTail ? 0x00FF : 0xFFFF;
  __m512 wv[NR][4];
  for (int rr = 0; rr < NR; ++rr) {
    // One prefetch per 64 bytes of the row (c is a multiple of 64, tail included).
    PfAhead(pf, w[rr] + c);
    dec.Decode(LoadFp8Codes(w[rr] + c, !kTail), wv[rr]);
  }
  for (int t = 0; t < NT; ++t) {
    const float* x = acts[t].xf + c;
    __m512 xv[4];
    for (int v = 0; v < 4; ++v) {
      xv[v] = kTail ? _mm512_maskz_loadu_ps(kM, x + kL * v) : _mm512_loadu_ps(x + kL * v);
    }
    for (int rr = 0; rr < NR; ++rr) {
      for (int v = 0; v < 4; ++v) {
        acc[rr][t] = kTail ? _mm512_mask3_fmadd_ps(wv[rr][v], xv[v], acc[rr][t], kM)
                           : _mm512_fmadd_ps(wv[rr][v], xv[v], acc[rr][t]);
      }
    }
  }
}
#endif

#if HWY_TARGET == HWY_AVX3_DL
// The 128-column scale blocks of the AVX3_DL fp8 kernels: chunk(c, c1, acc) adds the 64 columns
// at c (the last 32 of a row when c + 64 > c1; chunks never straddle a block) to the block's
// accumulators acc[NR][NT]; each block's sums are scaled into the totals, whose lane sums are
// added to sums.
template <int NR, int NT, class Chunk>
HWY_INLINE void Fp8Blocks(const float* const* scale_row, size_t cols,
                          float (*HWY_RESTRICT sums)[kTile], const Chunk& chunk) {
  __m512 total[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) total[rr][t] = _mm512_setzero_ps();
  }
  for (size_t c0 = 0; c0 < cols; c0 += common::kFp8BlockSize) {
    const size_t c1 = std::min(cols, c0 + common::kFp8BlockSize);
    __m512 acc[NR][NT];
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) acc[rr][t] = _mm512_setzero_ps();
    }
    for (size_t c = c0; c < c1; c += 64) chunk(c, c1, acc);
    for (int rr = 0; rr < NR; ++rr) {
      const __m512 s = _mm512_set1_ps(scale_row[rr][c0 / common::kFp8BlockSize]);
      for (int t = 0; t < NT; ++t) total[rr][t] = _mm512_fmadd_ps(acc[rr][t], s, total[rr][t]);
    }
  }
  const hn::ScalableTag<float> df;
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) {
      sums[rr][t] += hn::GetLane(hn::SumOfLanes(df, hn::Vec<decltype(df)>{total[rr][t]}));
    }
  }
}

// fp8 by the CPU's bf16 dot product (kBf16Dot): the table decode's two vectors of 32 bf16
// weights per 64 columns go straight into vdpbf16ps against the bf16 activations in the same
// order (Fp8Pos, ActSet): 2 instructions per route per 64 columns instead of 4 FMAs, and no
// widening of the weights to f32. A short last chunk (32 columns) decodes zero-extended codes:
// its upper positions hold +0 weights against the activations' zero padding.
template <int NR, int NT>
HWY_INLINE void Fp8DotRowsBf16(const uint8_t* const* w, const float* const* scale_row,
                               size_t cols, PfDist pf, const ActView* acts,
                               float (*HWY_RESTRICT sums)[kTile]) {
  const Fp8Decoder dec;
  Fp8Blocks<NR, NT>(scale_row, cols, sums, [&](size_t c, size_t c1, __m512 (*acc)[NT]) {
    __m512i wv[NR][2];
    for (int rr = 0; rr < NR; ++rr) {
      PfAhead(pf, w[rr] + c);
      dec.DecodeBf16(LoadFp8Codes(w[rr] + c, c + 64 <= c1), wv[rr][0], wv[rr][1]);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512i x0 = _mm512_loadu_si512(acts[t].xb + c);
      const __m512i x1 = _mm512_loadu_si512(acts[t].xb + c + 32);
      for (int rr = 0; rr < NR; ++rr) {
        acc[rr][t] = _mm512_dpbf16_ps(acc[rr][t], (__m512bh)wv[rr][0], (__m512bh)x0);
        acc[rr][t] = _mm512_dpbf16_ps(acc[rr][t], (__m512bh)wv[rr][1], (__m512bh)x1);
      }
    }
  });
}
#endif

// AVX3_DL: the table decode above, 64 columns at a time; the weights are the e4m3 values
// themselves, so the block scale goes on as stored. Other targets: fp8 e4m3 -> f32 through the
// f16 bit pattern: sign to bit 15, exponent and mantissa to bits 13..7 gives an f16 of value
// e4m3 / 256 (subnormals included), which F16C widens exactly (hence 256 on the block scale).
template <int NR, int NT, bool kBf16Dot = false>
HWY_INLINE void Fp8DotRows(const uint8_t* const* w, const float* const* scale_row, size_t cols,
                           PfDist pf, const ActView* acts, float (*HWY_RESTRICT sums)[kTile]) {
#if HWY_TARGET == HWY_AVX3_DL
  if constexpr (kBf16Dot) {
    return Fp8DotRowsBf16<NR, NT>(w, scale_row, cols, pf, acts, sums);
  }
  const Fp8Decoder dec;
  Fp8Blocks<NR, NT>(scale_row, cols, sums, [&](size_t c, size_t c1, __m512 (*acc)[NT]) {
    if (c + 64 <= c1) {
      Fp8DotChunk<NR, NT, false>(dec, w, c, pf, acts, acc);
    } else {
      Fp8DotChunk<NR, NT, true>(dec, w, c, pf, acts, acc);
    }
  });
#else
  const hn::ScalableTag<float> df;
  // Bit manipulation on 2 * Lanes(df) values at once in u16 lanes, then two f16 -> f32 widenings.
  const hn::ScalableTag<uint16_t> d16;
  const hn::Rebind<uint8_t, decltype(d16)> d8;
  const hn::Half<decltype(d16)> d16h;
  const hn::Rebind<hwy::float16_t, decltype(df)> df16;
  const size_t n = hn::Lanes(df);
  const size_t n2 = hn::Lanes(d16);  // = 2n; 128-column blocks (and cols, a multiple of 32) divide
  const auto sign = hn::Set(d16, 0x80);
  const auto mag = hn::Set(d16, 0x7F);
  hn::Vec<decltype(df)> total[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) total[rr][t] = hn::Zero(df);
  }
  for (size_t c0 = 0; c0 < cols; c0 += common::kFp8BlockSize) {
    const size_t c1 = std::min(cols, c0 + common::kFp8BlockSize);
    hn::Vec<decltype(df)> acc[NR][NT];
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) acc[rr][t] = hn::Zero(df);
    }
    for (size_t c = c0; c < c1; c += n2) {
      hn::Vec<decltype(df)> wl[NR], wh[NR];
      for (int rr = 0; rr < NR; ++rr) {
        if ((c & 63) == 0) PfAhead(pf, w[rr] + c);
        const auto b = hn::PromoteTo(d16, hn::LoadU(d8, w[rr] + c));
        const auto bits =
            hn::Or(hn::ShiftLeft<8>(hn::And(b, sign)), hn::ShiftLeft<7>(hn::And(b, mag)));
        wl[rr] = hn::PromoteTo(df, hn::BitCast(df16, hn::LowerHalf(d16h, bits)));
        wh[rr] = hn::PromoteTo(df, hn::BitCast(df16, hn::UpperHalf(d16h, bits)));
      }
      for (int t = 0; t < NT; ++t) {
        const auto xl = hn::LoadU(df, acts[t].xf + c);
        const auto xh = hn::LoadU(df, acts[t].xf + c + n);
        for (int rr = 0; rr < NR; ++rr) {
          acc[rr][t] = hn::MulAdd(wl[rr], xl, acc[rr][t]);
          acc[rr][t] = hn::MulAdd(wh[rr], xh, acc[rr][t]);
        }
      }
    }
    for (int rr = 0; rr < NR; ++rr) {
      const auto s = hn::Set(df, 256.0f * scale_row[rr][c0 / common::kFp8BlockSize]);
      for (int t = 0; t < NT; ++t) total[rr][t] = hn::MulAdd(acc[rr][t], s, total[rr][t]);
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) sums[rr][t] += hn::GetLane(hn::SumOfLanes(df, total[rr][t]));
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_FP8_ROWS_INL_H_ toggle guard
