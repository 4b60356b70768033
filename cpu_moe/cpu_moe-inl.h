// Per-target kernels of cpu_moe: textual header, included once per Highway target by cpu_moe.cc
// through hwy/foreach_target.h (the toggle guard below lets it re-enter). Not for other users.
//
// Layout of the work (see cpu_moe.h and seed 003):
//   prep x  -> pass 1 (gate_up rows, split by (group, row block), routes of the group inner)
//           -> h [routes, I] -> prep h -> pass 2 (down rows, split by (group, H-block) the same
//              way) -> part [routes, H] -> per token, the sum of its routes' rows -> y.
// A group is a unique expert with all its routes when deduping, a single route otherwise.
// Each weight row is decoded once per work item and dotted against up to 4 (bf16, fp8) or 8 (int8
// formats, bf16 by vdpbf16ps) routes at a time, so a row shared by several tokens is read from
// DRAM once and reused from registers / L1.

#if defined(MOE_CPU_MOE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INL_H_
#undef MOE_CPU_MOE_INL_H_
#else
#define MOE_CPU_MOE_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "cpu_moe/internal/forward_plan.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// Highway 1.0.3's AVX3_DL target string names avxvnni but not avx512vnni, although its CPU check
// requires AVX-512 VNNI for AVX3_DL; add it so the dpbusd intrinsics below compile.
#pragma GCC target("avx512vnni")
// AVX512_BF16 is no part of AVX3_DL (Ice Lake has AVX3_DL without it): enabled here so that the
// vdpbf16ps intrinsic compiles, and run only when Forward found the CPU feature at run time
// (ForwardPlan::bf16_dot_product). GCC 12 has no bf16 arithmetic type that other code could be
// compiled into these instructions from: the compiled AVX3_DL code holds AVX512_BF16
// instructions only where Bf16DotRows<..., true> is inlined (checked with objdump).
#pragma GCC target("avx512bf16")
// AMX tiles (tdpbf16ps) likewise run only when Forward found AMX-TILE and AMX-BF16 and Linux
// granted the tile state (ForwardPlan::amx).
#pragma GCC target("amx-tile,amx-bf16")
#endif
namespace moe {
namespace cpu_moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using common::BlockQ4_0;
using internal::ForwardPlan;

// Routes dotted against one decoded weight row at a time (at most; the stride of the sums
// arrays). bf16 with fp32 FMAs and fp8 use 4 (two fp32 accumulators per row and route, or the
// fp8 decode's registers), the int8 formats and bf16 by vdpbf16ps (kBf16Dot, one accumulator per
// row and route) 8.
constexpr int kTile = 8;
template <common::WeightFormat F, bool kBf16Dot = false>
constexpr int TileOf() {
  return F == common::WeightFormat::kQ4_0 || F == common::WeightFormat::kMxfp4 ||
                 F == common::WeightFormat::kNvfp4 ||
                 (kBf16Dot && F == common::WeightFormat::kBf16)
             ? 8
             : 4;
}
HWY_INLINE void Pf(const void* p) { hwy::Prefetch(p); }
// Into L2 only (prefetcht1); elsewhere as Pf.
HWY_INLINE void PfL2(const void* p) {
#if HWY_ARCH_X86
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  hwy::Prefetch(p);
#endif
}
// How far ahead of the current position the row kernels prefetch in the weight stream, carried
// in MatrixRef::prefetch: l1 bytes ahead into L1 (Tuning::prefetch_bytes, per format by
// default, see internal::Tuning::kAuto; 0: no software prefetch) and, where l2 is not 0, a second stream
// of prefetches l2 bytes ahead into L2 only (Tuning::prefetch_l2_bytes; bf16 and fp8 kernels).
// Rows of a work item are contiguous, so the prefetch runs on into the next row; the hardware
// prefetcher alone stalls at every 4 KiB page, and one core needs about 1-2 KiB in flight to
// approach its share of DRAM bandwidth.
struct PfDist {
  size_t l1 = 0;
  size_t l2 = 0;
};
// The prefetches for the 64 bytes of a row at p.
HWY_INLINE void PfAhead(const PfDist& pf, const void* p) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  if (pf.l1 != 0) Pf(b + pf.l1);
  if (pf.l2 != 0) PfL2(b + pf.l2);
}

// ---------------------------------------------------------------------------------------------
// Activations, prepared once per call in the layout the weight format's row kernel wants.
//
// Quantized formats (q4_0, mxfp4, nvfp4): int8 per 32-element block (scale amax / 127), split in
// two halves matching the low and high nibbles of the packed weights: for q4_0, byte b of `lo` is
// element 32(b/16) + b%16 and of `hi` element 32(b/16) + 16 + b%16; for mxfp4/nvfp4, lo[b] is
// element 2b and hi[b] element 2b + 1. An int32 dot-product lane j covers lo and hi bytes
// [4j, 4j+4), all in one 32-element activation block, whose scale is xs[j]. Weights are fed as
// unsigned (code + offset) so that u8 x s8 instructions (maddubs, dpbusd) apply; neg[j] =
// -offset * (sum of the 8 activation codes of lane j) removes the offset.
// bf16: xe[i] = x[2i], xo[i] = x[2i+1], matching the even/odd halves of a u32 lane of bf16 pairs.
// bf16 by the CPU's bf16 dot product (kBf16Dot): xb[i] = bf16(x[i]) (common::FloatToBf16), in
// natural order: vdpbf16ps multiplies the bf16 pair of each u32 lane of the weights with the pair
// in the same lane of the activations.
// fp8: x as is, except on AVX3_DL, whose table decode (Fp8DotRows) yields the weights of each
// 64-column chunk at c as 4 vectors v of 16 in a permuted order:
//   xf[c + 16v + j] = x[c + 16(j/4) + 8(v/2) + 2(j%4) + v%2]   (v < 4, j < 16);
// when k % 64 == 32, the last 32 columns (c = k - 32) likewise as 4 vectors of 8 (j < 8):
//   xf[c + 8v + j].
// fp8 by the bf16 dot product (kBf16Dot): xb = bf16(x) in the table decode's bf16 order, chunk
// by chunk (Fp8Pos), the last chunk zero-padded to 64 (Bf16PitchOf).
struct ActView {
  // Quantized formats: one vector of 2k bytes per activation, [lo k/2][hi k/2][xs k/8 floats]
  // [neg k/8 int32], so that with b the packed byte index, lo[b], hi[b], xs[b/4] and neg[b/4]
  // all sit at q + b plus a fixed offset (0, k/2, k, 3k/2): one pointer per activation.
  const int8_t* q;
  const uint16_t* xb;
  const float* xe;
  const float* xo;
  const float* xf;
};

template <common::WeightFormat F>
constexpr bool IsQuant() {
  return F == common::WeightFormat::kQ4_0 || F == common::WeightFormat::kMxfp4 ||
         F == common::WeightFormat::kNvfp4;
}

// Unsigned code offset of the packed weights (see ActView): q4_0 codes are q in [0, 15] for the
// value q - 8; fp4 codes go through a table to 2 * value + 12 in [0, 24].
template <common::WeightFormat F>
constexpr int QuantOffset() {
  return F == common::WeightFormat::kQ4_0 ? 8 : 12;
}

// Packed bytes at the start of a quantized row (nbytes = k / 2 in all) that the 512-bit targets
// dot in the block-lane layout (QuantDotBlockLane) when Tuning::block_lane allows: whole
// 128-byte chunks; 0 elsewhere. The rest of the row keeps the plain layout.
constexpr size_t kBlockLaneChunk = 128;
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
HWY_INLINE constexpr size_t BlockLaneBytes(size_t nbytes, bool enabled) {
  return enabled ? nbytes / kBlockLaneChunk * kBlockLaneChunk : 0;
}
#else
HWY_INLINE constexpr size_t BlockLaneBytes(size_t, bool) { return 0; }
#endif

// fp8 by the bf16 dot product (vdpbf16ps, AMX): the table decode (Fp8Decoder) yields the bf16
// weights of a 64-column chunk as two vectors of 32, position 32b + 8a + i (a < 4, b < 2,
// i < 8) holding column 16a + 8b + i; the activations are laid out likewise, so that each u32
// lane pairs the same two columns on both sides. Column jj of a chunk -> its position:
HWY_INLINE constexpr size_t Fp8Pos(size_t jj) {
  return 32 * ((jj >> 3) & 1) + 8 * (jj >> 4) + (jj & 7);
}
// u16 per bf16 activation vector of length k (fp8's chunks are whole, zero-padded).
template <common::WeightFormat F>
HWY_INLINE constexpr size_t Bf16PitchOf(size_t k) {
  return F == common::WeightFormat::kFp8Block ? (k + 63) / 64 * 64 : k;
}

// dst[j] = common::FloatToBf16(src[j]) for j < n, vectorized (the same rounding to nearest
// even; NaN stays a quiet NaN with its sign and top payload bits).
HWY_INLINE void FloatsToBf16(const float* HWY_RESTRICT src, size_t n,
                             uint16_t* HWY_RESTRICT dst) {
  const hn::ScalableTag<uint32_t> du;
  const hn::RebindToSigned<decltype(du)> di;
  const hn::Rebind<uint16_t, decltype(du)> d16;
  const size_t N = hn::Lanes(du);
  size_t j = 0;
  for (; j + N <= n; j += N) {
    const auto u = hn::LoadU(du, reinterpret_cast<const uint32_t*>(src + j));
    const auto hi = hn::ShiftRight<16>(u);
    const auto rounded =
        hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7FFFu)), hn::And(hi, hn::Set(du, 1u))));
    // |bits| > inf's as int32 (both sides are non-negative there).
    const auto is_nan = hn::RebindMask(
        du, hn::Gt(hn::BitCast(di, hn::And(u, hn::Set(du, 0x7FFFFFFFu))), hn::Set(di, 0x7F800000)));
    const auto r = hn::IfThenElse(is_nan, hn::Or(hi, hn::Set(du, 0x40u)), rounded);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, r)), d16, dst + j);
  }
  for (; j < n; ++j) dst[j] = common::FloatToBf16(src[j]);
}

// Storage for n activation vectors of length k in format F's layout (kBf16Dot: bf16 rounded, for
// the CPU's bf16 dot product).
template <common::WeightFormat F, bool kBf16Dot = false>
class ActSet {
 public:
  // Bytes of storage for n vectors of length k.
  static size_t Bytes(size_t n, size_t k) {
    if constexpr (IsQuant<F>()) return n * 2 * k;
    if constexpr (kBf16Dot) return n * Bf16Pitch(k) * sizeof(uint16_t);
    return n * k * sizeof(float);
  }
  // block_lane: lay quantized activations out for QuantDotBlockLane (MatrixRef::block_lane).
  // panels: for PanelDot instead (panel banks): [codes k, natural order][xs k/32 floats]
  // [-offset x code sum per 16 columns, k/16 int32].
  // storage: Bytes(n, k) bytes, 64-byte aligned, which must outlive the set.
  ActSet(size_t n, size_t k, bool block_lane, void* storage, bool panels = false)
      : k_(k), n_(n), block_lane_(block_lane), panels_(panels),
        mem_(static_cast<uint8_t*>(storage)) {}

  ActView View(size_t i) const {
    ActView v{};
    if constexpr (IsQuant<F>()) {
      v.q = reinterpret_cast<const int8_t*>(mem_) + i * 2 * k_;
    } else if constexpr (kBf16Dot) {
      v.xb = reinterpret_cast<const uint16_t*>(mem_) + i * Bf16Pitch(k_);
    } else if constexpr (F == common::WeightFormat::kBf16) {
      v.xe = reinterpret_cast<const float*>(mem_) + i * k_;
      v.xo = v.xe + k_ / 2;
    } else {
      v.xf = reinterpret_cast<const float*>(mem_) + i * k_;
    }
    return v;
  }

  // Fills vector i from x[k].
  void Prepare(size_t i, const float* HWY_RESTRICT x) { PrepareRange(i, x, 0, k_); }

