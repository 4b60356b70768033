// cpu_moe: the routed-expert part of one MoE layer, computed on the CPU.
//
//   y[t] = sum_j weights[t, j] * down_e (act(gate_e x[t], up_e x[t])),  e = expert_ids[t, j]
//
// for experts held in host memory in any of the common weight formats (bf16, fp8_block, q4_0,
// nvfp4, mxfp4). The GEMVs are DRAM-bound, so the kernel is organised around reading each expert
// row once per call: routes are grouped by expert and both passes (gate_up, then down) split
// their work by (unique expert, row block) (seed 003), so tokens that share an expert share its
// bytes; pass 2 writes each route's rows apart and sums every token's routes at the end.
// Quantized formats use int8 dot products (VNNI where the CPU has it) against activations
// quantized per 32-element block like llama.cpp's Q8_0; bf16 and fp8 (decoded exactly to bf16)
// use the CPU's bf16 dot product (AVX512_BF16, and AMX tiles for experts with many routes)
// against activations rounded to bf16 where present, fp32 FMAs elsewhere.
// ISA targets come from Highway dynamic dispatch, chosen once per Forward call.
//
// Plain types only: no Highway types in this header.
#ifndef MOE_CPU_MOE_CPU_MOE_H_
#define MOE_CPU_MOE_CPU_MOE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "common/thread_pool.h"

namespace moe::cpu_moe {

using common::WeightFormat;

// One layer's routed experts in one weight format. Views only: the caller owns the memory, which
// must outlive every Forward call that uses it. Matrices are row-major with the contraction
// dimension last (rows of gate_up have H elements, rows of down have I elements).
//
//   gate_up: [E, 2I, H]: rows [0, I) of each expert are gate_proj, rows [I, 2I) up_proj.
//   down:    [E, H, I].
//
// Per format, `*_weights` points at (per expert, experts contiguous):
//   kBf16:     uint16_t bf16 bits [rows, cols]; no scales.
//   kFp8Block: uint8_t e4m3 [rows, cols]; `*_scales` float [ceil(rows/128), ceil(cols/128)] per
//              expert (common::QuantizeFp8Block's layout).
//   kQ4_0:     common::BlockQ4_0 [rows, cols/32] (scales inside the blocks).
//   kMxfp4:    uint8_t packed [rows, cols/2]; `*_scales` uint8_t ue8m0 [rows, cols/32].
//   kNvfp4:    uint8_t packed [rows, cols/2]; `*_scales` uint8_t e4m3 [rows, cols/16];
//              `*_global_scales` float [E] (one per expert tensor).
//
// Layout::kPanels (q4_0, mxfp4, nvfp4; made by PackPanels): each matrix is stored in panels of
// 16 rows, so that int32 lane j of every 512-bit vector of a panel is row j and one dot-product
// instruction serves 16 rows of a route at once: 12 vector operations per 512 weights and route
// (8 vpdpbusd, an add, a conversion, a multiply, an FMA) where the row-major kernels spend 14 and
// a horizontal sum per row and route, and a cheaper decode. `*_weights` points at, per expert
// (experts contiguous), the rows / 16 panels in order. Panel p (rows [16p, 16p + 16)) holds, per
// 32-column block b,
//   codes:  256 bytes; byte 64v + 4j + i (v < 4, j < 16, i < 4) holds row 16p + j's codes of
//           column 32b + 8v + i (low nibble) and 32b + 8v + 4 + i (high nibble): q4_0 q in
//           [0, 15], fp4 the e2m1 code;
//   scales: q4_0 the 16 rows' fp16 d (32 bytes); mxfp4 their 16 ue8m0 bytes; nvfp4 the 16 rows'
//           e4m3 scales of columns [32b, 32b + 16), then of [32b + 16, 32b + 32) (32 bytes);
// in groups of G = 64 / (scale bytes) blocks (q4_0, nvfp4: 2; mxfp4: 4): the group's codes, then
// its scales, one 64-byte line (a last group of fewer blocks: their codes, then their scales).
// Each panel is thus one sequential stream (on the GPU machine's host, in alternating processes,
// about 3% more of DRAM than with all of a panel's scales after its codes, and as fast or faster
// cache-hot: session 10).
// The same bytes per expert as the row-major layout. `*_scales` are unused (scales are inside);
// nvfp4's `*_global_scales` as above.
enum class Layout { kRowMajor, kPanels };

struct ExpertBank {
  WeightFormat format = WeightFormat::kBf16;
  int num_experts = 0;   // E
  int hidden = 0;        // H, a multiple of 32
  int intermediate = 0;  // I, a multiple of 32
  const void* gate_up_weights = nullptr;
  const void* gate_up_scales = nullptr;
  const float* gate_up_global_scales = nullptr;
  const void* down_weights = nullptr;
  const void* down_scales = nullptr;
  const float* down_global_scales = nullptr;
  Layout layout = Layout::kRowMajor;

