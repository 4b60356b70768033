// cpu_moe kernels: what every row kernel shares. The tile width (routes dotted against one
// decoded weight row), software prefetch of the weight streams, MatrixRef (one weight matrix of
// the bank) and the horizontal lane sums at the end of a row's dot products.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_KERNEL_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_KERNEL_COMMON_INL_H_
#undef MOE_CPU_MOE_INTERNAL_KERNEL_COMMON_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_KERNEL_COMMON_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "common/formats.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// The same in every kernel file of this directory:
// Highway 1.0.3's AVX3_DL target string names avxvnni but not avx512vnni, although its CPU check
// requires AVX-512 VNNI for AVX3_DL; add it so the dpbusd intrinsics compile.
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
// in MatrixRef::prefetch: l1 bytes ahead into L1 (internal::Tuning::prefetch_bytes, per format
// by default; 0: no software prefetch) and, where l2 is not 0, a second stream of prefetches l2
// bytes ahead into L2 only (Tuning::prefetch_l2_bytes; bf16, fp8 and panel kernels).
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

// One weight matrix of the bank ([E, rows, cols]).
struct MatrixRef {
  const void* weights;
  const void* scales;
  const float* globals;
  size_t rows;
  size_t cols;
  PfDist prefetch;  // how far ahead the row kernels prefetch; see above
  bool block_lane;  // quantized rows start in the block-lane layout (BlockLaneBytes)
  size_t global_stride;  // floats between experts' global scales (ExpertBank::global_scale_stride)
  // nvfp4: rows >= globals_hi_row take their global scale from globals_hi (gate_up's up rows
  // with ExpertBank::up_global_scales); rows below from globals.
  const float* globals_hi = nullptr;
  size_t globals_hi_row = ~size_t{0};

  const float* GlobalsOf(size_t row) const { return row < globals_hi_row ? globals : globals_hi; }
};

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_KERNEL_COMMON_INL_H_ toggle guard
