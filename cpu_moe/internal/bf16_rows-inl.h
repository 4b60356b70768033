// cpu_moe kernels: bf16 rows. vdpbf16ps against bf16-rounded activations where the CPU has
// AVX512_BF16 (AVX3_DL), otherwise bf16 pairs split into fp32 FMAs against de-interleaved fp32
// activations.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_BF16_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_BF16_ROWS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_BF16_ROWS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_BF16_ROWS_INL_H_
#endif

#include <cstddef>
#include <cstdint>

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

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_BF16_ROWS_INL_H_ toggle guard