  // Fills elements [c0, c1) of vector i from x[c0, c1) (x is the whole vector). c0 and c1 must
  // be multiples of Granule() or c1 == k: the layouts group elements in blocks (int8 scales per
  // 32, fp8's table order per 64 on AVX3_DL, bf16 pairs), and a range covers whole blocks.
  void PrepareRange(size_t i, const float* HWY_RESTRICT x, size_t c0, size_t c1) {
    const ActView v = View(i);
    if constexpr (IsQuant<F>()) {
      int8_t* lo = const_cast<int8_t*>(v.q);
      int8_t* hi = lo + k_ / 2;
      float* xs = reinterpret_cast<float*>(lo + k_);
      int32_t* neg = reinterpret_cast<int32_t*>(lo + 3 * k_ / 2);
      for (size_t b = c0 / 32; b < c1 / 32; ++b) {
        const float* xb = x + 32 * b;
        // Vectorized, same IEEE operations as the scalar definition: amax = max |x|,
        // d = amax / 127, q = round-to-nearest-even(clamp(x * (1 / d), -127, 127)).
        const hn::CappedTag<float, 16> df;
        const size_t nl = hn::Lanes(df);
        auto m = hn::Zero(df);
        for (size_t j = 0; j < 32; j += nl) m = hn::Max(m, hn::Abs(hn::LoadU(df, xb + j)));
        const float amax = hn::GetLane(hn::MaxOfLanes(df, m));
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        const auto vinv = hn::Set(df, inv);
        const auto lim = hn::Set(df, 127.0f);
        HWY_ALIGN int8_t q[32 + 16];
        for (size_t j = 0; j < 32; j += nl) {
          const auto v = hn::Min(lim, hn::Max(hn::Neg(lim), hn::Mul(hn::LoadU(df, xb + j), vinv)));
          const auto qi = hn::NearestInt(v);
          hn::StoreU(hn::DemoteTo(hn::Rebind<int8_t, decltype(df)>(), qi), hn::Rebind<int8_t, decltype(df)>(), q + j);
        }
        // The block's 16 packed bytes' activation codes in packed-byte order (see ActView): q4_0
        // keeps the two halves of the block, the fp4 formats split even and odd elements. (Every
        // target here is x86 with SSE4, so 128-bit intrinsics serve all of them.)
        __m128i bl = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
        __m128i bh = _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16));
        if (panels_) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 32 * b), bl);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 32 * b + 16), bh);
          float* pxs = reinterpret_cast<float*>(lo + k_);
          int32_t* pneg = reinterpret_cast<int32_t*>(lo + k_ + k_ / 8);
          pxs[b] = d;
          // Sums of 16 signed codes: psadbw of the codes biased to unsigned, both halves.
          const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
          const __m128i sl = _mm_sad_epu8(_mm_xor_si128(bl, bias), _mm_setzero_si128());
          const __m128i sh = _mm_sad_epu8(_mm_xor_si128(bh, bias), _mm_setzero_si128());
          const int32_t suml = static_cast<int32_t>(_mm_cvtsi128_si64(sl) + _mm_extract_epi64(sl, 1)) - 2048;
          const int32_t sumh = static_cast<int32_t>(_mm_cvtsi128_si64(sh) + _mm_extract_epi64(sh, 1)) - 2048;
          pneg[2 * b] = -QuantOffset<F>() * suml;
          pneg[2 * b + 1] = -QuantOffset<F>() * sumh;
          continue;
        }
        if constexpr (F != common::WeightFormat::kQ4_0) {
          const __m128i even_odd =
              _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
          const __m128i a = _mm_shuffle_epi8(bl, even_odd), c = _mm_shuffle_epi8(bh, even_odd);
          bl = _mm_unpacklo_epi64(a, c);
          bh = _mm_unpackhi_epi64(a, c);
        }
        if (16 * (b + 1) <= BlockLaneBytes(k_ / 2, block_lane_)) {
          // Block-lane layout (QuantDotBlockLane): packed byte v = 128c + 8j + 4s + m of a
          // 128-byte chunk c goes to 128c + 64s + 4j + m, and lane j's scale and correction to
          // index 16c + j; this block holds bytes [16t, 16t + 16) of chunk c = b / 8, t = b % 8,
          // i.e. lanes j = 2t + h: its 4-byte words 0 and 2 go to 128c + 8t, 1 and 3 to
          // 128c + 64 + 8t, and lane 2t + h sums bytes [8h, 8h + 8) of both halves.
          const size_t c = b / 8, t = b % 8;
          const __m128i lw = _mm_shuffle_epi32(bl, _MM_SHUFFLE(3, 1, 2, 0));
          const __m128i hw = _mm_shuffle_epi32(bh, _MM_SHUFFLE(3, 1, 2, 0));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(lo + 128 * c + 8 * t), lw);
          _mm_storel_epi64(reinterpret_cast<__m128i*>(lo + 128 * c + 64 + 8 * t),
                           _mm_unpackhi_epi64(lw, lw));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(hi + 128 * c + 8 * t), hw);
          _mm_storel_epi64(reinterpret_cast<__m128i*>(hi + 128 * c + 64 + 8 * t),
                           _mm_unpackhi_epi64(hw, hw));
          // Sums of 8 signed codes per 64-bit half: psadbw of the codes biased to unsigned.
          const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
          const __m128i sad = _mm_add_epi64(_mm_sad_epu8(_mm_xor_si128(bl, bias), _mm_setzero_si128()),
                                            _mm_sad_epu8(_mm_xor_si128(bh, bias), _mm_setzero_si128()));
          for (int h = 0; h < 2; ++h) {
            const int32_t sum = static_cast<int32_t>(h == 0 ? _mm_cvtsi128_si64(sad)
                                                            : _mm_extract_epi64(sad, 1)) - 2048;
            xs[16 * c + 2 * t + h] = d;
            neg[16 * c + 2 * t + h] = -QuantOffset<F>() * sum;
          }
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * b), bl);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * b), bh);
          // Lane l = 4b + l' sums bytes [4l', 4l' + 4) of both halves.
          const __m128i ones8 = _mm_set1_epi8(1);
          const __m128i pairs = _mm_add_epi16(_mm_maddubs_epi16(ones8, bl),
                                              _mm_maddubs_epi16(ones8, bh));
          const __m128i sums = _mm_madd_epi16(pairs, _mm_set1_epi16(1));
          _mm_storeu_ps(xs + 4 * b, _mm_set1_ps(d));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(neg + 4 * b),
                           _mm_mullo_epi32(sums, _mm_set1_epi32(-QuantOffset<F>())));
        }
      }
    } else if constexpr (kBf16Dot && F == common::WeightFormat::kFp8Block) {
      // fp8: the table decode's column order per 64-column chunk (Fp8Pos: its groups of 8
      // columns g = 0..7 in the order 0, 2, 4, 6, 1, 3, 5, 7), a short last chunk padded with
      // zeros.
      uint16_t* xb = const_cast<uint16_t*>(v.xb);
      for (size_t c = c0 / 64 * 64; c < c1; c += 64) {
        HWY_ALIGN uint16_t chunk[64] = {};
        FloatsToBf16(x + c, std::min<size_t>(64, k_ - c), chunk);
        for (size_t g = 0; g < 8; ++g) {
          static_assert(Fp8Pos(8) == 32 && Fp8Pos(16) == 8, "group order of Fp8Pos");
          std::memcpy(xb + c + Fp8Pos(8 * g), chunk + 8 * g, 8 * sizeof(uint16_t));
        }
      }
    } else if constexpr (kBf16Dot) {
      FloatsToBf16(x + c0, c1 - c0, const_cast<uint16_t*>(v.xb) + c0);
    } else if constexpr (F == common::WeightFormat::kBf16) {
      float* xe = const_cast<float*>(v.xe);
      float* xo = const_cast<float*>(v.xo);
      for (size_t j = c0 / 2; j < c1 / 2; ++j) {
        xe[j] = x[2 * j];
        xo[j] = x[2 * j + 1];
      }
    } else {
#if HWY_TARGET == HWY_AVX3_DL
      // The chunk order of Fp8DotRows' table decode (see ActView); k_ is a multiple of 32.
      float* xf = const_cast<float*>(v.xf);
      for (size_t c = c0; c < c1; c += 64) {
        const size_t nj = c + 64 <= k_ ? 16 : 8;  // floats per vector: full chunk or 32-col tail
        for (size_t vec = 0; vec < 4; ++vec) {
          for (size_t j = 0; j < nj; ++j) {
            xf[c + nj * vec + j] = x[c + 16 * (j / 4) + 8 * (vec / 2) + 2 * (j % 4) + vec % 2];
          }
        }
      }
#else
      std::memcpy(const_cast<float*>(v.xf) + c0, x + c0, (c1 - c0) * sizeof(float));
#endif
    }
  }

  // See PrepareRange.
  static constexpr size_t Granule() {
    if constexpr (IsQuant<F>()) return 32;
    if constexpr (F == common::WeightFormat::kBf16) return 2;
#if HWY_TARGET == HWY_AVX3_DL
    return 64;
#else
    return 1;
#endif
  }

  size_t size() const { return n_; }

 private:
  static constexpr size_t Bf16Pitch(size_t k) { return Bf16PitchOf<F>(k); }

  size_t k_;
  size_t n_;
  bool block_lane_;
  bool panels_;
  uint8_t* mem_;
};

// sums[i / nt][i % nt] += (sum of the lanes of v[i]) for i < n = nr * nt: the horizontal sums at
// the end of a row's dot products, four vectors at a time with horizontal adds (about 6 vector
// operations per sum instead of SumOfLanes' 9 for 16 lanes, which matters for pass 2's short
// rows). Every vector's lanes are added in one fixed order whatever n and its position (a
// partial group of four is padded with zeros), so a row's result does not depend on how many
// rows or tokens are reduced with it.
template <class DF>
HWY_INLINE void AddLaneSums(DF df, const hn::Vec<DF>* v, int nr, int nt,
                            float (*HWY_RESTRICT sums)[kTile]) {
  const int n = nr * nt;
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2 || \
    HWY_TARGET == HWY_SSE4
  (void)df;
  for (int g = 0; g < n; g += 4) {
    HWY_ALIGN float r[4];
    constexpr size_t kBytes = sizeof(hn::Vec<DF>);
    if constexpr (kBytes >= 32) {
      __m256 f[4];
      for (int j = 0; j < 4; ++j) {
        if (g + j >= n) {
          f[j] = _mm256_setzero_ps();
        } else if constexpr (kBytes == 64) {
          const __m512 x = v[g + j].raw;
          f[j] = _mm256_add_ps(_mm512_castps512_ps256(x),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        } else {
          f[j] = v[g + j].raw;
        }
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[1]), _mm256_hadd_ps(f[2], f[3]));
      _mm_store_ps(r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
      __m128 f[4];
      for (int j = 0; j < 4; ++j) f[j] = g + j < n ? v[g + j].raw : _mm_setzero_ps();
      _mm_store_ps(r, _mm_hadd_ps(_mm_hadd_ps(f[0], f[1]), _mm_hadd_ps(f[2], f[3])));
    }
    for (int j = 0; j < 4 && g + j < n; ++j) sums[(g + j) / nt][(g + j) % nt] += r[j];
  }
#else
  for (int i = 0; i < n; ++i) sums[i / nt][i % nt] += hn::GetLane(hn::SumOfLanes(df, v[i]));
#endif
}

// ---------------------------------------------------------------------------------------------
// One weight matrix of the bank ([E, rows, cols]) and the row kernels.

struct MatrixRef {
  const void* weights;
  const void* scales;
  const float* globals;
  size_t rows;
  size_t cols;
  PfDist prefetch;  // how far ahead the row kernels prefetch; see above
  bool block_lane;  // quantized rows start in the block-lane layout (BlockLaneBytes)
};

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
// (about 30% of pass 2's time for mxfp4 on one dev-box core, where rows are only 3 chunks long).
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
    q.post = 0.5f * m.globals[e];
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

// ---------------------------------------------------------------------------------------------
// Panel banks (Layout::kPanels, cpu_moe.h): 16 rows per panel, int32 lane j of each vector row j.

// Scale bytes per 32-column block of a panel.
template <common::WeightFormat F>
constexpr size_t PanelScaleBytes() {
  return F == common::WeightFormat::kMxfp4 ? 16 : 32;
}
// Bytes of one panel of a matrix with k columns.
template <common::WeightFormat F>
HWY_INLINE size_t PanelBytes(size_t k) {
  return k / 32 * (256 + PanelScaleBytes<F>());
}

// Row scales of a panel's block as f32 lanes: the n = Lanes(df) rows from `p` on (q4_0: fp16 d;
// mxfp4: ue8m0 2^(e - 127), 0 -> 2^-127, 0xFF -> NaN; nvfp4: e4m3 value, 0x7F / 0xFF NaN), the
// same values as the row-major kernels' lane scales.
template <common::WeightFormat F, class DF>
HWY_INLINE hn::Vec<DF> PanelScales(DF df, const uint8_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du32;
  if constexpr (F == common::WeightFormat::kQ4_0) {
    const hn::Rebind<hwy::float16_t, DF> df16;
    return hn::PromoteTo(df, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(p)));
  } else {
    return ScaleCodesToF32<F>(df, hn::PromoteTo(du32, hn::LoadU(hn::Rebind<uint8_t, DF>(), p)));
  }
}

