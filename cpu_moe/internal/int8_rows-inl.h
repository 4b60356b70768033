// cpu_moe kernels: the 4-bit formats' row-major kernels (q4_0, mxfp4, nvfp4). Weights are fed as
// unsigned codes into u8 x s8 dot products (vpdpbusd on AVX3_DL, pmaddubsw + pmaddwd on AVX3,
// AVX2 and SSE4) against int8 activations, with per-lane block scales decoded from the row's own
// bytes; on the 512-bit targets a row's leading 128-byte chunks go through the block-lane
// layout.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_INT8_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_INT8_ROWS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_INT8_ROWS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_INT8_ROWS_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

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

using common::BlockQ4_0;

// sum_m u[m] * x[m] over groups of four bytes, added to the int32 lanes of acc. u is unsigned
// (< 128 here), x signed.
template <class D32, class VU, class VI>
HWY_INLINE hn::Vec<D32> DotAcc(D32 d32, hn::Vec<D32> acc, VU u, VI x) {
#if HWY_TARGET == HWY_AVX3_DL
  (void)d32;
  if constexpr (sizeof(acc.raw) == 64) {
    return hn::Vec<D32>{_mm512_dpbusd_epi32(acc.raw, u.raw, x.raw)};
  } else {
    // Highway 1.0.3's AVX3_DL target string enables AVX-VNNI (avxvnni), with which GCC encodes
    // the 256- and 128-bit intrinsics as {vex} vpdpbusd: AVX-VNNI, which AVX3_DL does not
    // require and AMD Zen 4 and Intel Ice Lake lack (SIGILL there, on every row tail narrower
    // than 64 bytes). The EVEX form needs only AVX512_VNNI + AVX512VL, which AVX3_DL has.
    auto r = acc.raw;
    asm("%{evex%} vpdpbusd %[x], %[u], %[acc]" : [acc] "+v"(r) : [u] "v"(u.raw), [x] "v"(x.raw));
    return hn::Vec<D32>{r};
  }
#elif HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4
  // u8 x s8 -> s16 pairs (no saturation: |u * x| <= 24 * 127 * 2), then pairs of s16 -> s32.
  (void)d32;
  if constexpr (sizeof(acc.raw) == 64) {
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u.raw, x.raw), _mm512_set1_epi16(1));
    return hn::Vec<D32>{_mm512_add_epi32(acc.raw, p)};
  } else if constexpr (sizeof(acc.raw) == 32) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u.raw, x.raw), _mm256_set1_epi16(1));
    return hn::Vec<D32>{_mm256_add_epi32(acc.raw, p)};
  } else {
    const __m128i p = _mm_madd_epi16(_mm_maddubs_epi16(u.raw, x.raw), _mm_set1_epi16(1));
    return hn::Vec<D32>{_mm_add_epi32(acc.raw, p)};
  }
#else
  // Portable: widen to i16 and multiply-add pairs.
  const hn::Repartition<int16_t, D32> d16;
  const hn::Half<hn::Repartition<uint8_t, D32>> du8h;
  const hn::Half<hn::Repartition<int8_t, D32>> di8h;
  const auto ul = hn::BitCast(d16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(du8h)>(),
                                                 hn::LowerHalf(du8h, u)));
  const auto uh = hn::BitCast(d16, hn::PromoteTo(hn::Rebind<uint16_t, decltype(du8h)>(),
                                                 hn::UpperHalf(du8h, u)));
  const auto xl = hn::PromoteTo(d16, hn::LowerHalf(di8h, x));
  const auto xh = hn::PromoteTo(d16, hn::UpperHalf(di8h, x));
  auto unused = hn::Zero(d32);
  acc = hn::ReorderWidenMulAccumulate(d32, ul, xl, acc, unused);
  return hn::ReorderWidenMulAccumulate(d32, uh, xh, acc, unused);
  // Lane order differs from the x86 paths, which the lane scales would not match; this branch
  // exists for completeness of non-x86 builds and is exercised nowhere here.
#endif
}

