// Internal: the memory-system and kernel-choice knobs of cpu_moe's Forward, apart from the public
// Options. For sweeps on a target host (set from the MOE_CPU_* variables by Tuning::FromEnv), for
// the tests that pin what each knob may change, and for the engine (its batch-invariant mode
// turns AMX off; it and tools/bandwidth_probe read the sweep variables). A library user sets
// Options only; the public Forward runs with Tuning() (every value at its per-format default).
//
// Contract: every valid setting of prefetch_bytes, prefetch_l2_bytes, pass1_rows, pass2_rows,
// row_streams and overlap_passes gives y bit for bit equal to the defaults' (only the speed
// changes). block_lane, fp8_fp16, amx and amx_min_routes choose other kernels, whose results
// differ by fp32 summation order (and fp8_fp16 by its fp16 activation rounding) within the
// tolerances that cpu_moe_test states. Forward rejects out-of-range values with InvalidArgument
// naming the field and its variable. How each default was measured: cpu_moe/README.md, "Tuning
// defaults".
//
// Plain value type; copy freely. FromEnv reads the environment when called (never cached, so
// that each arm of an A/B comparison sees its own setting).
#ifndef MOE_CPU_MOE_INTERNAL_TUNING_H_
#define MOE_CPU_MOE_INTERNAL_TUNING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"

namespace moe::cpu_moe::internal {

struct Tuning {
  // The per-format value (ResolveTuning in cpu_moe.cc; the table in the README).
  static constexpr int kAuto = -1;

  // Run pass 1, pass 2 and the per-token sums as one fork-join: workers that run out of pass-1
  // items go on with pass-2 items of experts whose pass 1 is complete, so the weight streams do
  // not drain at a barrier between the passes, and each pass-1 item prepares its own rows of the
  // activations for pass 2. Needs pass1_rows to be a multiple of the activation block (32 for
  // the int8 formats, 64 for fp8 on AVX3_DL, 2 for bf16); otherwise, or when false, the passes
  // are separated by joins. Bit-identical either way.
  bool overlap_passes = true;
  // Quantized formats (q4_0, nvfp4, mxfp4) on the 512-bit targets (AVX3, AVX3_DL), row-major
  // banks: dot each 128-byte chunk of a row in a block-lane order, in which every int32 lane
  // stays within one weight block, so a route converts and scales once per 256 weights instead
  // of once per 64. false: the plain layout (results differ only by int32 -> fp32 rounding of
  // partial sums, within the format's tolerance). Panel banks ignore it.
  bool block_lane = true;
  // AMX tiles (tdpbf16ps) where the CPU has AMX-TILE and AMX-BF16 (and Linux grants the tile
  // state), on the AVX3_DL target with Options::bf16_dot_product, for bf16 and fp8 experts with
  // at least amx_min_routes routes in a call: 16 weight rows by up to 16 routes per instruction,
  // so their cost no longer grows with the routes per expert (fp8 weights are decoded exactly to
  // bf16 first). Same activation rounding as the bf16 dot product; only the fp32 summation order
  // differs. Because it is chosen per expert by its routes in the call, a token's result then
  // depends on the rest of the batch. ForwardStats::amx says whether it ran.
  bool amx = true;
  // Routes an expert needs in a call to go through AMX; 0: none; kAuto: 5 for fp8, 12 for bf16.
  int amx_min_routes = kAuto;
  // fp8 banks, where the bf16 dot product applies and the CPU has AVX512-FP16 (and GFNI): the
  // experts that do not go through AMX are dotted with fp16 FMAs instead of vdpbf16ps (every
  // e4m3 value is exact in fp16). Each route's activations are scaled per 128-row scale block so
  // that they fit fp16's range, rounded to fp16 (11 significant bits against bf16's 8) and summed
  // in fp16 over 256 columns, then in fp32: at most 10 * 2^-11 (0.5%) of the sum of |terms| per
  // dot, typically about 1e-4 of it. e4m3's NaN codes (0x7F, 0xFF) read as +-480 there, as in the
  // F16C kernels of the other targets. ForwardStats::fp8_fp16 says whether it ran.
  bool fp8_fp16 = true;

