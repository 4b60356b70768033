// cpu_moe kernels: activation preparation. ActSet holds a call's activation vectors (x for pass
// 1, the activated h for pass 2) in the layout each format's row kernels read: int8 per
// 32-element block for the 4-bit formats (plain, block-lane or panel order), bf16-rounded or
// de-interleaved fp32 for bf16, fp32 in the table decode's order for fp8.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_ACTIVATIONS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_ACTIVATIONS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_ACTIVATIONS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_ACTIVATIONS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/formats.h"
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

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_ACTIVATIONS_INL_H_ toggle guard