  // Bytes of one expert's gate_up / down weights including their scales (what one read costs).
  size_t GateUpBytesPerExpert() const;
  size_t DownBytesPerExpert() const;
  size_t BytesPerExpert() const { return GateUpBytesPerExpert() + DownBytesPerExpert(); }
};

enum class Activation {
  kSwiGlu,     // silu(gate) * up
  kSwiGluOai,  // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
               //          g * sigmoid(alpha * g) * (u + 1)
};

enum class DType { kF32, kBf16 };

struct Options {
  Activation activation = Activation::kSwiGlu;
  float swiglu_alpha = 1.702f;  // kSwiGluOai only
  float swiglu_limit = 7.0f;    // kSwiGluOai only
  // Group routes by expert in both passes (seed 003). Inert at T=1 and whenever every route has a
  // distinct expert: the work split is then exactly the plain one.
  bool dedup = true;
  // Run pass 1, pass 2 and the per-token sums as one fork-join: workers that run out of pass-1
  // items go on with pass-2 items of experts whose pass 1 is complete, so the weight streams do
  // not drain at a barrier between the passes, and each pass-1 item prepares its own rows of the
  // activations for pass 2. Results are bit-identical either way. Needs pass1_rows to be a
  // multiple of the activation block (32 for the int8 formats, 64 for fp8 on AVX3_DL, 2 for
  // bf16); otherwise, or when false, the passes are separated by joins.
  bool overlap_passes = true;
  // Quantized formats (q4_0, nvfp4, mxfp4) on the 512-bit targets (AVX3, AVX3_DL): dot each
  // 128-byte chunk of a row in a block-lane order, in which every int32 lane stays within one
  // weight block, so a route converts and scales once per 256 weights instead of once per 64.
  // false: the plain layout (for comparison; results differ only by int32 -> fp32 rounding of
  // partial sums, within the format's tolerance). Banks in panels (Layout::kPanels) have their
  // own kernel and ignore this.
  bool block_lane = true;
  // Print the reuse factor (routes / unique experts), the chosen target and whether bf16's dot
  // product ran to stderr per call.
  bool debug = false;
  // bf16 and fp8 banks: where the CPU has AVX512_BF16 and the AVX3_DL target runs, round x and
  // the activated intermediate h to bf16 (round to nearest even, as common::FloatToBf16) and dot
  // them with the weights (fp8: decoded exactly to bf16) by the CPU's bf16 dot product
  // (vdpbf16ps, or AMX tiles, see amx: exact products, fp32 sums; bf16 denormals count as
  // zero). false keeps x and h in fp32 with fp32 FMAs: the rounding adds a relative error of up
  // to 2^-9 per activation element (about 0.3% of y, relative Frobenius, in cpu_moe_test), fp32
  // alone about 1e-6. ForwardStats::bf16_dot_product says which ran.
  bool bf16_dot_product = true;
  // AMX tiles (tdpbf16ps) where the CPU has AMX-TILE and AMX-BF16 (and Linux grants the tile
  // state), on the AVX3_DL target with bf16_dot_product, for experts with at least
  // amx_min_routes routes in a call: 16 weight rows by up to 16 routes per instruction, so their
  // cost no longer grows with the routes per expert (fp8 weights are decoded exactly to bf16
  // first). Same activation rounding as bf16_dot_product; only the fp32 summation order
  // differs. ForwardStats::amx says whether it ran for any expert.
  bool amx = true;
  // fp8 banks, where bf16_dot_product applies and the CPU has AVX512-FP16 (Sapphire Rapids on;
  // with GFNI, which all of those have): the experts that do not go through AMX are dotted with
  // fp16 FMAs instead of vdpbf16ps (every e4m3 value is exact in fp16): 1.7-2.2x as fast on one
  // core with the weights in L2, 1.2-1.7x with all 16 workers of the GPU machine's host
  // cache-hot, 7-14% faster steps at T=1-64 side by side. Each route's activations are scaled
  // per 128-row scale block so that they fit fp16's range, rounded to fp16 (11 significant bits
  // against bf16's 8) and summed in fp16 over 256 columns, then in fp32: at most 10 * 2^-11
  // (0.5%) of the sum of |terms| per dot, typically about 1e-4 of it.
  // e4m3's NaN codes (0x7F, 0xFF) read as +-480 there, as in the F16C kernels of the other
  // targets. ForwardStats::fp8_fp16 says whether it ran.
  bool fp8_fp16 = true;
  // Routes an expert needs in a call to go through AMX; 0: none. kAuto: 5 for fp8 and 12 for
  // bf16, as measured side by side on the GPU machine's host (see ResolveTuning).
  int amx_min_routes = -1;
  // Highway target name ("AVX3_DL", "AVX3", "AVX2", "SSE4", ...) to cap dispatch at; empty: the
  // best target the CPU supports. A cap naming a supported target runs exactly that target.
  std::string max_target;
  // y += result instead of y = result (for adding CPU-computed misses into other outputs).
  bool accumulate = false;
  // Prefill: experts with at least this many routes in one call (tokens per expert) run as
  // grouped GEMMs through oneDNN matmul (bf16, AMX where the CPU has it; onednn_experts.h), the
  // rest through the GEMV kernels. bf16 banks only; 0 turns oneDNN off. The default is the
  // crossover measured by onednn_bench (cpu_moe/benchmarks/onednn_crossover.md).
  static constexpr int kDefaultOnednnMinTokens = 8;
  int onednn_min_tokens_per_expert = kDefaultOnednnMinTokens;
  // ... and only when at least this many experts qualify; fewer go through the GEMV kernels too.
  // oneDNN wins by spreading whole experts over its threads, one single-threaded GEMM each; with
  // few experts each small GEMM is forked over every thread and its weights repacked, which on
  // the GPU machine's 16-core host made a decode step (T=64, E=128, ~6 experts at >= 8 tokens)
  // 1.75x slower than the GEMV kernels alone. -1: twice oneDNN's thread count.
  int onednn_min_experts = -1;