// Table from fp4 e2m1 code to 2 * value + 12 (unsigned, for u8 x s8 dot products).
alignas(16) static constexpr uint8_t kFp4Lut[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                    12, 11, 10, 9,  8,  6,  4,  0};
// kFp4Lut repeated to 64 entries, for vpermb (see QuantDotBlockLane).
struct Fp4Lut64 {
  alignas(64) uint8_t v[64];
  constexpr Fp4Lut64() : v() {
    for (int i = 0; i < 64; ++i) v[i] = kFp4Lut[i % 16];
  }
};
alignas(64) static constexpr Fp4Lut64 kFp4Lut64Table{};
static constexpr const uint8_t* kFp4Lut64 = kFp4Lut64Table.v;

// Loads the packed nibble bytes [b, b + Lanes(d8)) of a quantized row ("byte b" as in ActView).
template <common::WeightFormat F, class D8>
HWY_INLINE hn::Vec<D8> LoadPacked(D8 d8, const uint8_t* HWY_RESTRICT packed,
                                  const BlockQ4_0* HWY_RESTRICT blocks, size_t b) {
  if constexpr (F != common::WeightFormat::kQ4_0) {
    (void)blocks;
    return hn::LoadU(d8, packed + b);
  } else {
    (void)packed;
    const BlockQ4_0* blk = blocks + b / 16;
    constexpr size_t kBytes = hn::MaxLanes(D8());
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
    if constexpr (kBytes == 64) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[0].qs)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[1].qs)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[2].qs)), 2);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[3].qs)), 3);
      return hn::Vec<D8>{v};
    } else if constexpr (kBytes == 32) {
      return hn::Vec<D8>{_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk[1].qs),
                                             reinterpret_cast<const __m128i*>(blk[0].qs))};
    }
#endif
    if constexpr (kBytes <= 16) {
      return hn::LoadU(d8, blk->qs);
    } else {
      alignas(64) uint8_t tmp[kBytes];
      for (size_t i = 0; i < kBytes / 16; ++i) std::memcpy(tmp + 16 * i, blk[i].qs, 16);
      return hn::Load(d8, tmp);
    }
  }
}

// One quantized row: its packed bytes and scales, and the factor applied to the row's sum.
// Lane scales (see QuantChunk) are the block scales as stored (q4_0 d, ue8m0 2^(e-127), e4m3
// value); `post` carries the rest (the fp4 table's 1/2, nvfp4's global scale).
struct QuantRow {
  const uint8_t* packed;    // mxfp4/nvfp4
  const BlockQ4_0* blocks;  // q4_0
  const uint8_t* scales;    // mxfp4/nvfp4: this row's scale bytes
  float post;
};

// Fills q field by field: building a QuantRow in a temporary and copying it made GCC copy the
// struct with one 32-byte load from its 8-byte stores, a failed store-to-load forward per row
// (about 30% of pass 2's time for mxfp4 on one core of a 2-vCPU EPYC machine, where rows are
// only 3 chunks long).
template <common::WeightFormat F>
HWY_INLINE void MakeQuantRow(const MatrixRef& m, size_t e, size_t r, QuantRow& q) {
  const size_t k = m.cols;
  const size_t row = e * m.rows + r;
  if constexpr (F == common::WeightFormat::kQ4_0) {
    q.packed = nullptr;
    q.blocks = static_cast<const BlockQ4_0*>(m.weights) + row * (k / 32);
    q.scales = nullptr;
    q.post = 1.0f;
  } else if constexpr (F == common::WeightFormat::kMxfp4) {
    q.packed = static_cast<const uint8_t*>(m.weights) + row * (k / 2);
    q.blocks = nullptr;
    q.scales = static_cast<const uint8_t*>(m.scales) + row * (k / 32);
    q.post = 0.5f;
  } else {
    q.packed = static_cast<const uint8_t*>(m.weights) + row * (k / 2);
    q.blocks = nullptr;
    q.scales = static_cast<const uint8_t*>(m.scales) + row * (k / 16);
    q.post = 0.5f * m.GlobalsOf(r)[e * m.global_stride];
  }
}

// Address of packed byte b of the row in memory (for prefetching).
template <common::WeightFormat F>
HWY_INLINE const uint8_t* PackedAddr(const QuantRow& q, size_t b) {
  if constexpr (F == common::WeightFormat::kQ4_0) {
    return reinterpret_cast<const uint8_t*>(q.blocks) + b / 16 * sizeof(BlockQ4_0);
  } else {
    return q.packed + b;
  }
}