// out[p * NT + t][j] = scale[t] * dot(row 16 panels[p] + j of expert e of m, acts[t]) for
// p < NP, t < NT, j < 16: NP panels of a panel bank against NT activations in the panel layout
// (ActSet with panels: int8 codes in natural order, a scale per 32 and -offset x the code sum
// per 16 columns). Per 32-column block, each panel's 256 code bytes become 8 vectors of unsigned
// codes, w[g] holding columns 4g..4g+3 of the block in lane j (row j), and each route's 4-byte
// activation groups are broadcast to every lane: 8 dot products into one int32 sum per route
// (in two chains of 4, added; nvfp4: one sum per 16-column block), converted and scaled once.
// Vectors narrower than 64 bytes take the panel's rows a slice at a time (rows [s/4, s/4 + N/4)
// for byte offset s). Panels go two at a time within each block (NP = 4: the four streams of
// Tuning::row_streams, whose 32 decoded vectors would not fit in the registers with the sums);
// each panel's sums are the same chain of operations whatever NP is.
template <common::WeightFormat F, int NP, int NT>
HWY_INLINE void PanelDot(const MatrixRef& m, size_t e, const size_t* panels, const ActView* acts,
                         const float* scale, float* const* out) {
  const hn::CappedTag<uint8_t, 64> d8;
  const hn::Repartition<int8_t, decltype(d8)> di8;
  const hn::Repartition<int32_t, decltype(d8)> di32;
  const hn::Repartition<float, decltype(d8)> df;
  const size_t N8 = hn::Lanes(d8);
  const size_t k = m.cols, nb = k / 32;
  constexpr size_t kSb = PanelScaleBytes<F>();
  constexpr bool kNv = F == common::WeightFormat::kNvfp4;
  constexpr int kG = NP < 2 ? NP : 2;
  static_assert(NP % kG == 0, "panels go two at a time");
  // Blocks go in groups of kGrp (Layout::kPanels), each group's codes followed by its line of
  // scales: block b of group [g0, g0 + n) has its codes at 256 b + kSb g0 and its scales at
  // (256 + kSb) g0 + 256 n + kSb (b - g0) in its panel. Each panel is one sequential stream.
  constexpr size_t kGrp = 64 / kSb;
  static_assert((kGrp & (kGrp - 1)) == 0, "groups of a power of two blocks");
  // Prefetches, per block of each panel, m.prefetch.l1 bytes ahead into L1 and (when not 0)
  // m.prefetch.l2 bytes ahead into L2: the 5 lines from the block's codes on, which cover the
  // block's codes and what follows them (the next block's, or the group's scales).
  const size_t pf = m.prefetch.l1, pf2 = m.prefetch.l2;
  const auto mask = hn::Set(d8, 0x0F);
  const auto lut = hn::LoadDup128(d8, kFp4Lut);
  const uint8_t* codes[NP];
  for (int p = 0; p < NP; ++p) {
    codes[p] = static_cast<const uint8_t*>(m.weights) +
               (e * (m.rows / 16) + panels[p]) * PanelBytes<F>(k);
  }
  for (size_t s = 0; s < 64; s += N8) {
    hn::Vec<decltype(df)> acc[NP][NT];
    for (int p = 0; p < NP; ++p) {
      for (int t = 0; t < NT; ++t) acc[p][t] = hn::Zero(df);
    }
    for (size_t b = 0; b < nb; ++b) {
      for (int p0 = 0; p0 < NP; p0 += kG) {
        hn::Vec<decltype(d8)> w[kG][8];
        hn::Vec<decltype(df)> ws[kG][kNv ? 2 : 1];
        for (int p = 0; p < kG; ++p) {
          const size_t g0 = b & ~(kGrp - 1);
          const size_t n = std::min(kGrp, nb - g0);
          const uint8_t* c = codes[p0 + p] + 256 * b + kSb * g0;
          const uint8_t* sc = codes[p0 + p] + (256 + kSb) * g0 + 256 * n + kSb * (b - g0);
          if (pf != 0 && s == 0) {
            for (size_t o = 0; o < 320; o += 64) Pf(c + pf + o);
            if (pf2 != 0) {
              for (size_t o = 0; o < 320; o += 64) PfL2(c + pf2 + o);
            }
          }
          for (int v = 0; v < 4; ++v) {
            const auto raw = hn::LoadU(d8, c + 64 * v + s);
#if HWY_TARGET == HWY_AVX3_DL
            if constexpr (F != common::WeightFormat::kQ4_0) {
              if constexpr (hn::MaxLanes(d8) == 64) {
                // fp4 codes through vpermb over kFp4Lut repeated 4 times, which reads only the
                // low 6 bits of each index byte: the low nibble alone picks the entry, so
                // neither nibble needs masking (see QuantDotBlockLane). Side by side on the host
                // (session 8): fp4 steps 0.2-4% faster than mask, shift, mask and pshufb.
                const __m512i lut64 = _mm512_load_si512(reinterpret_cast<const void*>(kFp4Lut64));
                w[p][2 * v] = hn::Vec<decltype(d8)>{_mm512_permutexvar_epi8(raw.raw, lut64)};
                w[p][2 * v + 1] = hn::Vec<decltype(d8)>{
                    _mm512_permutexvar_epi8(_mm512_srli_epi16(raw.raw, 4), lut64)};
                continue;
              }
            }
#endif
            w[p][2 * v] = hn::And(raw, mask);
            w[p][2 * v + 1] = hn::And(hn::ShiftRight<4>(raw), mask);
            if constexpr (F != common::WeightFormat::kQ4_0) {
              w[p][2 * v] = hn::TableLookupBytes(lut, w[p][2 * v]);
              w[p][2 * v + 1] = hn::TableLookupBytes(lut, w[p][2 * v + 1]);
            }
          }
          if constexpr (kNv) {
            ws[p][0] = PanelScales<F>(df, sc + s / 4);
            ws[p][1] = PanelScales<F>(df, sc + 16 + s / 4);
          } else {
            ws[p][0] = PanelScales<F>(df, sc + (F == common::WeightFormat::kQ4_0 ? s / 2 : s / 4));
          }
        }
        for (int t = 0; t < NT; ++t) {
          const int8_t* q = acts[t].q;
          const int8_t* a = q + 32 * b;
          const float xs = reinterpret_cast<const float*>(q + k)[b];
          const int32_t* neg = reinterpret_cast<const int32_t*>(q + k + k / 8) + 2 * b;
          const auto xv = hn::Set(df, xs);
          // Each broadcast group of 4 activation codes serves every panel (nvfp4: per 16-column
          // half, with that half's scales).
          for (int h = 0; h < (kNv ? 2 : 1); ++h) {
            // Two int32 chains per panel (even and odd groups), added before the conversion:
            // half the dependent dot products in a row, one addition more (one chain was up to 3%
            // slower at 4 routes per expert side by side on the host, session 8).
            hn::Vec<decltype(di32)> sum[kG][2];
            for (int p = 0; p < kG; ++p) {
              sum[p][0] = hn::Set(di32, kNv ? neg[h] : neg[0] + neg[1]);
              sum[p][1] = hn::Zero(di32);
            }
            for (int g = kNv ? 4 * h : 0; g < (kNv ? 4 * h + 4 : 8); ++g) {
              int32_t word;
              std::memcpy(&word, a + 4 * g, 4);
              const auto x = hn::BitCast(di8, hn::Set(di32, word));
              for (int p = 0; p < kG; ++p) sum[p][g % 2] = DotAcc(di32, sum[p][g % 2], w[p][g], x);
            }
            for (int p = 0; p < kG; ++p) {
              acc[p0 + p][t] = hn::MulAdd(hn::ConvertTo(df, hn::Add(sum[p][0], sum[p][1])),
                                     hn::Mul(ws[p][h], xv), acc[p0 + p][t]);
            }
          }
        }
        }
      }
    for (int p = 0; p < NP; ++p) {
      for (int t = 0; t < NT; ++t) {
        hn::StoreU(hn::Mul(acc[p][t], hn::Set(df, scale[t])), df, out[p * NT + t] + s / 4);
      }
    }
  }
}

// PanelDot for any number n of activations, NT = 8 / NP at a time (NP = 4: 2, the four
// streams of experts with few routes, Tuning::row_streams).
template <common::WeightFormat F, int NP>
HWY_INLINE void PanelDotMany(const MatrixRef& m, size_t e, const size_t* panels,
                             const ActView* acts, const float* scale, int n, float* const* out) {
  constexpr int kT = 8 / NP;
  float* o[NP * kT];
  for (int t = 0; t < n; t += kT) {
    const int nt = std::min(kT, n - t);
    for (int p = 0; p < NP; ++p) {
      for (int i = 0; i < nt; ++i) o[p * nt + i] = out[p * n + t + i];
    }
    switch (nt) {
      case 8: if constexpr (kT >= 8) PanelDot<F, NP, 8>(m, e, panels, acts + t, scale + t, o); break;
      case 7: if constexpr (kT >= 8) PanelDot<F, NP, 7>(m, e, panels, acts + t, scale + t, o); break;
      case 6: if constexpr (kT >= 8) PanelDot<F, NP, 6>(m, e, panels, acts + t, scale + t, o); break;
      case 5: if constexpr (kT >= 8) PanelDot<F, NP, 5>(m, e, panels, acts + t, scale + t, o); break;
      case 4: if constexpr (kT >= 4) PanelDot<F, NP, 4>(m, e, panels, acts + t, scale + t, o); break;
      case 3: if constexpr (kT >= 4) PanelDot<F, NP, 3>(m, e, panels, acts + t, scale + t, o); break;
      case 2: PanelDot<F, NP, 2>(m, e, panels, acts + t, scale + t, o); break;
      default: PanelDot<F, NP, 1>(m, e, panels, acts + t, scale + t, o); break;
    }
  }
}

// The factor of a panel bank's sums before the route's own weight: the fp4 table's 1/2 and
// nvfp4's global scale (as QuantRow::post).
template <common::WeightFormat F>
HWY_INLINE float PanelPost(const MatrixRef& m, size_t e) {
  if constexpr (F == common::WeightFormat::kQ4_0) return 1.0f;
  if constexpr (F == common::WeightFormat::kMxfp4) return 0.5f;
  return 0.5f * m.globals[e];
}

// Prefetches the first m.prefetch.l1 bytes of panel `panel` of expert e (codes and scales).
template <common::WeightFormat F>
HWY_INLINE void PrefetchPanel(const MatrixRef& m, size_t e, size_t panel) {
  const uint8_t* c =
      static_cast<const uint8_t*>(m.weights) + (e * (m.rows / 16) + panel) * PanelBytes<F>(m.cols);
  for (size_t o = 0; o < m.prefetch.l1 && o < PanelBytes<F>(m.cols); o += 64) Pf(c + o);
}