  // Memory-system tuning (for sweeps on the target host; results are bit-identical for every
  // valid setting, only the speed changes). Forward rejects values out of range. kAuto picks the
  // per-format values measured best on the GPU machine's 16-core host (sweep of 2026-11-30,
  // benchmarks/host_sweep_h200host_2026-11-30.md, then side-by-side runs of
  // benchmarks/h200host_tuning_2026-11-30_session2.md, then with the session-3 kernels
  // benchmarks/h200host_tuning_2026-11-30_session3.md): bf16 prefetches 4096 bytes ahead, fp8
  // 2048 bytes, the 4-bit formats 1024 bytes (four times as many rows of their smaller rows),
  // 2048 in panels (session 8, benchmarks/h200host_tuning_2026-11-30_session8.md); pass 1 takes
  // 64 gate rows per item (bf16, fp8) or 128 (4-bit formats; 256 in panels), pass 2 128 rows
  // (bf16, fp8) or 256 (4-bit formats). Panel banks round the rows per item up to whole 16-row
  // panels.
  static constexpr int kAuto = -1;
  // Bytes ahead of the current position that the row kernels prefetch in the weight stream (and
  // how much of the next row / expert's rows is prefetched up front). 0 turns software prefetch
  // off; otherwise a multiple of 64 in [64, kMaxPrefetchBytes].
  static constexpr int kMaxPrefetchBytes = 8192;
  int prefetch_bytes = kAuto;
  // Bytes ahead of the current position of a second software prefetch in the weight stream,
  // into L2 only (prefetcht1 on x86), beside the prefetch_bytes one, in the bf16, fp8_block and
  // panel kernels (the int8 formats' row-major kernels take none: no gain there on the host,
  // mxfp4 4-8% slower); 0 turns it off, otherwise a multiple of 64 in [64, kMaxPrefetchL2Bytes].
  // kAuto: 8192 for bf16 (0.5-10% faster steps side by side on the GPU machine's host) and for
  // 4-bit banks in panels (3-7%), 0 for fp8_block (within +-3%) and row-major 4-bit banks.
  // fp8 on its fp16 kernels (fp8_fp16) with both distances at kAuto: experts with one or two
  // routes in a call read 4096 bytes ahead into L1 and 8192 into L2 (2-7% faster steps at
  // T=1-32 side by side on the host), the others 2048 and 0.
  static constexpr int kMaxPrefetchL2Bytes = 32768;
  int prefetch_l2_bytes = kAuto;
  // Rows per work item: pass 1 gate rows (each with its up row) per item, any value in
  // [1, kMaxRowsPerItem]; pass 2 H rows of one expert per item, even (a block's rows are dotted
  // in pairs, row p with row p + rows/2) in [2, kMaxRowsPerItem].
  static constexpr int kMaxRowsPerItem = 512;
  int pass1_rows = kAuto;
  int pass2_rows = kAuto;
  // Weight rows each core reads at once (2 or 4): in pass 1 a gate row with its up row, or two
  // such pairs (rows r and r + n/2 of an item's n); in pass 2 row pairs p, p + n/2 of a block,
  // or quadruples p, p + n/4, p + n/2, p + 3n/4. More concurrent streams keep more bytes in
  // flight per core; each row keeps its own accumulators, so y is the same either way. kAuto:
  // four for experts with at most two routes in the row-major int8 formats, two otherwise.
  // Panel banks (Layout::kPanels) read panels the same way: two (pass 1: a gate panel with its
  // up panel; pass 2: panels p and p + n/2 of an item's n) or four (two such gate and up pairs;
  // panels p, p + n/4, p + n/2, p + 3n/4); kAuto gives them two.
  int row_streams = kAuto;