// Block scale codes (one per u32 lane, in its low byte) -> f32, as stored: mxfp4's ue8m0 e ->
// 2^(e - 127), 0 -> 2^-127 (an f32 subnormal), 0xFF -> NaN (the upper bytes must be 0); nvfp4's
// e4m3 -> its value: exponent and mantissa moved to the f32 fields give value * 2^-120 (e4m3
// subnormals land on f32 subnormals, exactly), 0x7F / 0xFF NaN.
template <common::WeightFormat F, class DF>
HWY_INLINE hn::Vec<DF> ScaleCodesToF32(DF df, hn::Vec<hn::RebindToUnsigned<DF>> c) {
  const hn::RebindToUnsigned<DF> du32;
  if constexpr (F == common::WeightFormat::kMxfp4) {
    auto bits = hn::ShiftLeft<23>(c);
    bits = hn::IfThenElse(hn::Eq(c, hn::Zero(du32)), hn::Set(du32, 0x00400000u), bits);
    bits = hn::IfThenElse(hn::Eq(c, hn::Set(du32, 0xFFu)), hn::Set(du32, 0x7FC00000u), bits);
    return hn::BitCast(df, bits);
  } else {
    static_assert(F == common::WeightFormat::kNvfp4, "ue8m0 or e4m3 scales");
    const auto mag = hn::And(c, hn::Set(du32, 0x7Fu));
    const auto bits =
        hn::Or(hn::ShiftLeft<20>(mag), hn::ShiftLeft<24>(hn::And(c, hn::Set(du32, 0x80u))));
    const auto v = hn::Mul(hn::BitCast(df, bits), hn::Set(df, 0x1p120f));
    return hn::IfThenElse(hn::RebindMask(df, hn::Eq(mag, hn::Set(du32, 0x7Fu))),
                          hn::Set(df, std::numeric_limits<float>::quiet_NaN()), v);
  }
}

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
// Index tables of the 512-bit chunk loads (see QuantChunk).
// q4_0: fp16 d of blocks 0..3 of a 72-byte chunk are 16-bit words 0, 9, 18, 27 of its first 64
// bytes; each goes to 4 lanes.
alignas(64) static constexpr uint16_t kQ4IdxD[32] = {0,  0,  0,  0,  9,  9,  9,  9,  18, 18, 18,
                                                     18, 27, 27, 27, 27, 0,  0,  0,  0,  0,  0,
                                                     0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
// q4_0 qs of blocks 0..3: chunk bytes 18q + 2 + m; blocks 0..2 from A (chunk[0, 64)), block 3
// from B (chunk[8, 72)) at 48 + m, which vpermt2b addresses as 64 + 48 + m.
struct Q4IdxQ {
  alignas(64) uint8_t v[64];
  constexpr Q4IdxQ() : v() {
    for (int q = 0; q < 4; ++q) {
      for (int m = 0; m < 16; ++m) {
        v[16 * q + m] = static_cast<uint8_t>(q < 3 ? 18 * q + 2 + m : 112 + m);
      }
    }
  }
};
alignas(64) static constexpr Q4IdxQ kQ4IdxQ{};
// mxfp4: scale byte q (of 4) to the low byte of each u32 of 128-bit lane q; nvfp4: scale byte
// 2q + i/2 (of 8) to u32 i of 128-bit lane q. pshufb indexes within a 128-bit lane, so the 4 / 8
// scale bytes are broadcast to every lane first.
struct ScaleIdx {
  alignas(64) uint8_t mx[64];
  alignas(64) uint8_t nv[64];
  constexpr ScaleIdx() : mx(), nv() {
    for (int q = 0; q < 4; ++q) {
      for (int i = 0; i < 4; ++i) {
        for (int c = 0; c < 4; ++c) {
          mx[16 * q + 4 * i + c] = c == 0 ? static_cast<uint8_t>(q) : 0x80;
          nv[16 * q + 4 * i + c] = c == 0 ? static_cast<uint8_t>(2 * q + i / 2) : 0x80;
        }
      }
    }
  }
};
alignas(64) static constexpr ScaleIdx kScaleIdx{};

// ue8m0 exponents / e4m3 codes (one per u32 lane, in its low byte) -> f32 (ScaleCodesToF32).
using Df512 = hn::ScalableTag<float>;
using Du512 = hn::RebindToUnsigned<Df512>;
HWY_INLINE __m512 Ue8m0Lanes(__m512i e) {
  return ScaleCodesToF32<common::WeightFormat::kMxfp4>(Df512(), hn::Vec<Du512>{e}).raw;
}
HWY_INLINE __m512 E4m3Lanes(__m512i s) {
  return ScaleCodesToF32<common::WeightFormat::kNvfp4>(Df512(), hn::Vec<Du512>{s}).raw;
}

// Index tables of the block-lane chunks (see QuantDotBlockLane).
struct BlockLaneIdx {
  // u32 lane j of B_s is lane 2(j % 8) + s of the chunk's first (j < 8) or second 64 bytes.
  alignas(64) uint32_t split[2][16];
  // q4_0: fp16 d of blocks 0..7 (words 0, 9, 18, 27 of each 72-byte half), each to two lanes.
  alignas(64) uint16_t q4d[32];
  // mxfp4: scale byte j / 2 (of 8, broadcast to every 128-bit lane) to the low byte of u32 j.
  alignas(64) uint8_t mx[64];
  constexpr BlockLaneIdx() : split(), q4d(), mx() {
    for (int j = 0; j < 16; ++j) {
      for (int s = 0; s < 2; ++s) split[s][j] = static_cast<uint32_t>(16 * (j / 8) + 2 * (j % 8) + s);
      const int t = j / 2;
      q4d[j] = static_cast<uint16_t>(t < 4 ? 9 * t : 32 + 9 * (t - 4));
      for (int c = 0; c < 4; ++c) mx[4 * j + c] = c == 0 ? static_cast<uint8_t>(t) : 0x80;
    }
  }
};
alignas(64) static constexpr BlockLaneIdx kBlockLaneIdx{};
#endif

// Packed bytes [b, b + Lanes(d8)) of a quantized row and their per-lane scales (lane j of the
// int32 dot products covers bytes [b + 4j, b + 4j + 4)).
template <common::WeightFormat F, class D8, class DF>
HWY_INLINE void QuantChunk(D8 d8, DF df, const QuantRow& q, size_t b, hn::Vec<D8>& raw,
                           hn::Vec<DF>& ws) {
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
  if constexpr (hn::MaxLanes(D8()) == 64) {
    if constexpr (F == common::WeightFormat::kQ4_0) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(q.blocks + b / 16);
      const __m512i a = _mm512_loadu_si512(p);
      const __m512i dw =
          _mm512_permutexvar_epi16(_mm512_load_si512(reinterpret_cast<const void*>(kQ4IdxD)), a);
      ws = hn::Vec<DF>{_mm512_cvtph_ps(_mm512_castsi512_si256(dw))};
#if HWY_TARGET == HWY_AVX3_DL
      const __m512i bq = _mm512_loadu_si512(p + 8);
      raw = hn::Vec<D8>{_mm512_permutex2var_epi8(
          a, _mm512_load_si512(reinterpret_cast<const void*>(kQ4IdxQ.v)), bq)};
#else
      raw = LoadPacked<F>(d8, q.packed, q.blocks, b);
#endif
    } else if constexpr (F == common::WeightFormat::kMxfp4) {
      uint32_t s4;
      std::memcpy(&s4, q.scales + b / 16, 4);
      ws = hn::Vec<DF>{Ue8m0Lanes(_mm512_shuffle_epi8(
          _mm512_set1_epi32(static_cast<int>(s4)),
          _mm512_load_si512(reinterpret_cast<const void*>(kScaleIdx.mx))))};
      raw = hn::LoadU(d8, q.packed + b);
    } else {
      uint64_t s8;
      std::memcpy(&s8, q.scales + b / 8, 8);
      ws = hn::Vec<DF>{E4m3Lanes(_mm512_shuffle_epi8(
          _mm512_set1_epi64(static_cast<long long>(s8)),
          _mm512_load_si512(reinterpret_cast<const void*>(kScaleIdx.nv))))};
      raw = hn::LoadU(d8, q.packed + b);
    }
    return;
  }
#endif
  raw = LoadPacked<F>(d8, q.packed, q.blocks, b);
  // Generic: one conversion per block present in the chunk, spread over its lanes.
  constexpr size_t kLanes = hn::MaxLanes(DF());
  HWY_ALIGN float tmp[kLanes];
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kLanesPerBlock = F == common::WeightFormat::kNvfp4 ? 2 : 4;
  for (size_t j = 0; j < lanes; j += kLanesPerBlock) {
    float v;
    if constexpr (F == common::WeightFormat::kQ4_0) {
      v = common::Fp16ToFloat(q.blocks[(b + 4 * j) / 16].d);
    } else if constexpr (F == common::WeightFormat::kMxfp4) {
      v = common::Ue8m0ToFloat(q.scales[(b + 4 * j) / 16]);
    } else {
      v = common::Fp8E4M3ToFloat(q.scales[(b + 4 * j) / 8]);
    }
    for (size_t l = 0; l < kLanesPerBlock && j + l < lanes; ++l) tmp[j + l] = v;
  }
  ws = hn::Load(df, tmp);
}

