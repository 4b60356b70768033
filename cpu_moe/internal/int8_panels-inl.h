// cpu_moe kernels: the 4-bit formats in panels (Layout::kPanels, cpu_moe.h). 16 rows per panel,
// int32 lane j of every vector row j, so one dot-product instruction serves 16 rows of a route
// and no horizontal sums are needed.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_INT8_PANELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_INT8_PANELS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_INT8_PANELS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_INT8_PANELS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/formats.h"
#include "cpu_moe/internal/activations-inl.h"
#include "cpu_moe/internal/int8_rows-inl.h"
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
// scale_hi (optional): the scales of panels whose rows lie at or past m.globals_hi_row (nvfp4's
// up rows with their own global scale), in place of scale.
template <common::WeightFormat F, int NP, int NT>
HWY_INLINE void PanelDot(const MatrixRef& m, size_t e, const size_t* panels, const ActView* acts,
                         const float* scale, float* const* out, const float* scale_hi = nullptr) {
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
                // neither nibble needs masking (see QuantDotBlockLane). Side by side on the GPU
                // machine's host: fp4 steps 0.2-4% faster than mask, shift, mask and pshufb.
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
            // slower at 4 routes per expert side by side on the host).
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
      const float* sc =
          scale_hi != nullptr && 16 * panels[p] >= m.globals_hi_row ? scale_hi : scale;
      for (int t = 0; t < NT; ++t) {
        hn::StoreU(hn::Mul(acc[p][t], hn::Set(df, sc[t])), df, out[p * NT + t] + s / 4);
      }
    }
  }
}

// PanelDot for any number n of activations, NT = 8 / NP at a time (NP = 4: 2, the four
// streams of experts with few routes, Tuning::row_streams).
template <common::WeightFormat F, int NP>
HWY_INLINE void PanelDotMany(const MatrixRef& m, size_t e, const size_t* panels,
                             const ActView* acts, const float* scale, int n, float* const* out,
                             const float* scale_hi = nullptr) {
  constexpr int kT = 8 / NP;
  float* o[NP * kT];
  auto hi = [scale_hi](int t) { return scale_hi != nullptr ? scale_hi + t : nullptr; };
  for (int t = 0; t < n; t += kT) {
    const int nt = std::min(kT, n - t);
    for (int p = 0; p < NP; ++p) {
      for (int i = 0; i < nt; ++i) o[p * nt + i] = out[p * n + t + i];
    }
    switch (nt) {
      case 8: if constexpr (kT >= 8) PanelDot<F, NP, 8>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 7: if constexpr (kT >= 8) PanelDot<F, NP, 7>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 6: if constexpr (kT >= 8) PanelDot<F, NP, 6>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 5: if constexpr (kT >= 8) PanelDot<F, NP, 5>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 4: if constexpr (kT >= 4) PanelDot<F, NP, 4>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 3: if constexpr (kT >= 4) PanelDot<F, NP, 3>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      case 2: PanelDot<F, NP, 2>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
      default: PanelDot<F, NP, 1>(m, e, panels, acts + t, scale + t, o, hi(t)); break;
    }
  }
}

// The factor of a panel bank's sums before the route's own weight: the fp4 table's 1/2 and
// nvfp4's global scale of the rows from `row` on (as QuantRow::post).
template <common::WeightFormat F>
HWY_INLINE float PanelPost(const MatrixRef& m, size_t e, size_t row = 0) {
  if constexpr (F == common::WeightFormat::kQ4_0) return 1.0f;
  if constexpr (F == common::WeightFormat::kMxfp4) return 0.5f;
  return 0.5f * m.GlobalsOf(row)[e * m.global_stride];
}

// Prefetches the first m.prefetch.l1 bytes of panel `panel` of expert e (codes and scales).
template <common::WeightFormat F>
HWY_INLINE void PrefetchPanel(const MatrixRef& m, size_t e, size_t panel) {
  const uint8_t* c =
      static_cast<const uint8_t*>(m.weights) + (e * (m.rows / 16) + panel) * PanelBytes<F>(m.cols);
  for (size_t o = 0; o < m.prefetch.l1 && o < PanelBytes<F>(m.cols); o += 64) Pf(c + o);
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_INT8_PANELS_INL_H_ toggle guard
