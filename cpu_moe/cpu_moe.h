// cpu_moe: the routed-expert part of one MoE layer, computed on the CPU.
//
//   y[t] = sum_j weights[t, j] * down_e (act(gate_e x[t], up_e x[t])),  e = expert_ids[t, j]
//
// for experts held in host memory in any of the common weight formats (bf16, fp8_block, q4_0,
// nvfp4, mxfp4). The GEMVs are DRAM-bound, so the kernel is organised around reading each expert
// row once per call: routes are grouped by expert and both passes (gate_up, then down) split
// their work by (unique expert, row block), so tokens that share an expert share its
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
#include "common/expert_view.h"
#include "common/formats.h"
#include "common/thread_pool.h"

namespace moe::cpu_moe {

using common::WeightFormat;

class OnednnExperts;  // onednn_experts.h

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
//              `*_global_scales` float [E] (one per expert tensor); gate_up's apply to all 2I
//              rows unless `up_global_scales` gives the up rows their own (checkpoints that
//              quantize gate_proj and up_proj as two tensors, each with its per-tensor scale).
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
// Each panel is thus one sequential stream, which the hardware prefetcher follows best.
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
  // nvfp4 only: the global scales of rows [I, 2I) of gate_up (up_proj), [E] with
  // global_scale_stride; nullptr: gate_up_global_scales serve those rows too. Applied exactly
  // where gate_up_global_scales is, so equal values give bit-identical results.
  const float* up_global_scales = nullptr;
  const void* down_weights = nullptr;
  const void* down_scales = nullptr;
  const float* down_global_scales = nullptr;
  Layout layout = Layout::kRowMajor;
  // nvfp4: floats from one expert's global scale to the next (1: contiguous [E]; a store whose
  // rows are padded to 16 bytes has 4).
  int global_scale_stride = 1;

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

// What a library user sets. The memory-system knobs (prefetch distances, rows per work item,
// row streams, pass overlap) and the kernel choices that trade speed against summation order
// (block-lane, AMX, fp16 for fp8) are internal (cpu_moe/internal/tuning.h): Forward picks them
// per format, as measured on the target host, so that this struct says what is computed, not
// how fast. Plain value type; copy freely.
struct Options {
  Activation activation = Activation::kSwiGlu;
  float swiglu_alpha = 1.702f;  // kSwiGluOai only
  float swiglu_limit = 7.0f;    // kSwiGluOai only
  // Group routes by expert in both passes, so that tokens sharing an expert share the reads of
  // its weights. Inert at T=1 and whenever every route has a distinct expert: the work split is
  // then exactly the plain one.
  bool dedup = true;
  // y += result instead of y = result (for adding CPU-computed misses into other outputs).
  bool accumulate = false;
  // Highway target name ("AVX3_DL", "AVX3", "AVX2", "SSE4", ...) to cap dispatch at; empty: the
  // best target the CPU supports. A cap naming a supported target runs exactly that target; an
  // unknown or unsupported one is InvalidArgument.
  std::string max_target;
  // Prefill (with an OnednnExperts passed to Forward): experts with at least this many routes in
  // one call (tokens per expert) run as grouped GEMMs through oneDNN matmul (bf16, AMX where the CPU has it; onednn_experts.h), the
  // rest through the GEMV kernels. bf16 banks only; 0 turns oneDNN off. The default is the
  // crossover measured by onednn_bench. oneDNN rounds the activations to bf16 and splits its work
  // by the batch, so turn it off where results must not depend on the rest of the batch.
  static constexpr int kDefaultOnednnMinTokens = 8;
  int onednn_min_tokens_per_expert = kDefaultOnednnMinTokens;
  // ... and only when at least this many experts qualify; fewer go through the GEMV kernels too
  // (a few small GEMMs, each forked over every thread with its weights repacked, lose to the
  // GEMV kernels). -1: twice the OnednnExperts' thread count (OnednnExperts::threads()).
  int onednn_min_experts = -1;
  // bf16 and fp8 banks: where the CPU has AVX512_BF16 and the AVX3_DL target runs, round x and
  // the activated intermediate h to bf16 (round to nearest even, as common::FloatToBf16) and dot
  // them with the weights (fp8: decoded exactly to bf16) by the CPU's bf16 dot product
  // (vdpbf16ps, or AMX tiles: exact products, fp32 sums; bf16 denormals count as zero). false
  // keeps x and h in fp32 with fp32 FMAs (for comparing with an fp32 reference): the rounding
  // adds a relative error of up to 2^-9 per activation element (about 0.3% of y, relative
  // Frobenius, in cpu_moe_test), fp32 alone about 1e-6. ForwardStats::bf16_dot_product says
  // which ran.
  bool bf16_dot_product = true;
  // Print the reuse factor (routes / unique experts), the chosen target and which kernels ran to
  // stderr per call.
  bool debug = false;