// NR quantized rows x NT activations over packed bytes [b, nbytes) at the width of d8; returns
// the first byte not done. Adds into sums[row][t] (before the rows' post factors). The rows share
// every activation load; each (row, token) has its own accumulator.
template <common::WeightFormat F, int NR, int NT, class D8>
HWY_INLINE size_t QuantDotLevel(D8 d8, const QuantRow* q, const ActView* acts, size_t b,
                                size_t nbytes, size_t pf, float (*HWY_RESTRICT sums)[kTile]) {
  const size_t n = hn::Lanes(d8);
  if (b + n > nbytes) return b;
  // Offsets of hi, xs and neg from lo in an activation vector (nbytes = k / 2).
  const size_t kh = nbytes, k = 2 * nbytes, k3h = 3 * nbytes;
  const hn::Repartition<int8_t, D8> di8;
  const hn::Repartition<int32_t, D8> di32;
  const hn::Repartition<float, D8> df;
  const auto mask = hn::Set(d8, 0x0F);
  const auto lut = hn::LoadDup128(d8, kFp4Lut);
  hn::Vec<decltype(df)> acc[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) acc[rr][t] = hn::Zero(df);
  }
  for (; b + n <= nbytes; b += n) {
    hn::Vec<D8> lo[NR], hi[NR];
    hn::Vec<decltype(df)> ws[NR];
    for (int rr = 0; rr < NR; ++rr) {
      if constexpr (hn::MaxLanes(D8()) >= 32) {
        if (pf != 0) {
          Pf(PackedAddr<F>(q[rr], b) + pf);
          if constexpr (F != common::WeightFormat::kQ4_0) {
            Pf(q[rr].scales + (b + pf) / (F == common::WeightFormat::kNvfp4 ? 8 : 16));
          }
        }
      }
      hn::Vec<D8> raw;
      QuantChunk<F>(d8, df, q[rr], b, raw, ws[rr]);
      lo[rr] = hn::And(raw, mask);
      hi[rr] = hn::And(hn::ShiftRight<4>(raw), mask);
      if constexpr (F != common::WeightFormat::kQ4_0) {
        lo[rr] = hn::TableLookupBytes(lut, lo[rr]);
        hi[rr] = hn::TableLookupBytes(lut, hi[rr]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const int8_t* a = acts[t].q + b;
      const auto xl = hn::LoadU(di8, a);
      const auto xh = hn::LoadU(di8, a + kh);
      const auto xs = hn::LoadU(df, reinterpret_cast<const float*>(a + k));
      const auto neg = hn::LoadU(di32, reinterpret_cast<const int32_t*>(a + k3h));
      for (int rr = 0; rr < NR; ++rr) {
        auto s = DotAcc(di32, neg, lo[rr], xl);
        s = DotAcc(di32, s, hi[rr], xh);
        acc[rr][t] = hn::MulAdd(hn::ConvertTo(df, s), hn::Mul(ws[rr], xs), acc[rr][t]);
      }
    }
  }
  AddLaneSums(df, &acc[0][0], NR, NT, sums);
  return b;
}

template <common::WeightFormat F, int NR, int NT, class D8>
HWY_INLINE void QuantDotAll(D8 d8, const QuantRow* q, const ActView* acts, size_t b,
                            size_t nbytes, size_t pf, float (*sums)[kTile]) {
  b = QuantDotLevel<F, NR, NT>(d8, q, acts, b, nbytes, pf, sums);
  if constexpr (hn::MaxLanes(D8()) > 16) {
    if (b < nbytes) QuantDotAll<F, NR, NT>(hn::Half<D8>(), q, acts, b, nbytes, pf, sums);
  }
}

#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
// The block-lane layout of the 512-bit targets. In the plain layout each int32 lane of a 64-byte
// chunk covers 8 weights, a quarter of a 32-weight block, so every route converts, scales and
// adds each lane sum: per 128 weights and route, two dot products plus a conversion, a multiply
// and an FMA. Here a 128-byte chunk is dotted as two vectors B_0, B_1 whose u32 lane j covers
// packed bytes [8j, 8j + 4) and [8j + 4, 8j + 8): one lane stays within one block (mxfp4 and
// q4_0 blocks span two lanes, nvfp4 blocks one) across both vectors, so the four dot products
// of the chunk go into one int32 sum per lane before the one conversion, multiply and FMA:
// 7 instead of 10 vector operations per 256 weights and route. The split costs each row two
// vpermt2d (lanes 2j + s of the plain halves), shared by all routes. The activations are laid
// out to match (ActSet::PrepareRange).
template <common::WeightFormat F>
HWY_INLINE void BlockLaneChunk(const QuantRow& q, size_t b, __m512i& b0, __m512i& b1,
                               __m512& ws) {
  __m512i a0, a1;
  if constexpr (F == common::WeightFormat::kQ4_0) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(q.blocks + b / 16);
    const __m512i c0 = _mm512_loadu_si512(p);
    const __m512i c1 = _mm512_loadu_si512(p + 4 * sizeof(BlockQ4_0));
    ws = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(
        c0, _mm512_load_si512(reinterpret_cast<const void*>(kBlockLaneIdx.q4d)), c1)));
