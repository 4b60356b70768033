// cpu_moe kernels: one entry point per format for NR rows against any number of routes
// (DotRowsN / DotRowsMany over the int8, bf16 and fp8 row kernels), and row prefetching.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_ROW_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_ROW_KERNELS_INL_H_
#undef MOE_CPU_MOE_INTERNAL_ROW_KERNELS_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_ROW_KERNELS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/formats.h"
#include "cpu_moe/internal/activations-inl.h"
#include "cpu_moe/internal/bf16_rows-inl.h"
#include "cpu_moe/internal/fp8_rows-inl.h"
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

using common::BlockQ4_0;

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
    // the host (mxfp4 4-8% slower), and its branches alone cost 2-5% on one core of a 2-vCPU EPYC machine.
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

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_ROW_KERNELS_INL_H_ toggle guard