template <int NR, int NT, class DF>
HWY_INLINE size_t Bf16DotLevel(DF df, const uint16_t* const* w, const ActView* acts, size_t i,
                               size_t npairs, PfDist pf, float (*HWY_RESTRICT sums)[kTile]) {
  // i counts element pairs (u32 lanes).
  const size_t n = hn::Lanes(df);
  if (i + n > npairs) return i;
  const hn::RebindToUnsigned<DF> du32;
  const hn::Repartition<uint16_t, DF> du16;
  const auto hi_mask = hn::Set(du32, 0xFFFF0000u);
  hn::Vec<DF> a0[NR][NT], a1[NR][NT];
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) a0[rr][t] = a1[rr][t] = hn::Zero(df);
  }
  for (; i + n <= npairs; i += n) {
    hn::Vec<DF> we[NR], wo[NR];
    for (int rr = 0; rr < NR; ++rr) {
      if constexpr (hn::MaxLanes(DF()) >= 8) {
        PfAhead(pf, w[rr] + 2 * i);
      }
      const auto w32 = hn::BitCast(du32, hn::LoadU(du16, w[rr] + 2 * i));
      we[rr] = hn::BitCast(df, hn::ShiftLeft<16>(w32));
      wo[rr] = hn::BitCast(df, hn::And(w32, hi_mask));
    }
    for (int t = 0; t < NT; ++t) {
      const auto xe = hn::LoadU(df, acts[t].xe + i);
      const auto xo = hn::LoadU(df, acts[t].xo + i);
      for (int rr = 0; rr < NR; ++rr) {
        a0[rr][t] = hn::MulAdd(we[rr], xe, a0[rr][t]);
        a1[rr][t] = hn::MulAdd(wo[rr], xo, a1[rr][t]);
      }
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) a0[rr][t] = hn::Add(a0[rr][t], a1[rr][t]);
  }
  AddLaneSums(df, &a0[0][0], NR, NT, sums);
  return i;
}

template <int NR, int NT, class DF>
HWY_INLINE void Bf16DotAll(DF df, const uint16_t* const* w, const ActView* acts, size_t i,
                           size_t npairs, PfDist pf, float (*sums)[kTile]) {
  i = Bf16DotLevel<NR, NT>(df, w, acts, i, npairs, pf, sums);
  if constexpr (hn::MaxLanes(DF()) > 4) {
    if (i < npairs) Bf16DotAll<NR, NT>(hn::Half<DF>(), w, acts, i, npairs, pf, sums);
  }
}

// NR bf16 rows of k elements x NT activations, added into sums[row][t]. kBf16Dot (AVX3_DL with
// AVX512_BF16 only, see ForwardPlan::bf16_dot_product): vdpbf16ps against the bf16 activations
// (ActView::xb); lane j of one instruction adds w[2j] x[2j] + w[2j+1] x[2j+1] over the 32
// elements [c, c + 32) (bf16 products are exact in fp32; the sums round). k is a multiple of 32
// (ValidateBank), a whole number of 512-bit vectors: no tail. One accumulator per (row, token):
// the rows' 2 weight vectors and up to 16 accumulators fit the 32 registers at NT = 8, and every
// (row, token) sums its lanes in the same order whatever NR and NT are. Like Bf16DotLevel, one
// prefetch per 64 bytes of each row, pf bytes ahead. Otherwise: fp32 FMAs (Bf16DotAll).
template <int NR, int NT, bool kBf16Dot>
HWY_INLINE void Bf16DotRows(const uint16_t* const* w, const ActView* acts, size_t k, PfDist pf,
                            float (*HWY_RESTRICT sums)[kTile]) {
  const hn::ScalableTag<float> df;
  if constexpr (kBf16Dot) {
#if HWY_TARGET == HWY_AVX3_DL
    hn::Vec<decltype(df)> acc[NR][NT];
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) acc[rr][t] = hn::Zero(df);
    }
    for (size_t c = 0; c < k; c += 32) {
      __m512bh wv[NR];
      for (int rr = 0; rr < NR; ++rr) {
        PfAhead(pf, w[rr] + c);
        wv[rr] = (__m512bh)_mm512_loadu_si512(w[rr] + c);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(acts[t].xb + c);
        for (int rr = 0; rr < NR; ++rr) {
          acc[rr][t].raw = _mm512_dpbf16_ps(acc[rr][t].raw, wv[rr], xv);
        }
      }
    }
    AddLaneSums(df, &acc[0][0], NR, NT, sums);
#else
    static_assert(!kBf16Dot, "vdpbf16ps is used on AVX3_DL only");
#endif
  } else {
    Bf16DotAll<NR, NT>(df, w, acts, 0, k / 2, pf, sums);
  }
}

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
// ---------------------------------------------------------------------------------------------
// AMX (ForwardPlan::amx): experts with at least amx_min_routes routes, through tdpbf16ps.
//
// One tdpbf16ps multiplies an A tile of m <= 16 weight rows x 32 bf16 columns by a B tile of the
// routes' bf16 activations (16 rows of column pairs x nr <= 16 routes) into a C tile of m x nr
// fp32 sums, so the work per weight byte no longer grows with the routes: vdpbf16ps (or fp8's
// fp32 FMAs) does one instruction per 32 (16) weights per route, AMX one per 512 weights for up
// to 16 routes. A tile's rows are first staged whole (fp8: the table decode above, exact; bf16:
// copied) into an L2 scratch from which the A tiles load (AmxStager): tile loads straight from
// rows 2-4 KiB apart were latency-bound at 11-15 GB/s per core (session 3's attempt); staging
// and tile loads do not overlap on these cores, see benchmarks/h200host_tuning_2026-11-30_session4.md.
// Two row sets go together (pass 1: gate and up rows; pass 2: rows p and p + n/2 of a block), as
// in the vector kernels, with their own C tiles.
//
// fp8 block scales: the m rows of a tile lie in one 128-row scale block (the caller splits there),
// so a 128-column block's sums share one scale: C is stored and zeroed after each 128 columns and
// added into fp32 accumulators times the scale, as Fp8DotRows does with its block totals.
//
// Each C element is its own chain of fp32 additions over the columns, whatever rows and routes
// share its tile, so results do not depend on the row blocking or on the routes' grouping.

// Tiles 0, 1: C of sets a, b (m x nr fp32); 2, 3: A of set a (halves 0 / 1 of a 64-column
// chunk); 4, 5: A of set b; 6, 7: B halves (16 column pairs x nr).
struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

HWY_INLINE void AmxConfigure(int m, int nr) {
  AmxTileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = static_cast<uint16_t>(4 * nr);
  }
  for (int t = 2; t < 6; ++t) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(4 * nr);
  }
  _tile_loadconfig(&c);
}

// Packs the bf16 activations of routes acts[0, nr) (nr <= 16) over k columns (a multiple of 32)
// into B rows: chunk c (columns [64c, 64c + 64)) is 32 rows of nr u32, row r column n holding
// route n's u32 (bf16 pair) r of the chunk, in the activations' own order, which is the A tiles'
// (fp8: the table decode's, Fp8Pos, zero-padded to whole chunks: kFp8Order; bf16: natural).
// bf16's short last chunk (32 columns) has zero rows 16..31 (its A half 1 is zero too).
template <bool kFp8Order>
HWY_INLINE void AmxPackB(const ActView* acts, int nr, size_t k, uint32_t* HWY_RESTRICT b) {
  const size_t nch = (k + 63) / 64;
  for (size_t c = 0; c < nch; ++c) {
    uint32_t* t = b + 32 * nr * c;
    const int ndw = kFp8Order || c * 64 + 64 <= k ? 32 : 16;
    if (ndw < 32) std::memset(t, 0, 32 * nr * sizeof(uint32_t));
    for (int n = 0; n < nr; ++n) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(acts[n].xb + 64 * c);
      for (int dd = 0; dd < ndw; ++dd) t[dd * nr + n] = src[dd];
    }
  }
}

// Decodes (fp8) or copies (bf16) 64-column chunk c of a row of k columns into s (tile-ready:
// chunk c at s + 64c, A half 0 at +0, half 1 at +32); a 32-column tail chunk fills half 0 and
// zeroes half 1 (bf16) or fills positions i < 16 of both halves (fp8). Software prefetch pf
// bytes ahead in the row (and on into the rows after it: the rows of a set are contiguous).
template <bool kFp8>
HWY_INLINE void AmxStageChunk(const Fp8Decoder& dec, const uint8_t* row, size_t c, size_t k,
                              PfDist pf, uint16_t* HWY_RESTRICT s) {
  const bool tail = 64 * c + 64 > k;
  if constexpr (kFp8) {
    PfAhead(pf, row + 64 * c);
    __m512i p0, p1;
    dec.DecodeBf16(LoadFp8Codes(row + 64 * c, !tail), p0, p1);
    _mm512_store_si512(s + 64 * c, p0);
    _mm512_store_si512(s + 64 * c + 32, p1);
  } else {
    PfAhead(pf, row + 128 * c);
    PfAhead(pf, row + 128 * c + 64);
    _mm512_store_si512(s + 64 * c, _mm512_loadu_si512(row + 128 * c));
    _mm512_store_si512(s + 64 * c + 32,
                       tail ? _mm512_setzero_si512() : _mm512_loadu_si512(row + 128 * c + 64));
  }
}

// Stages a tile's rows (m rows of sets a and b) into the scratch sa / sb (row j at j * spitch)
// row by row, each set as one sequential stream as the vector kernels read it (staging 64
// columns of all 16 rows at a time, 32 streams per core, ran at 0.62 of DRAM on the dev box
// against 0.85), in steps that the previous tile's instructions interleave with.
template <bool kFp8>
struct AmxStager {
  const uint8_t* wa = nullptr;
  const uint8_t* wb = nullptr;
  size_t pitch = 0, k = 0, nch = 0, spitch = 0;
  PfDist pf;
  int m = 0;
  size_t done = 0, total = 0;  // row-chunks (row j, chunk c at j * nch + c) staged / to stage
  uint16_t* sa = nullptr;
  uint16_t* sb = nullptr;

  HWY_INLINE void Advance(const Fp8Decoder& dec, size_t count) {
    const size_t end = std::min(total, done + count);
    for (; done < end; ++done) {
      const size_t j = done / nch, c = done % nch;
      AmxStageChunk<kFp8>(dec, wa + j * pitch, c, k, pf, sa + j * spitch);
      if (wb != nullptr) AmxStageChunk<kFp8>(dec, wb + j * pitch, c, k, pf, sb + j * spitch);
    }
  }
};

// acc[0, m * nr) (+)= scale * C tile `ct` (stored compact, row j route n at j * nr + n).
#define MOE_AMX_FLUSH(ct, cbuf, acc, count, scale, first)                          \
  do {                                                                           \
    _tile_stored(ct, cbuf, 4 * nr);                                              \
    _tile_zero(ct);                                                              \
    const __m512 sv = _mm512_set1_ps(scale);                                     \
    for (int v = 0; v < (count); v += 16) {                                      \
      const __mmask16 mk = (count) - v >= 16 ? 0xFFFF : (1u << ((count) - v)) - 1; \
      const __m512 cv = _mm512_maskz_load_ps(mk, cbuf + v);                      \
      const __m512 prev = (first) ? _mm512_setzero_ps() : _mm512_maskz_load_ps(mk, acc + v); \
      _mm512_mask_store_ps(acc + v, mk, _mm512_fmadd_ps(cv, sv, prev));          \
    }                                                                            \
  } while (0)