  // Options with the environment's switches applied, read now (never cached):
  //   MOE_CPU_DEDUP=0 turns dedup off, MOE_CPU_BF16_DOT=0 turns bf16_dot_product off,
  //   MOE_CPU_DEBUG=1 turns debug on, MOE_CPU_MAX_TARGET=<name> caps the target,
  //   MOE_CPU_ONEDNN_MIN_TOKENS=<n> sets onednn_min_tokens_per_expert (0: oneDNN off).
  // The tuning variables are read by internal::Tuning::FromEnv.
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
  // AMX tiles ran for at least one expert (internal::Tuning::amx); with it bf16_dot_product is
  // true.
  bool amx = false;
  // fp8's fp16 kernels ran for at least one expert (internal::Tuning::fp8_fp16); with it
  // bf16_dot_product is true (the experts through AMX, if any, took bf16-rounded activations).
  bool fp8_fp16 = false;
  // Wall time of the GEMV path's phases (for profiling; zero when no route took that path):
  // preparing x, pass 1 (gate_up), preparing h, pass 2 (down). The oneDNN part is not included.
  // With the passes overlapped (internal::Tuning::overlap_passes, the default), pass 1 runs
  // until its last item is done and includes preparing h (prep_h_seconds is 0), and pass 2 is
  // the rest of the call (its first items ran beside the end of pass 1).
  double prep_x_seconds = 0.0;
  double pass1_seconds = 0.0;
  double prep_h_seconds = 0.0;
  double pass2_seconds = 0.0;
};

// y[T, H] = the routed MoE output for x[T, H].
//   expert_ids [T, k]: int32; < 0 is padding (skipped, counted nowhere); >= E is an error.
//   weights    [T, k]: routing weights (already normalised as the model wants).
//   x          [T, H], y [T, H]: fp32 or bf16 (bf16 as uint16_t bits) per `x_dtype`/`y_dtype`.
// Rows of y whose token has no valid route are left untouched. Reads the bank, ids, weights and
// x; writes only y (and *stats when given). Thread-safe for distinct y. `pool` runs the work;
// its caller thread takes part. InvalidArgument for a bank it cannot read (shape, format,
// missing scales), mismatched sizes, an id >= E, or an unknown target cap; ResourceExhausted
// when the call's scratch (it grows with num_tokens * top_k: h and the per-route outputs take
// routes * (2I + H) floats) cannot be allocated, with y untouched; the oneDNN part's errors pass
// through. Runs with the default tuning (internal::Tuning()).
// `onednn`: the oneDNN engine and primitive cache of the prefill path (onednn_experts.h), owned
// by the caller like the pool and shared by its calls; nullptr: no oneDNN, every expert through
// the GEMV kernels (as with Options::onednn_min_tokens_per_expert = 0).
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     const void* x, DType x_dtype, void* y, DType y_dtype, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats = nullptr,
                     OnednnExperts* onednn = nullptr);

// Convenience overload for fp32 x and y.
absl::Status Forward(const ExpertBank& bank, int num_tokens, int top_k,
                     absl::Span<const int32_t> expert_ids, absl::Span<const float> weights,
                     absl::Span<const float> x, absl::Span<float> y, const Options& options,
                     common::ThreadPool& pool, ForwardStats* stats = nullptr,
                     OnednnExperts* onednn = nullptr);

// The bank of one layer's experts as a holder such as moe_cache's ExpertStore hands them out
// (common/expert_view.h), read in place: no copy. The codes and scales of consecutive experts
// must be dense (pitch == the bytes above per expert, which the 16-byte store rows are for every
// shape except fp8_block scales of shapes whose scale rows are not whole 16-byte rows); nvfp4's
// global scales may have any pitch of whole floats. InvalidArgument otherwise, or for a bank
// Forward would reject. The result points into the view's memory.
absl::StatusOr<ExpertBank> BankFromView(const common::ExpertLayerView& view);

// A bank copied into Layout::kPanels, owning its memory (on transparent huge pages where the
// system allows). `bank` points into the buffers below; the struct does not move (PackPanels
// returns it by unique_ptr).
struct PanelBank {
  ExpertBank bank;
  common::AlignedBuffer<uint8_t> gate_up;
  common::AlignedBuffer<uint8_t> down;
  std::vector<float> gate_up_global_scales;
  std::vector<float> up_global_scales;  // empty unless the source bank had them
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