#if HWY_TARGET == HWY_AVX3_DL
    const __m512i iq = _mm512_load_si512(reinterpret_cast<const void*>(kQ4IdxQ.v));
    a0 = _mm512_permutex2var_epi8(c0, iq, _mm512_loadu_si512(p + 8));
    a1 = _mm512_permutex2var_epi8(c1, iq, _mm512_loadu_si512(p + 4 * sizeof(BlockQ4_0) + 8));
#else
    const hn::ScalableTag<uint8_t> d8;
    a0 = LoadPacked<F>(d8, nullptr, q.blocks, b).raw;
    a1 = LoadPacked<F>(d8, nullptr, q.blocks, b + 64).raw;
#endif
  } else {
    a0 = _mm512_loadu_si512(q.packed + b);
    a1 = _mm512_loadu_si512(q.packed + b + 64);
    if constexpr (F == common::WeightFormat::kMxfp4) {
      uint64_t s8;
      std::memcpy(&s8, q.scales + b / 16, 8);
      ws = Ue8m0Lanes(_mm512_shuffle_epi8(
          _mm512_set1_epi64(static_cast<long long>(s8)),
          _mm512_load_si512(reinterpret_cast<const void*>(kBlockLaneIdx.mx))));
    } else {
      ws = E4m3Lanes(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q.scales + b / 8))));
    }
  }
  b0 = _mm512_permutex2var_epi32(
      a0, _mm512_load_si512(reinterpret_cast<const void*>(kBlockLaneIdx.split[0])), a1);
  b1 = _mm512_permutex2var_epi32(
      a0, _mm512_load_si512(reinterpret_cast<const void*>(kBlockLaneIdx.split[1])), a1);
}