  // Options with the environment's switches applied, read now (never cached):
  //   MOE_CPU_DEDUP=0 turns dedup off, MOE_CPU_OVERLAP=0 turns overlap_passes off,
  //   MOE_CPU_BLOCK_LANE=0 turns block_lane off, MOE_CPU_BF16_DOT=0 turns bf16_dot_product
  //   off, MOE_CPU_AMX=0 turns amx off, MOE_CPU_AMX_MIN_ROUTES=<n> sets amx_min_routes,
  //   MOE_CPU_FP8_FP16=0 turns fp8_fp16 off,
  //   MOE_CPU_DEBUG=1 turns debug on,
  //   MOE_CPU_MAX_TARGET=<name> caps the target,
  //   MOE_CPU_ONEDNN_MIN_TOKENS=<n> sets onednn_min_tokens_per_expert (0: oneDNN off),
  //   MOE_CPU_PREFETCH_BYTES=<n>, MOE_CPU_PREFETCH_L2_BYTES=<n>, MOE_CPU_PASS1_ROWS=<n>,
  //   MOE_CPU_PASS2_ROWS=<n>, MOE_CPU_ROW_STREAMS=<n> set prefetch_bytes, prefetch_l2_bytes,
  //   pass1_rows, pass2_rows, row_streams (-1: kAuto; a value that is not an integer is kept
  //   as INT_MIN, which Forward rejects).
  static Options FromEnv();
};

// What one Forward call did (optional output).
struct ForwardStats {
  int routes = 0;          // valid routes (ids >= 0)
  int unique_experts = 0;  // distinct experts among them
  double reuse = 0.0;      // routes / unique_experts (0 when there are no routes)
  std::string target;      // Highway target that ran
  int onednn_experts = 0;  // experts computed through oneDNN (their routes are in `routes`)
  // The GEMV kernels ran with the CPU's bf16 dot product on bf16-rounded activations (see
  // Options::bf16_dot_product); false when they used fp32 FMAs or did not run.
  bool bf16_dot_product = false;
  // AMX tiles ran for at least one expert (Options::amx); with it bf16_dot_product is true.
  bool amx = false;
  // fp8's fp16 kernels ran for at least one expert (Options::fp8_fp16); with it
  // bf16_dot_product is true (the experts through AMX, if any, took bf16-rounded activations).
  bool fp8_fp16 = false;
  // Wall time of the GEMV path's phases (for profiling; zero when no route took that path):
  // preparing x, pass 1 (gate_up), preparing h, pass 2 (down). The oneDNN part is not included.
  // With overlap_passes, pass 1 runs until its last item is done and includes preparing h
  // (prep_h_seconds is 0), and pass 2 is the rest of the call (its first items ran beside the
  // end of pass 1).
  double prep_x_seconds = 0.0;
  double pass1_seconds = 0.0;
  double prep_h_seconds = 0.0;
  double pass2_seconds = 0.0;
};

// y[T, H] = the routed MoE output for x[T, H].
//   expert_ids [T, k]: int32; < 0 is padding (skipped, counted nowhere); >= E is an error.
//   weights    [T, k]: routing weights (already normalised as the model wants).
//   x          [T, H], y [T, H]: fp32 or bf16 (bf16 as uint16_t bits) per `x_dtype`/`y_dtype`.
// Rows of y whose token has no valid route are left untouched. Thread-safe for distinct y.
// `pool` runs the work; its caller thread takes part.
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     const void* x, DType x_dtype, void* y, DType y_dtype, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats = nullptr);