  // Bytes ahead of the current position that the row kernels prefetch in the weight stream (and
  // how much of the next row / expert's rows is prefetched up front). 0 turns software prefetch
  // off; otherwise a multiple of 64 in [64, kMaxPrefetchBytes].
  static constexpr int kMaxPrefetchBytes = 8192;
  int prefetch_bytes = kAuto;
  // Bytes ahead of a second software prefetch stream, into L2 only (prefetcht1 on x86), in the
  // bf16, fp8_block and panel kernels (the int8 formats' row-major kernels take none). 0 turns it
  // off; otherwise a multiple of 64 in [64, kMaxPrefetchL2Bytes]. With fp8's fp16 kernels and
  // both distances at kAuto, experts with one or two routes in a call read further ahead than
  // the others (ForwardPlan::few_routes_*).
  static constexpr int kMaxPrefetchL2Bytes = 32768;
  int prefetch_l2_bytes = kAuto;
  // Rows per work item: pass 1 gate rows (each with its up row) per item, any value in
  // [1, kMaxRowsPerItem]; pass 2 H rows of one expert per item, even (a block's rows are dotted
  // in pairs, row p with row p + rows/2) in [2, kMaxRowsPerItem]. Panel banks round them up to
  // whole 16-row panels.
  static constexpr int kMaxRowsPerItem = 512;
  int pass1_rows = kAuto;
  int pass2_rows = kAuto;
  // Weight rows each core reads at once (2 or 4): in pass 1 a gate row with its up row, or two
  // such pairs (rows r and r + n/2 of an item's n); in pass 2 row pairs p, p + n/2 of a block,
  // or quadruples p, p + n/4, p + n/2, p + 3n/4. More concurrent streams keep more bytes in
  // flight per core; each row keeps its own accumulators. Panel banks read panels the same way.
  // kAuto: four for experts with at most two routes in the row-major int8 formats, two
  // otherwise.
  int row_streams = kAuto;

  // The defaults with the environment's settings applied, read now:
  //   MOE_CPU_OVERLAP=0 turns overlap_passes off, MOE_CPU_BLOCK_LANE=0 block_lane,
  //   MOE_CPU_AMX=0 amx, MOE_CPU_FP8_FP16=0 fp8_fp16 (0, false or off; any other value on);
  //   MOE_CPU_AMX_MIN_ROUTES, MOE_CPU_PREFETCH_BYTES, MOE_CPU_PREFETCH_L2_BYTES,
  //   MOE_CPU_PASS1_ROWS, MOE_CPU_PASS2_ROWS, MOE_CPU_ROW_STREAMS=<n> set amx_min_routes,
  //   prefetch_bytes, prefetch_l2_bytes, pass1_rows, pass2_rows, row_streams (-1: kAuto; a value
  //   that is not an integer is kept as INT_MIN, which Forward rejects).
  static Tuning FromEnv();
};

// cpu_moe::Forward with an explicit tuning (the public Forward passes Tuning()). Same shapes,
// ownership, thread safety and errors as the public overloads, plus InvalidArgument for a
// tuning value out of range.
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     const void* x, DType x_dtype, void* y, DType y_dtype, const Options& options,
                     const Tuning& tuning, common::ThreadPool& pool,
                     ForwardStats* stats = nullptr, OnednnExperts* onednn = nullptr);

// fp32 x [T, H] and y [T, H].
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     absl::Span<const float> x, absl::Span<float> y, const Options& options,
                     const Tuning& tuning, common::ThreadPool& pool,
                     ForwardStats* stats = nullptr, OnednnExperts* onednn = nullptr);

}  // namespace moe::cpu_moe::internal

#endif  // MOE_CPU_MOE_INTERNAL_TUNING_H_