// NR quantized rows x NT activations over the block-lane part of the rows (BlockLaneBytes);
// returns its end, where the plain kernels take over. Adds into sums like QuantDotLevel.
template <common::WeightFormat F, int NR, int NT>
HWY_INLINE size_t QuantDotBlockLane(const QuantRow* q, const ActView* acts, size_t nbytes,
                                    size_t pf, float (*HWY_RESTRICT sums)[kTile]) {
  const size_t nb = BlockLaneBytes(nbytes, true);
  if (nb == 0) return 0;
  const hn::ScalableTag<uint8_t> d8;
  const hn::Repartition<int8_t, decltype(d8)> di8;
  const hn::Repartition<int32_t, decltype(d8)> di32;
  const hn::Repartition<float, decltype(d8)> df;
  static_assert(hn::MaxLanes(d8) == 64, "512-bit targets only");
  // Offsets of hi, xs and neg from lo in an activation vector; the block-lane part keeps one
  // scale and one correction per lane, at half the plain part's stride.
  const size_t kh = nbytes, kxs = 2 * nbytes, kneg = 3 * nbytes;
  const auto mask = hn::Set(d8, 0x0F);
  const auto lut = hn::LoadDup128(d8, kFp4Lut);
  hn::Vec<decltype(df)> acc[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) acc[rr][t] = hn::Zero(df);
  }
  for (size_t b = 0; b < nb; b += kBlockLaneChunk) {
    hn::Vec<decltype(d8)> w[NR][4];  // lo(B_0), hi(B_0), lo(B_1), hi(B_1)
    hn::Vec<decltype(df)> ws[NR];
    for (int rr = 0; rr < NR; ++rr) {
      if (pf != 0) {
        Pf(PackedAddr<F>(q[rr], b) + pf);
        Pf(PackedAddr<F>(q[rr], b + 64) + pf);
        if constexpr (F != common::WeightFormat::kQ4_0) {
          Pf(q[rr].scales + (b + pf) / (F == common::WeightFormat::kNvfp4 ? 8 : 16));
        }
      }
      __m512i r0, r1;
      __m512 wsr;
      BlockLaneChunk<F>(q[rr], b, r0, r1, wsr);
      ws[rr] = hn::Vec<decltype(df)>{wsr};
      const hn::Vec<decltype(d8)> raw[2] = {hn::Vec<decltype(d8)>{r0}, hn::Vec<decltype(d8)>{r1}};
      for (int h = 0; h < 2; ++h) {
#if HWY_TARGET == HWY_AVX3_DL
        if constexpr (F != common::WeightFormat::kQ4_0) {
          // fp4 codes through vpermb (AVX512_VBMI), which reads only 6 bits of each index byte:
          // over kFp4Lut repeated 4 times, a byte's low nibble alone picks its entry, so neither
          // nibble needs masking (the 16-bit shift moves the neighbouring byte's bits only into
          // bits 4-7). Two instructions per 64 bytes fewer than mask, shift, mask, pshufb x2.
          const __m512i lut64 = _mm512_load_si512(reinterpret_cast<const void*>(kFp4Lut64));
          w[rr][2 * h] = hn::Vec<decltype(d8)>{_mm512_permutexvar_epi8(raw[h].raw, lut64)};
          w[rr][2 * h + 1] = hn::Vec<decltype(d8)>{
              _mm512_permutexvar_epi8(_mm512_srli_epi16(raw[h].raw, 4), lut64)};
          continue;
        }
#endif
        w[rr][2 * h] = hn::And(raw[h], mask);
        w[rr][2 * h + 1] = hn::And(hn::ShiftRight<4>(raw[h]), mask);
        if constexpr (F != common::WeightFormat::kQ4_0) {
          w[rr][2 * h] = hn::TableLookupBytes(lut, w[rr][2 * h]);
          w[rr][2 * h + 1] = hn::TableLookupBytes(lut, w[rr][2 * h + 1]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const int8_t* a = acts[t].q + b;
      const auto xl0 = hn::LoadU(di8, a);
      const auto xh0 = hn::LoadU(di8, a + kh);
      const auto xl1 = hn::LoadU(di8, a + 64);
      const auto xh1 = hn::LoadU(di8, a + kh + 64);
      const int8_t* lane = acts[t].q + b / 2;
      const auto xs = hn::LoadU(df, reinterpret_cast<const float*>(lane + kxs));
      const auto neg = hn::LoadU(di32, reinterpret_cast<const int32_t*>(lane + kneg));
      for (int rr = 0; rr < NR; ++rr) {
        auto sum = DotAcc(di32, neg, w[rr][0], xl0);
        sum = DotAcc(di32, sum, w[rr][1], xh0);
        sum = DotAcc(di32, sum, w[rr][2], xl1);
        sum = DotAcc(di32, sum, w[rr][3], xh1);
        acc[rr][t] = hn::MulAdd(hn::ConvertTo(df, sum), hn::Mul(ws[rr], xs), acc[rr][t]);
      }
    }
  }
  AddLaneSums(df, &acc[0][0], NR, NT, sums);
  return nb;
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_INT8_ROWS_INL_H_ toggle guard