// Convenience overload for fp32 x and y.
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     absl::Span<const float> x, absl::Span<float> y, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats = nullptr);

// A bank copied into Layout::kPanels, owning its memory (on transparent huge pages where the
// system allows). `bank` points into the buffers below; the struct does not move (PackPanels
// returns it by unique_ptr).
struct PanelBank {
  ExpertBank bank;
  common::AlignedBuffer<uint8_t> gate_up;
  common::AlignedBuffer<uint8_t> down;
  std::vector<float> gate_up_global_scales;
  std::vector<float> down_global_scales;
};

// Copies a row-major q4_0, mxfp4 or nvfp4 bank into Layout::kPanels (the layout the int8 kernels
// read fastest; Forward reads both). The source may be freed afterwards. `pool` (optional)
// shares the copying out by expert. InvalidArgument for other formats, a bank Forward would
// reject, or one that is already in panels; ResourceExhausted when memory runs out.
absl::StatusOr<std::unique_ptr<PanelBank>> PackPanels(const ExpertBank& row_major,
                                                      common::ThreadPool* pool = nullptr);

// Highway targets compiled into this library that the CPU supports, best first.
std::vector<std::string> AvailableTargets();

}  // namespace moe::cpu_moe

#endif  // MOE_CPU_MOE_CPU_MOE_H_