// The tiles over staged rows sa / sb (m rows of sets a and b, sb null for one set): acc_a /
// acc_b [m * nr] (row j route n at j * nr + n) = the rows' dots with the nr routes packed in
// bpack. fp8 (kFp8): scale_a / scale_b per 128-column block; bf16: none. Meanwhile `next`
// stages the following tile (nothing when it has nothing to stage), a proportional part per
// chunk: the tile instructions run on the AMX unit beside the vector decode. The tiles must be
// configured for (m, nr).
template <bool kFp8>
HWY_INLINE void AmxRowsTile(const uint16_t* sa, const uint16_t* sb, size_t spitch, int m,
                            size_t k, const float* scale_a, const float* scale_b,
                            const uint32_t* bpack, int nr, const Fp8Decoder& dec,
                            AmxStager<kFp8>& next, float* HWY_RESTRICT acc_a,
                            float* HWY_RESTRICT acc_b) {
  alignas(64) float cbuf[256];
  const size_t nch = (k + 63) / 64;
  const int count = m * nr;
  const bool two = sb != nullptr;
  const size_t step = (next.total + nch - 1) / nch;
  _tile_zero(0);
  _tile_zero(1);
  bool first = true;
  const size_t stride = 2 * spitch;
  for (size_t c = 0; c < nch; ++c) {
    _tile_loadd(6, bpack + 32 * nr * c, 4 * nr);
    _tile_loadd(7, bpack + 32 * nr * c + 16 * nr, 4 * nr);
    _tile_loadd(2, sa + 64 * c, stride);
    _tile_loadd(3, sa + 64 * c + 32, stride);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(0, 3, 7);
    if (two) {
      _tile_loadd(4, sb + 64 * c, stride);
      _tile_loadd(5, sb + 64 * c + 32, stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(1, 5, 7);
    }
    if constexpr (kFp8) {
      // End of a 128-column scale block (or of the row).
      if ((c & 1) == 1 || c + 1 == nch) {
        const size_t blk = c / 2;
        MOE_AMX_FLUSH(0, cbuf, acc_a, count, scale_a[blk], first);
        if (two) MOE_AMX_FLUSH(1, cbuf, acc_b, count, scale_b[blk], first);
        first = false;
      }
    }
    next.Advance(dec, step);
  }
  if constexpr (!kFp8) {
    _tile_stored(0, acc_a, 4 * nr);
    if (two) _tile_stored(1, acc_b, 4 * nr);
  }
}
#undef MOE_AMX_FLUSH

// The AMX state of a Forward call's work item: configures the tiles for (m, nr) when they
// change, and releases them when the item is done.
class AmxScope {
 public:
  AmxScope() = default;
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
  ~AmxScope() {
    if (m_ >= 0) _tile_release();
  }
  void Configure(int m, int nr) {
    if (m == m_ && nr == nr_) return;
    AmxConfigure(m, nr);
    m_ = m;
    nr_ = nr;
  }

 private:
  int m_ = -1;
  int nr_ = -1;
};

// A group's packed B: its n routes in subgroups of 16, subgroup s (routes
// [16s, 16s + nr)) at dword 32 * nch * 16s, laid out by AmxPackB with nr columns (nch: 64-column
// chunks of the contraction dimension).
HWY_INLINE size_t AmxSubgroupOffset(size_t nch, int s0) { return 32 * nch * s0; }

// Packs routes acts[0, n) of a group (any n) over k columns into b (n * 32 * nch dwords).
template <bool kFp8Order>
HWY_INLINE void AmxPackGroup(const ActView* acts, int n, size_t k, uint32_t* HWY_RESTRICT b) {
  const size_t nch = (k + 63) / 64;
  for (int s0 = 0; s0 < n; s0 += 16) {
    AmxPackB<kFp8Order>(acts + s0, std::min(16, n - s0), k, b + AmxSubgroupOffset(nch, s0));
  }
}

// Zeroes a short last chunk (k % 64 == 32) of a group whose B is then written element by
// element (AmxPutBf16): the rows that hold no column stay zero.
HWY_INLINE void AmxZeroTail(int n, size_t k, uint32_t* HWY_RESTRICT b) {
  if (k % 64 == 0) return;
  const size_t nch = (k + 63) / 64;
  for (int s0 = 0; s0 < n; s0 += 16) {
    const int nr = std::min(16, n - s0);
    std::memset(b + AmxSubgroupOffset(nch, s0) + 32 * nr * (nch - 1), 0,
                32 * nr * sizeof(uint32_t));
  }
}

// Writes bf16(v[j]) for columns j in [c0, c1) of route i (of a group of n routes) into the
// group's packed B b over k columns, at the column's position (kFp8Order: Fp8Pos).
template <bool kFp8Order>
HWY_INLINE void AmxPutBf16(uint32_t* b, int n, size_t k, int i, size_t c0, size_t c1,
                           const float* HWY_RESTRICT v) {
  const size_t nch = (k + 63) / 64;
  const int s0 = i / 16 * 16;
  const int nr = std::min(16, n - s0);
  uint16_t* t = reinterpret_cast<uint16_t*>(b + AmxSubgroupOffset(nch, s0));
  for (size_t j = c0; j < c1; ++j) {
    const size_t c = j / 64;
    const size_t pos = kFp8Order ? Fp8Pos(j % 64) : j % 64;
    t[2 * ((32 * c + pos / 2) * nr + (i - s0)) + (pos & 1)] = common::FloatToBf16(v[j]);
  }
}

// Dots rows [r0, r1) of set a (rows a_row0 + (r - r0)) and, when b_row0 >= 0, the same rows of
// set b (b_row0 + (r - r0)) of matrix m of expert e with a group's n routes, packed in bgroup
// (AmxPackGroup): route i's dot of row offset j goes to `store(set, j, i, value)`.
template <common::WeightFormat F, class Store>
HWY_INLINE void AmxDotRows(const MatrixRef& mat, size_t e, size_t a_row0, long b_row0,
                           size_t nrows, const uint32_t* bgroup, int n, const Store& store) {
  constexpr bool kFp8 = F == common::WeightFormat::kFp8Block;
  const size_t k = mat.cols;
  const size_t pitch = kFp8 ? k : 2 * k;
  const uint8_t* base = static_cast<const uint8_t*>(mat.weights) + e * mat.rows * pitch;
  const size_t bcols = (k + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
  const size_t brows = (mat.rows + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
  const float* scales = kFp8 ? static_cast<const float*>(mat.scales) + e * brows * bcols : nullptr;
  const size_t nch = (k + 63) / 64;
  // u16 per scratch row: one 64-byte line more than the row, so that a tile's 16 rows fall into
  // different L1 sets (rows 4 KiB apart all map to one set of the 12-way L1 and evict each other).
  const size_t spitch = 64 * nch + 32;
  // Two tiles' scratch (staged / being staged), each 16 rows of sets a and b: 256 KiB for
  // k = 2048 bf16 columns, in L2.
  static thread_local common::AlignedBuffer<uint16_t> scratch;
  if (scratch.size() < 64 * spitch) scratch = common::AlignedBuffer<uint16_t>(64 * spitch);
  alignas(64) float acc_a[256];
  alignas(64) float acc_b[256];
  const bool two = b_row0 >= 0;
  // Rows of the tile at row offset j0: 16, or fewer where a set's 128-row scale block ends (fp8).
  auto tile_rows = [&](size_t j0) {
    size_t m = std::min<size_t>(16, nrows - j0);
    if constexpr (kFp8) {
      m = std::min(m, common::kFp8BlockSize - (a_row0 + j0) % common::kFp8BlockSize);
      if (two) {
        m = std::min(m, common::kFp8BlockSize -
                            (static_cast<size_t>(b_row0) + j0) % common::kFp8BlockSize);
      }
    }
    return m;
  };
  auto stager_for = [&](size_t j0, int buf) {
    AmxStager<kFp8> st;
    if (j0 >= nrows) return st;  // nothing to stage
    st.m = static_cast<int>(tile_rows(j0));
    st.wa = base + (a_row0 + j0) * pitch;
    st.wb = two ? base + (static_cast<size_t>(b_row0) + j0) * pitch : nullptr;
    st.pitch = pitch;
    st.k = k;
    st.nch = nch;
    st.spitch = spitch;
    st.pf = mat.prefetch;
    st.total = static_cast<size_t>(st.m) * nch;
    st.sa = scratch.data() + buf * 32 * spitch;
    st.sb = st.sa + 16 * spitch;
    return st;
  };
  const Fp8Decoder dec;
  AmxScope amx;
  // Each tile's rows are staged once and serve every subgroup of 16 routes in turn (a group
  // with 36 routes runs three); the next tile is staged during the first subgroup's
  // instructions (AmxRowsTile advances it, and finds nothing left to do in the later ones).
  AmxStager<kFp8> cur = stager_for(0, 0);
  cur.Advance(dec, cur.total);
  int buf = 0;
  for (size_t j0 = 0; j0 < nrows;) {
    const size_t m = static_cast<size_t>(cur.m);
    AmxStager<kFp8> next = stager_for(j0 + m, buf ^ 1);
    const size_t ra = a_row0 + j0, rb = two ? static_cast<size_t>(b_row0) + j0 : 0;
    for (int s0 = 0; s0 < n; s0 += 16) {
      const int nr = std::min(16, n - s0);
      amx.Configure(cur.m, nr);
      AmxRowsTile<kFp8>(cur.sa, two ? cur.sb : nullptr, spitch, cur.m, k,
                        kFp8 ? scales + (ra / common::kFp8BlockSize) * bcols : nullptr,
                        kFp8 && two ? scales + (rb / common::kFp8BlockSize) * bcols : nullptr,
                        bgroup + AmxSubgroupOffset(nch, s0), nr, dec, next, acc_a, acc_b);
      for (size_t j = 0; j < m; ++j) {
        for (int i = 0; i < nr; ++i) {
          store(0, j0 + j, s0 + i, acc_a[j * nr + i]);
          if (two) store(1, j0 + j, s0 + i, acc_b[j * nr + i]);
        }
      }
    }
    next.Advance(dec, next.total);  // whatever the interleaving left
    j0 += m;
    cur = next;
    buf ^= 1;
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
// 64: 6-13% slower on one core, fp16_dot_probe.) The weights of a 64-column chunk come out in
// the table decode's order (Fp8Pos).
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

// sums[i][t] = dot(row r[i] of expert e of m, acts[t]) for i < NR, t < NT (NT <= kTile).
template <common::WeightFormat F, int NR, int NT, bool kBf16Dot>
HWY_INLINE void DotRowsN(const MatrixRef& m, size_t e, const size_t* r, const ActView* acts,
                         float (*sums)[kTile]) {
  for (int rr = 0; rr < NR; ++rr) {
    for (int t = 0; t < NT; ++t) sums[rr][t] = 0.0f;
  }
  const size_t k = m.cols;
  if constexpr (IsQuant<F>()) {
    QuantRow q[NR];
    for (int rr = 0; rr < NR; ++rr) MakeQuantRow<F>(m, e, r[rr], q[rr]);
    size_t b = 0;
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
    // The int8 formats' kernels take no L2 stream (PfDist::l2): it gained nothing for them on
    // the host (mxfp4 4-8% slower), and its branches alone cost 2-5% on one dev-box core.
    if (m.block_lane) b = QuantDotBlockLane<F, NR, NT>(q, acts, k / 2, m.prefetch.l1, sums);
#endif
    QuantDotAll<F, NR, NT>(hn::ScalableTag<uint8_t>(), q, acts, b, k / 2, m.prefetch.l1, sums);
    for (int rr = 0; rr < NR; ++rr) {
      for (int t = 0; t < NT; ++t) sums[rr][t] *= q[rr].post;
    }
  } else if constexpr (F == common::WeightFormat::kBf16) {
    const uint16_t* w[NR];
    for (int rr = 0; rr < NR; ++rr) {
      w[rr] = static_cast<const uint16_t*>(m.weights) + (e * m.rows + r[rr]) * k;
    }
    Bf16DotRows<NR, NT, kBf16Dot>(w, acts, k, m.prefetch, sums);
  } else {
    const size_t bcols = (k + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
    const size_t brows = (m.rows + common::kFp8BlockSize - 1) / common::kFp8BlockSize;
    const uint8_t* w[NR];
    const float* scale_row[NR];
    for (int rr = 0; rr < NR; ++rr) {
      w[rr] = static_cast<const uint8_t*>(m.weights) + (e * m.rows + r[rr]) * k;
      scale_row[rr] = static_cast<const float*>(m.scales) + e * brows * bcols +
                      (r[rr] / common::kFp8BlockSize) * bcols;
    }
    Fp8DotRows<NR, NT, kBf16Dot>(w, scale_row, k, m.prefetch, acts, sums);
  }
}

// Dots NR rows against n activations (any n), kTile at a time: out[i][t] for i < NR, t < n.
template <common::WeightFormat F, int NR, bool kBf16Dot>
HWY_INLINE void DotRowsMany(const MatrixRef& m, size_t e, const size_t* r, const ActView* acts,
                            int n, float* const* out) {
  float sums[NR][kTile];
  // Tokens per call: the format's tile for up to 2 rows, half of it for 4 rows (the accumulators
  // of NR x NT must stay in registers).
  constexpr int kTileF = TileOf<F, kBf16Dot>();
  constexpr int kT = NR <= 2 ? kTileF : kTileF / 2;
  for (int t = 0; t < n; t += kT) {
    const int nt = std::min(kT, n - t);
    switch (nt) {
      // (nt never exceeds kT; the dependent if constexpr keeps larger tiles unbuilt.)
      case 8: if constexpr (kT >= 8) DotRowsN<F, NR, 8, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 7: if constexpr (kT >= 8) DotRowsN<F, NR, 7, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 6: if constexpr (kT >= 8) DotRowsN<F, NR, 6, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 5: if constexpr (kT >= 8) DotRowsN<F, NR, 5, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 4: if constexpr (kT >= 4) DotRowsN<F, NR, 4, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 3: if constexpr (kT >= 4) DotRowsN<F, NR, 3, kBf16Dot>(m, e, r, acts + t, sums); break;
      case 2: DotRowsN<F, NR, 2, kBf16Dot>(m, e, r, acts + t, sums); break;
      default: DotRowsN<F, NR, 1, kBf16Dot>(m, e, r, acts + t, sums); break;
    }
    for (int rr = 0; rr < NR; ++rr) {
      for (int i = 0; i < nt; ++i) out[rr][t + i] = sums[rr][i];
    }
  }
}

// Prefetches the start of row r of expert e, m.prefetch.l1 bytes of it (the software prefetch
// inside the row kernels runs m.prefetch.l1 ahead from there); nothing when that is 0.
HWY_INLINE void PrefetchRow(const MatrixRef& m, size_t e, size_t r, size_t bytes_per_row) {
  const uint8_t* p = static_cast<const uint8_t*>(m.weights) + (e * m.rows + r) * bytes_per_row;
  for (size_t o = 0; o < bytes_per_row && o < m.prefetch.l1; o += 64) Pf(p + o);
}

inline size_t RowBytes(common::WeightFormat f, size_t cols) {
  switch (f) {
    case common::WeightFormat::kBf16: return cols * 2;
    case common::WeightFormat::kFp8Block: return cols;
    case common::WeightFormat::kQ4_0: return cols / 32 * sizeof(BlockQ4_0);
    default: return cols / 2;
  }
}

// h[j] = act(g[j], u[j]) for j < n, in place over g (u is clobbered). Every element goes through
// the same vector operations (a partial last vector is padded through a scratch array), so an
// element's result does not depend on where it sits in [0, n): work splits stay bit-identical.
HWY_INLINE void ApplyActivation(const Options& opt, float* HWY_RESTRICT g, float* HWY_RESTRICT u,
                                size_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  const auto one = hn::Set(df, 1.0f);
  const bool oai = opt.activation == Activation::kSwiGluOai;
  const auto limit = hn::Set(df, opt.swiglu_limit);
  const auto alpha = hn::Set(df, opt.swiglu_alpha);
  // Highway's Exp is valid up to +104 only (beyond, its exponent bits wrap and it returns
  // garbage): its argument is capped at 88, where exp is 1.7e38 and the quotient below is
  // |g| / 1.7e38, as good as the exact g e^g (< 1e-36 |g|) against any output's scale.
  const auto cap = hn::Set(df, 88.0f);
  auto act = [&](hn::Vec<decltype(df)> gv, hn::Vec<decltype(df)> uv) {
    if (!oai) {
      // silu(g) * u = g / (1 + exp(-g)) * u
      return hn::Mul(hn::Div(gv, hn::Add(one, hn::Exp(df, hn::Min(hn::Neg(gv), cap)))), uv);
    }
    const auto gc = hn::Min(gv, limit);
    const auto uc = hn::Min(hn::Max(uv, hn::Neg(limit)), limit);
    return hn::Mul(
        hn::Div(gc, hn::Add(one, hn::Exp(df, hn::Min(hn::Neg(hn::Mul(alpha, gc)), cap)))),
        hn::Add(uc, one));
  };
  size_t j = 0;
  for (; j + N <= n; j += N) {
    hn::StoreU(act(hn::LoadU(df, g + j), hn::LoadU(df, u + j)), df, g + j);
  }
  if (j < n) {
    HWY_ALIGN float tg[hn::MaxLanes(df)] = {};
    HWY_ALIGN float tu[hn::MaxLanes(df)] = {};
    std::memcpy(tg, g + j, (n - j) * sizeof(float));
    std::memcpy(tu, u + j, (n - j) * sizeof(float));
    hn::Store(act(hn::Load(df, tg), hn::Load(df, tu)), df, tg);
    std::memcpy(g + j, tg, (n - j) * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------
// The whole call for one format.

// Rows dotted together (sharing activation loads): gate with up in pass 1, row pairs in pass 2.
// Measured better for every format once the int8 activations needed one pointer each (one core,
// cache-hot, 4 routes per expert: q4_0 +9%, nvfp4 +5%, mxfp4 +7%, bf16 +30%).
template <common::WeightFormat F>
constexpr bool kFuseRows = true;

// Rows per work item (Tuning::pass1_rows / pass2_rows, validated by Forward): gate rows (and as
// many up rows) per pass-1 item, H rows per pass-2 item (even: a pass-2 item dots its rows in
// pairs, row p with row p + nb/2 of its block, so that each core reads two streams at once like
// pass 1's gate and up rows; one stream of adjacent rows kept too few bytes in flight and ran
// pass 2 at 0.43-0.50 of DRAM bandwidth against pass 1's 0.74 on the GPU machine's host).
// Neither changes any row's arithmetic: a row's dot has its own accumulators whatever row it is
// paired with, a pass-1 row is computed whole by one item, and a pass-2 item owns its output
// rows, adding routes in group order.


// Scratch memory of the Forward calls of one calling thread, kept between calls so that a
// decode step allocates nothing: allocating and freeing a call's buffers (activations, h, u,
// the per-route outputs) took several microseconds per call, a few percent of a T=1 step of a
// 4-bit layer on the GPU machine's 16-core host. Buffers above kKeepBytes (prefill sizes) are
// freed at the end of their call. The workers of the call's pool use the caller's buffers.
class CallScratch {
 public:
  enum Slot { kXActs, kHActs, kH, kU, kPart, kXFloat, kX32, kAmxX, kAmxH, kSync, kNumSlots };
  static constexpr size_t kKeepBytes = size_t{16} << 20;

  static CallScratch& ForThisThread() {
    static thread_local CallScratch scratch;
    return scratch;
  }

  // At least `bytes` (>= 1) bytes, 64-byte aligned, contents undefined.
  void* Get(Slot slot, size_t bytes) {
    common::AlignedBuffer<uint8_t>& b = buf_[slot];
    if (b.size() < bytes) b = common::AlignedBuffer<uint8_t>(std::max<size_t>(64, bytes));
    return b.data();
  }
  template <typename T>
  T* Get(Slot slot, size_t n) {
    return static_cast<T*>(Get(slot, n * sizeof(T)));
  }

  // Frees the buffers larger than kKeepBytes.
  void Trim() {
    for (common::AlignedBuffer<uint8_t>& b : buf_) {
      if (b.size() > kKeepBytes) b = common::AlignedBuffer<uint8_t>();
    }
  }

 private:
  common::AlignedBuffer<uint8_t> buf_[kNumSlots];
};

// Spins (then yields: the worker it waits for may have been preempted) until v reads 0.
template <typename T>
HWY_INLINE void WaitForZero(const std::atomic<T>& v) {
  for (int spins = 0; v.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 4096) {
      hwy::Pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// kBf16Dot: bf16 by the CPU's bf16 dot product (ForwardPlan::bf16_dot_product).
template <common::WeightFormat F, bool kBf16Dot = false>
void ForwardFormat(ForwardPlan& plan) {
  const ExpertBank& bank = *plan.bank;
  const Options& opt = *plan.options;
  const internal::Tuning& tun = *plan.tuning;
  common::ThreadPool& pool = *plan.pool;
  const size_t H = bank.hidden, I = bank.intermediate;
  const size_t R = plan.route_token.size();
  const size_t T = plan.num_tokens;
  const int workers = pool.num_workers() + 1;
  // Panel banks (Layout::kPanels): items take whole 16-row panels (the row counts rounded up).
  const bool panels = IsQuant<F>() && bank.layout == Layout::kPanels;
  auto item_rows = [panels](int rows) {
    return static_cast<size_t>(panels ? std::min(internal::Tuning::kMaxRowsPerItem, (rows + 15) / 16 * 16)
                                      : rows);
  };
  const size_t pass1_rows = item_rows(tun.pass1_rows);
  const size_t pass2_rows = item_rows(tun.pass2_rows);
  const PfDist prefetch{static_cast<size_t>(tun.prefetch_bytes),
                       static_cast<size_t>(tun.prefetch_l2_bytes)};
  // Row streams per item (Tuning::row_streams): kAuto reads four streams where a group has at
  // most two routes in the int8 formats, whose per-byte work is high enough that two streams
  // left too few bytes in flight (host, side by side: T=1 steps 6-10% faster with four), and two
  // otherwise (with more routes the four-row tiles halve the routes per decoded row, 11% slower
  // at 4 routes per expert; bf16 and fp8 gained nothing from four streams at T=1).
  // Panel banks take two (kAuto): four panels at once were 0.8-2.8% faster at T=1 but 1-4.7%
  // slower at T=8-16 side by side on the host (session 9, device_scripts/s9streams.sh).
  auto streams_for = [&tun, panels](int routes) {
    if (tun.row_streams != internal::Tuning::kAuto) return tun.row_streams;
    return IsQuant<F>() && !panels && routes <= 2 ? 4 : 2;
  };
  // AMX (ForwardPlan::amx): experts with at least amx_min_routes routes.
  auto amx_for = [&plan](int routes) {
    if constexpr (!kBf16Dot || (F != common::WeightFormat::kFp8Block &&
                                F != common::WeightFormat::kBf16)) {
      (void)plan;
      (void)routes;
      return false;
    } else {
      return plan.UsesAmx(routes);
    }
  };
  // fp8 through AVX512-FP16 for the experts that do not go through AMX (ForwardPlan::fp8_fp16,
  // set only for fp8 banks on this target with bf16_dot_product). Its kernels take the fp32 x
  // and h rows themselves and prepare their activations per item (Fp8F16Pass1 / 2), so the
  // activation sets below serve only AMX's packing.
  const bool f16 = kBf16Dot && F == common::WeightFormat::kFp8Block && plan.fp8_fp16;

  const MatrixRef gate_up{bank.gate_up_weights, bank.gate_up_scales, bank.gate_up_global_scales,
                          2 * I, H, prefetch, tun.block_lane};
  const MatrixRef down{bank.down_weights, bank.down_scales, bank.down_global_scales, H, I,
                       prefetch, tun.block_lane};
  // fp8's fp16 kernels for experts with few routes (ForwardPlan::few_routes_max): the same
  // matrices read with deeper prefetches.
  const PfDist prefetch_few{static_cast<size_t>(plan.few_routes_prefetch_l1),
                            static_cast<size_t>(plan.few_routes_prefetch_l2)};
  MatrixRef gate_up_few = gate_up, down_few = down;
  gate_up_few.prefetch = down_few.prefetch = prefetch_few;

  using Clock = std::chrono::steady_clock;
  auto lap = [&plan, t = Clock::now()](int phase) mutable {
    const Clock::time_point now = Clock::now();
    plan.phase_seconds[phase] = std::chrono::duration<double>(now - t).count();
    t = now;
  };
  CallScratch& scratch = CallScratch::ForThisThread();
  struct TrimAtEnd {
    CallScratch& s;
    ~TrimAtEnd() { s.Trim(); }
  } trim_at_end{scratch};
  // Tokens that have at least one route, and the x activations of those.
  std::vector<int> token_slot(T, -1);
  std::vector<int> active_tokens;
  active_tokens.reserve(T);
  for (size_t t = 0; t < T; ++t) {
    if (plan.token_route_begin[t + 1] > plan.token_route_begin[t]) {
      token_slot[t] = static_cast<int>(active_tokens.size());
      active_tokens.push_back(static_cast<int>(t));
    }
  }
  const size_t NT = active_tokens.size();
  ActSet<F, kBf16Dot> xacts(NT, H, tun.block_lane,
                            scratch.Get(CallScratch::kXActs, ActSet<F, kBf16Dot>::Bytes(NT, H)),
                            panels);
  // x is prepared in items of kXChunk columns while there are fewer tokens than workers (whole
  // rows otherwise), so that at T=1 the workers share it instead of waiting for one of them.
  constexpr size_t kXChunk = 256;
  static_assert(kXChunk % 64 == 0, "x chunks must hold whole activation blocks (Granule)");
  const size_t x_chunks = NT >= static_cast<size_t>(workers) ? 1 : (H + kXChunk - 1) / kXChunk;
  const size_t x_chunk_cols = x_chunks == 1 ? H : kXChunk;
  const size_t nx = NT * x_chunks;
  float* const x_float =
      plan.x_dtype == DType::kBf16 ? scratch.Get<float>(CallScratch::kXFloat, workers * H) : nullptr;
  // fp16 path with bf16 x: each active token's row in fp32, kept for the pass-1 items.
  float* const x32 = f16 && plan.x_dtype == DType::kBf16
                         ? scratch.Get<float>(CallScratch::kX32, NT * H)
                         : nullptr;
  [[maybe_unused]] auto x_row32 = [&](size_t t) -> const float* {
    return x32 == nullptr ? static_cast<const float*>(plan.x) + t * H : x32 + token_slot[t] * H;
  };
  // AMX groups' activations, packed once per call for their tiles (AmxPackGroup): x for pass 1,
  // and h for pass 2, which the pass-1 items write as they finish their rows (AmxPutBf16). Route
  // columns: amx_col[g] to amx_col[g + 1] (0 wide for the other groups).
  std::vector<size_t> amx_col(plan.groups.size() + 1, 0);
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const int n = plan.groups[gi].end - plan.groups[gi].begin;
    amx_col[gi + 1] = amx_col[gi] + (amx_for(n) ? n : 0);
  }
  // The fp16 path reads x itself (x_row32); its activation set only feeds AMX's packing.
  const bool need_xacts = !f16 || amx_col.back() > 0;
  auto prep_x_item = [&](size_t item, int worker) {
    const size_t i = item / x_chunks;
    const size_t c0 = (item % x_chunks) * x_chunk_cols, c1 = std::min(H, c0 + x_chunk_cols);
    const size_t t = active_tokens[i];
    const float* xr;
    if (plan.x_dtype == DType::kF32) {
      xr = static_cast<const float*>(plan.x) + t * H;
    } else {
      // This worker's, at the row's offsets (the fp16 path: the token's own row).
      float* buf = x32 != nullptr ? x32 + i * H : x_float + worker * H;
      const uint16_t* xb = static_cast<const uint16_t*>(plan.x) + t * H;
      for (size_t j = c0; j < c1; ++j) buf[j] = common::Bf16ToFloat(xb[j]);
      xr = buf;
    }
    if (need_xacts) xacts.PrepareRange(i, xr, c0, c1);
  };
  // Overlapped passes (Tuning::overlap_passes): a pass-1 item also prepares its rows of h for
  // pass 2, which takes whole activation blocks (ActSet::Granule) per item.
  const bool overlap = tun.overlap_passes && pass1_rows % ActSet<F>::Granule() == 0;
  // With the passes overlapped and no AMX packing (which reads all of x first), preparing x is
  // part of the same fork-join: the pass-1 items start their weight streams and then wait for
  // it. Otherwise it is a fork-join of its own.
  const bool fuse_x = overlap && amx_col.back() == 0;
  if (!fuse_x) pool.ParallelFor(nx, [&](uint64_t item, int worker) { prep_x_item(item, worker); });
  const size_t nch_h = (H + 63) / 64, nch_i = (I + 63) / 64;
  // Uninitialized: every element is written before it is read (AmxPackGroup; AmxPutBf16 for
  // every column of h, AmxZeroTail for the rows of a short last chunk that hold none).
  [[maybe_unused]] uint32_t* const amx_bx =
      scratch.Get<uint32_t>(CallScratch::kAmxX, amx_col.back() * 32 * nch_h);
  [[maybe_unused]] uint32_t* const amx_bh =
      scratch.Get<uint32_t>(CallScratch::kAmxH, amx_col.back() * 32 * nch_i);
#if HWY_TARGET == HWY_AVX3_DL
  if constexpr (kBf16Dot) {
    if (amx_col.back() > 0) {
      constexpr bool kFp8Order = F == common::WeightFormat::kFp8Block;
      pool.ParallelFor(plan.groups.size(), [&](uint64_t gi, int) {
        if (amx_col[gi + 1] == amx_col[gi]) return;
        const internal::ExpertGroup& g = plan.groups[gi];
        const int n = g.end - g.begin;
        std::vector<ActView> acts(n);
        for (int i = 0; i < n; ++i) {
          acts[i] = xacts.View(token_slot[plan.route_token[plan.group_routes[g.begin + i]]]);
        }
        AmxPackGroup<kFp8Order>(acts.data(), n, H, amx_bx + amx_col[gi] * 32 * nch_h);
        AmxZeroTail(n, I, amx_bh + amx_col[gi] * 32 * nch_i);
      });
    }
  }
#endif
  lap(0);

  // Pass 1: h[route, I] = act(gate x, up x); the up dots go to u first.
  float* const h = scratch.Get<float>(CallScratch::kH, R * I);
  float* const u = scratch.Get<float>(CallScratch::kU, R * I);
  ActSet<F, kBf16Dot> hacts(R, I, tun.block_lane,
                            scratch.Get(CallScratch::kHActs, ActSet<F, kBf16Dot>::Bytes(R, I)),
                            panels);
  const size_t G = plan.groups.size();
  const size_t nrb = (I + pass1_rows - 1) / pass1_rows;
  const size_t row_bytes1 = RowBytes(F, H);
  std::atomic<size_t> x_left{fuse_x ? nx : 0};  // x items not yet done (fuse_x)
  auto pass1_item = [&](size_t item) {
    const internal::ExpertGroup& g = plan.groups[item / nrb];
    const size_t r0 = (item % nrb) * pass1_rows;
    const size_t r1 = std::min(I, r0 + pass1_rows);
    const int n = g.end - g.begin;
    ActView acts[64];
    size_t route_of[64];
    float* hrow[64];  // h and u rows of the chunk's routes
    float* urow[64];
    float gs[64], us[64], gs2[64], us2[64];
    float* const out[4] = {gs, us, gs2, us2};
    const int streams = streams_for(n);
    const bool use_amx = amx_for(n);
    const bool f16_item = f16 && !use_amx;
    const bool vec_done = use_amx || f16_item;  // rows not dotted by the loops below
    const MatrixRef& gate_up_f16 = n <= plan.few_routes_max ? gate_up_few : gate_up;
    // Panel banks with four streams: gate and up panels of r and of r + panel_half together
    // (whole panels; a last odd panel of the item goes with its up panel alone).
    const size_t panel_half = panels && streams == 4 ? (r1 - r0) / 32 * 16 : 0;
    if constexpr (IsQuant<F>()) {
      if (panels) {
        PrefetchPanel<F>(gate_up, g.expert, r0 / 16);
        PrefetchPanel<F>(gate_up, g.expert, (I + r0) / 16);
        if (panel_half > 0) {
          PrefetchPanel<F>(gate_up, g.expert, (r0 + panel_half) / 16);
          PrefetchPanel<F>(gate_up, g.expert, (I + r0 + panel_half) / 16);
        }
      }
    }
    if (f16_item) {
      // Its first two streams (Fp8F16RowRange: rows p and p + n/2 of the gate half first).
      PrefetchRow(gate_up_f16, g.expert, r0, row_bytes1);
      PrefetchRow(gate_up_f16, g.expert,
                  r0 + std::min<size_t>(r1 - r0, common::kFp8BlockSize) / 2, row_bytes1);
    } else if (!use_amx && !panels) {
      PrefetchRow(gate_up, g.expert, r0, row_bytes1);
      PrefetchRow(gate_up, g.expert, I + r0, row_bytes1);
    }
    if (streams == 4 && !vec_done && !panels) {
      PrefetchRow(gate_up, g.expert, r0 + (r1 - r0) / 2, row_bytes1);
      PrefetchRow(gate_up, g.expert, I + r0 + (r1 - r0) / 2, row_bytes1);
    }
    // With fuse_x, the x items come first in the fork-join and were claimed by workers that
    // wait on nothing; the weight streams above are already under way meanwhile.
    WaitForZero(x_left);
    for (int c0 = 0; c0 < n; c0 += 64) {
      const int nc = std::min(64, n - c0);
      for (int i = 0; i < nc; ++i) {
        const size_t route = plan.group_routes[g.begin + c0 + i];
        route_of[i] = route;
        acts[i] = xacts.View(token_slot[plan.route_token[route]]);
        hrow[i] = h + route * I;
        urow[i] = u + route * I;
      }
#if HWY_TARGET == HWY_AVX3_DL
      if constexpr (kBf16Dot) {
        if (use_amx) {
          // (Groups of more than 64 routes: the subgroups of this chunk of 64.)
          AmxDotRows<F>(gate_up, g.expert, r0, static_cast<long>(I + r0), r1 - r0,
                        amx_bx + (amx_col[item / nrb] + c0) * 32 * nch_h, nc,
                        [&](int set, size_t j, int i, float v) {
                          (set == 0 ? hrow : urow)[i][r0 + j] = v;
                        });
        }
        if (f16_item) {
          const float* xr[64];
          for (int i = 0; i < nc; ++i) xr[i] = x_row32(plan.route_token[route_of[i]]);
          Fp8F16Pass1(gate_up_f16, g.expert, I, r0, r1, xr, nc, hrow, urow);
        }
      }
#endif
      if constexpr (IsQuant<F>()) {
        if (panels) {
          // A gate panel with its up panel: 16 rows of each per PanelDot.
          float post[64];
          std::fill(post, post + nc, PanelPost<F>(gate_up, g.expert));
          float* o[256];
          for (size_t r = r0; r < r0 + panel_half; r += 16) {
            const size_t pn[4] = {r / 16, (I + r) / 16, (r + panel_half) / 16,
                                  (I + r + panel_half) / 16};
            for (int i = 0; i < nc; ++i) {
              o[i] = hrow[i] + r;
              o[nc + i] = urow[i] + r;
              o[2 * nc + i] = hrow[i] + r + panel_half;
              o[3 * nc + i] = urow[i] + r + panel_half;
            }
            PanelDotMany<F, 4>(gate_up, g.expert, pn, acts, post, nc, o);
          }
          for (size_t r = r0 + 2 * panel_half; r < r1; r += 16) {
            const size_t pn[2] = {r / 16, (I + r) / 16};
            for (int i = 0; i < nc; ++i) {
              o[i] = hrow[i] + r;
              o[nc + i] = urow[i] + r;
            }
            PanelDotMany<F, 2>(gate_up, g.expert, pn, acts, post, nc, o);
          }
        }
      }
      // With four streams, gate and up rows of r and of r + half go together (rows [r0, r1)
      // split in two halves; an odd last row goes alone with its up row).
      const size_t half = streams == 4 && !vec_done && !panels ? (r1 - r0) / 2 : 0;
      for (size_t r = r0; r < r0 + half; ++r) {
        const size_t rows[4] = {r, I + r, r + half, I + r + half};
        DotRowsMany<F, 4, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          hrow[i][r] = gs[i];
          urow[i][r] = us[i];
          hrow[i][r + half] = gs2[i];
          urow[i][r + half] = us2[i];
        }
      }
      for (size_t r = vec_done || panels ? r1 : r0 + 2 * half; r < r1; ++r) {
        // The gate and up rows of r together: one pass over the activations for both.
        const size_t rows[2] = {r, I + r};
        if constexpr (kFuseRows<F>) {
          DotRowsMany<F, 2, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
        } else {
          DotRowsMany<F, 1, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
          DotRowsMany<F, 1, kBf16Dot>(gate_up, g.expert, rows + 1, acts, nc, out + 1);
        }
        for (int i = 0; i < nc; ++i) {
          hrow[i][r] = gs[i];
          urow[i][r] = us[i];
        }
      }
      for (int i = 0; i < nc; ++i) {
        ApplyActivation(opt, hrow[i] + r0, urow[i] + r0, r1 - r0);
#if HWY_TARGET == HWY_AVX3_DL
        if constexpr (kBf16Dot) {
          if (use_amx) {
            AmxPutBf16<F == common::WeightFormat::kFp8Block>(
                amx_bh + amx_col[item / nrb] * 32 * nch_i, n, I, c0 + i, r0, r1, hrow[i]);
            continue;
          }
        }
#endif
        if (overlap && !f16) hacts.PrepareRange(route_of[i], hrow[i], r0, r1);
      }
    }
  };

  // Pass 2: y[t, H-block] = sum over routes of w * down_e h.
  // Split like pass 1: one item per (group, H-block), so an expert's down rows are read once and
  // reused across its routes; each route's weighted dots of the block go to its own row of `part`
  // (written by exactly one item: no reduction between workers), then every token's y sums its
  // routes' rows in route order (a fixed order: results do not depend on the split). This
  // replaced seed 003's pass 2 (one item per H-block owning every token's outputs and visiting
  // every expert): there the item count tied the rows per item to H / workers, and short
  // per-expert streams ran pass 2 at 0.55-0.73 of DRAM on the GPU machine's host; with 128-row
  // blocks of one expert per item the host's T=64 steps ran 5-9% faster side by side
  // (benchmarks/h200host_tuning_2026-11-30_session2.md).
  const size_t nhb = (H + pass2_rows - 1) / pass2_rows;
  const size_t row_bytes2 = RowBytes(F, I);
  float* const part = scratch.Get<float>(CallScratch::kPart, R * H);
  auto pass2_item = [&](size_t item) {
    const internal::ExpertGroup& g = plan.groups[item / nhb];
    const size_t h0 = (item % nhb) * pass2_rows, h1 = std::min(H, h0 + pass2_rows);
    // Rows dotted together: p, p + q, p + 2q, p + 3q (four streams) for p < q = nb / 4, then
    // pairs p, p + h (h = what is left / 2) of the rest; with two streams only the pairs.
    const int n = g.end - g.begin;
    const bool use_amx = amx_for(n);
    const bool f16_item = f16 && !use_amx;
    const MatrixRef& down_f16 = n <= plan.few_routes_max ? down_few : down;
    const size_t q = streams_for(n) == 4 && !use_amx && !panels && !f16_item ? (h1 - h0) / 4 : 0;
    const size_t p0 = h0 + 4 * q;
    const size_t half = use_amx || panels ? 0 : (h1 - p0) / 2;
    // Panel banks: the np panels of the block from ph0 on; with four streams P, P + pq,
    // P + 2 pq, P + 3 pq for P < pq = np / 4 first; then of the rest (from pb on), P with
    // P + phalf (an odd last one alone).
    const size_t ph0 = h0 / 16, np = (h1 - h0) / 16;
    const size_t pq = panels && streams_for(n) == 4 ? np / 4 : 0, pb = ph0 + 4 * pq;
    const size_t phalf = panels ? (np - 4 * pq) / 2 : 0;
    if constexpr (IsQuant<F>()) {
      if (panels) {
        for (size_t j = 0; j < (pq > 0 ? 4 : 0); ++j) PrefetchPanel<F>(down, g.expert, ph0 + j * pq);
        PrefetchPanel<F>(down, g.expert, pb);
        if (phalf > 0) PrefetchPanel<F>(down, g.expert, pb + phalf);
      }
    }
    for (size_t j = 0; j < (q > 0 ? 4 : 0); ++j) PrefetchRow(down, g.expert, h0 + j * q, row_bytes2);
    if (!use_amx && !panels) {
      PrefetchRow(f16_item ? down_f16 : down, g.expert, p0, row_bytes2);
      PrefetchRow(f16_item ? down_f16 : down, g.expert, p0 + half, row_bytes2);
    }
    ActView acts[64];
    [[maybe_unused]] const float* hin[64];  // fp32 h rows (the fp16 path)
    float* dst[64];
    float wt[64];
    float dots[4][64];
    float* const out[4] = {dots[0], dots[1], dots[2], dots[3]};
    for (int c0 = 0; c0 < n; c0 += 64) {
      const int nc = std::min(64, n - c0);
      for (int i = 0; i < nc; ++i) {
        const size_t route = plan.group_routes[g.begin + c0 + i];
        acts[i] = hacts.View(route);
        hin[i] = h + route * I;
        dst[i] = part + route * H;
        wt[i] = plan.route_weight[route];
      }
#if HWY_TARGET == HWY_AVX3_DL
      if constexpr (kBf16Dot) {
        if (use_amx) {
          // Rows [h0, h0 + nb/2) and [h0 + nb/2, h1) as the two sets (nb = h1 - h0 is even).
          const size_t hb = (h1 - h0) / 2;
          AmxDotRows<F>(down, g.expert, h0, static_cast<long>(h0 + hb), hb,
                        amx_bh + (amx_col[item / nhb] + c0) * 32 * nch_i, nc,
                        [&](int set, size_t j, int i, float v) {
                          dst[i][h0 + set * hb + j] = wt[i] * v;
                        });
        }
        if (f16_item) {
          Fp8F16Pass2(down_f16, g.expert, h0, h1, hin, wt, nc, dst);
          continue;
        }
      }
#endif
      if constexpr (IsQuant<F>()) {
        if (panels) {
          float scale[64];
          const float post = PanelPost<F>(down, g.expert);
          for (int i = 0; i < nc; ++i) scale[i] = post * wt[i];
          float* o[256];
          for (size_t p = 0; p < pq; ++p) {
            const size_t pn[4] = {ph0 + p, ph0 + pq + p, ph0 + 2 * pq + p, ph0 + 3 * pq + p};
            for (int j = 0; j < 4; ++j) {
              for (int i = 0; i < nc; ++i) o[j * nc + i] = dst[i] + 16 * pn[j];
            }
            PanelDotMany<F, 4>(down, g.expert, pn, acts, scale, nc, o);
          }
          for (size_t p = 0; p < phalf; ++p) {
            const size_t pn[2] = {pb + p, pb + phalf + p};
            for (int i = 0; i < nc; ++i) {
              o[i] = dst[i] + 16 * pn[0];
              o[nc + i] = dst[i] + 16 * pn[1];
            }
            PanelDotMany<F, 2>(down, g.expert, pn, acts, scale, nc, o);
          }
          if ((np - 4 * pq) % 2 != 0) {
            const size_t pn[1] = {ph0 + np - 1};
            for (int i = 0; i < nc; ++i) o[i] = dst[i] + 16 * pn[0];
            PanelDotMany<F, 1>(down, g.expert, pn, acts, scale, nc, o);
          }
        }
      }
      for (size_t p = 0; p < q; ++p) {
        const size_t rows[4] = {h0 + p, h0 + q + p, h0 + 2 * q + p, h0 + 3 * q + p};
        DotRowsMany<F, 4, kBf16Dot>(down, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          for (int j = 0; j < 4; ++j) dst[i][rows[j]] = wt[i] * dots[j][i];
        }
      }
      for (size_t p = 0; p < half; ++p) {
        const size_t rows[2] = {p0 + p, p0 + half + p};
        DotRowsMany<F, 2, kBf16Dot>(down, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          dst[i][rows[0]] = wt[i] * dots[0][i];
          dst[i][rows[1]] = wt[i] * dots[1][i];
        }
      }
    }
  };
  // y[t, h0:h1] = (accumulate ? y : 0) + the sum of t's routes' rows of `part`, in route order.
  constexpr size_t kYBlock = 512;
  static_assert(kYBlock >= internal::Tuning::kMaxRowsPerItem, "a pass-2 block must fit in one y block");
  auto reduce_y = [&](size_t t, size_t h0, size_t h1) {
    float sum[kYBlock];
    const int rb = plan.token_route_begin[t], re = plan.token_route_begin[t + 1];
    std::copy(part + rb * H + h0, part + rb * H + h1, sum);
    for (int route = rb + 1; route < re; ++route) {
      const float* pr = part + route * H;
      for (size_t j = h0; j < h1; ++j) sum[j - h0] += pr[j];
    }
    if (plan.y_dtype == DType::kF32) {
      float* yr = static_cast<float*>(plan.y) + t * H;
      for (size_t j = h0; j < h1; ++j) yr[j] = (opt.accumulate ? yr[j] : 0.0f) + sum[j - h0];
    } else {
      uint16_t* yr = static_cast<uint16_t*>(plan.y) + t * H;
      for (size_t j = h0; j < h1; ++j) {
        const float prev = opt.accumulate ? common::Bf16ToFloat(yr[j]) : 0.0f;
        yr[j] = common::FloatToBf16(prev + sum[j - h0]);
      }
    }
  };

  if (!overlap) {
    // Four fork-joins: pass 1, prep h, pass 2, y.
    pool.ParallelFor(G * nrb, [&](uint64_t item, int) { pass1_item(item); });
    lap(1);
    if (!f16) pool.ParallelFor(R, [&](uint64_t r, int) { hacts.Prepare(r, h + r * I); });
    lap(2);
    pool.ParallelFor(G * nhb, [&](uint64_t item, int) { pass2_item(item); });
    const size_t nyb = (H + kYBlock - 1) / kYBlock;
    pool.ParallelFor(active_tokens.size() * nyb, [&](uint64_t item, int) {
      const size_t h0 = (item % nyb) * kYBlock;
      reduce_y(active_tokens[item / nyb], h0, std::min(H, h0 + kYBlock));
    });
    lap(3);
    return;
  }

  // One fork-join for both passes and the sums: items are claimed in order, all of pass 1 before
  // any of pass 2, so workers that run out of pass-1 items go on with pass-2 items of groups
  // whose pass 1 is complete (the first groups, done long before) instead of idling at a barrier
  // while the last pass-1 items finish: the weight streams never drain between the passes. A
  // pass-2 item waits (rarely) until its group's pass-1 items are all done; they were claimed
  // earlier by workers that wait on nothing, so the wait ends. The worker that completes the
  // last group of an H-block sums that block of y, so no further join is needed.
  // With fuse_x, the x items come first (see fuse_x).
  std::atomic<int>* const pending1 = static_cast<std::atomic<int>*>(
      scratch.Get(CallScratch::kSync, (G + nhb) * sizeof(std::atomic<int>)));
  std::atomic<int>* const pending2 = pending1 + G;
  for (size_t g = 0; g < G; ++g) new (&pending1[g]) std::atomic<int>(static_cast<int>(nrb));
  for (size_t b = 0; b < nhb; ++b) new (&pending2[b]) std::atomic<int>(static_cast<int>(G));
  std::atomic<size_t> pass1_left{G * nrb};
  const Clock::time_point start = Clock::now();
  Clock::time_point x_end = start;  // written by the worker that finishes the last x item
  Clock::time_point pass1_end{};    // written by the worker that finishes pass 1's last item
  const size_t n0 = fuse_x ? nx : 0;
  const size_t n1 = G * nrb;
  pool.ParallelFor(n0 + n1 + G * nhb, [&](uint64_t item, int worker) {
    if (item < n0) {
      prep_x_item(item, worker);
      if (x_left.fetch_sub(1, std::memory_order_acq_rel) == 1) x_end = Clock::now();
      return;
    }
    item -= n0;
    if (item < n1) {
      pass1_item(item);
      pending1[item / nrb].fetch_sub(1, std::memory_order_release);
      if (pass1_left.fetch_sub(1, std::memory_order_acq_rel) == 1) pass1_end = Clock::now();
      return;
    }
    item -= n1;
    WaitForZero(pending1[item / nhb]);
    pass2_item(item);
    const size_t b = item % nhb;
    if (pending2[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      const size_t h0 = b * pass2_rows, h1 = std::min(H, h0 + pass2_rows);
      for (int t : active_tokens) reduce_y(t, h0, h1);
    }
  });
  const Clock::time_point end = Clock::now();
  if (fuse_x) plan.phase_seconds[0] += std::chrono::duration<double>(x_end - start).count();
  plan.phase_seconds[1] = std::chrono::duration<double>(pass1_end - x_end).count();
  plan.phase_seconds[2] = 0.0;  // done inside pass 1
  plan.phase_seconds[3] = std::chrono::duration<double>(end - pass1_end).count();
}

void ForwardImpl(ForwardPlan& plan) {
  switch (plan.bank->format) {
    case common::WeightFormat::kBf16:
#if HWY_TARGET == HWY_AVX3_DL
      // Forward sets bf16_dot_product only when this target runs on a CPU with AVX512_BF16.
      if (plan.bf16_dot_product) return ForwardFormat<common::WeightFormat::kBf16, true>(plan);
#endif
      return ForwardFormat<common::WeightFormat::kBf16>(plan);
    case common::WeightFormat::kFp8Block:
#if HWY_TARGET == HWY_AVX3_DL
      // Forward sets bf16_dot_product only when this target runs on a CPU with AVX512_BF16.
      if (plan.bf16_dot_product) return ForwardFormat<common::WeightFormat::kFp8Block, true>(plan);
#endif
      return ForwardFormat<common::WeightFormat::kFp8Block>(plan);
    case common::WeightFormat::kQ4_0: return ForwardFormat<common::WeightFormat::kQ4_0>(plan);
    case common::WeightFormat::kNvfp4: return ForwardFormat<common::WeightFormat::kNvfp4>(plan);
    case common::WeightFormat::kMxfp4: return ForwardFormat<common::WeightFormat::kMxfp4>(plan);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INL_H_ toggle guard
