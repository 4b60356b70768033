// Routed experts on the GPU: for one MoE layer,
//
//   y[t] += sum_j w[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]),  s = slot_ids[t, j] >= 0,
//
// reading each expert's weights straight from its GPU slot (moe_cache::SlotPool), in the bytes
// the loader wrote into the ExpertStore (engine/loader.cc, ExpertBankLayout), never widened:
//   bf16:      "gate_up" [2I, H] ([gate; up] stacked, row-major) and "down" [H, I];
//   q4_0:      the same matrices in cpu_moe's panels (cpu_moe::Layout::kPanels, fp16 scales
//              inside the panels);
//   fp8_block: e4m3 "gate_up" [2I, H] and "down" [H, I] row-major, and their 128x128 block
//              scales in "gate_up_scales" [ceil(2I/128), ceil(H/128)] and "down_scales"
//              [ceil(H/128), ceil(I/128)] (f32, row-major per slot; a slot's row may be padded
//              past them: any pitch);
//   nvfp4:     e2m1 codes in cpu_moe's panels with the e4m3 scales of 16 columns inside, and
//              per-tensor f32 global scales: "gate_up_global_scale" (gate rows),
//              "up_global_scale" (up rows; may differ from the gate's) and "down_global_scale",
//              one float at the start of each slot's row.
// Activations stay f32 (x, the intermediate h, y); codes are decoded exactly to f32 (e4m3 and
// e2m1 through exact fp16 conversions), every product and sum is an f32 FMA, block scales
// multiply a lane's partial sum of the block's columns and global scales the finished dot
// product (gate, up) or h (down: h then holds down's global scale too), so results differ from
// a float64 reference on the dequantized weights only by f32 rounding.
//
// The launch is graph-safe: no allocation, no host synchronization, and a grid that depends only
// on (T, k, format, shapes), so one capture per batch bucket replays with new slot ids each step.
// Every kernel's summation order is fixed by the launch shape, so results are bit-identical from
// run to run, eager or replayed.
//
// Two ways to organise the work (RouteGrouping):
//   kPerRoute: pass 1 (gate_up + SwiGLU) per route, pass 2 (down) per token, summing the token's
//     routes inside one block and adding into y. Two kernels; each route reads its expert once.
//     The batch-1 decode path.
//   kBySlot: a one-block kernel sorts the routes by slot, then both passes run per distinct slot
//     over that slot's tokens (up to a chunk of tokens per weight read; see ExpertWorkspace), so
//     routes that share a slot read its weights once per call; a last kernel sums each token's
//     routes into y. Four kernels.
//   kAuto: kPerRoute up to kAutoPerRouteMaxTokens tokens, kBySlot above. On an H200 at
//     Qwen3-30B-A3B's shapes kPerRoute took 0.43x (T = 8) and 0.66x (T = 32) of kBySlot's time
//     for bf16 and 0.49x / 0.81x for q4_0 (expert_bench; README): its re-reads of a shared
//     expert cost less than the sort and the per-slot passes. (fp8_block and nvfp4 follow the
//     same rule; not measured.)
//
// Plain C++ header: no CUDA includes.
#ifndef MOE_ENGINE_CUDA_EXPERTS_ROUTED_EXPERTS_H_
#define MOE_ENGINE_CUDA_EXPERTS_ROUTED_EXPERTS_H_

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/formats.h"

struct CUstream_st;

namespace moe::moe_cache {
class BankLayout;
class SlotPool;
}  // namespace moe::moe_cache

namespace moe::engine::gpu {

using common::WeightFormat;

// Device addresses of one MoE layer's expert slots: slot s of the gate_up bank starts at
// gate_up + s * gate_up_pitch, likewise for every other bank (SlotPool's addressing). Views only;
// the pool owns the memory. Banks a format does not have stay null.
struct SlotBanks {
  WeightFormat format = WeightFormat::kBf16;  // kBf16, kQ4_0 (panels), kFp8Block, kNvfp4 (panels)
  int hidden = 0;                             // H, a multiple of 32
  int intermediate = 0;                       // I, a multiple of 32
  int num_slots = 0;                          // slot ids >= num_slots are skipped like padding
  const uint8_t* gate_up = nullptr;
  uint64_t gate_up_pitch = 0;  // a multiple of 16
  const uint8_t* down = nullptr;
  uint64_t down_pitch = 0;  // a multiple of 16
  // fp8_block: f32 block scales, [ceil(2I/128), ceil(H/128)] and [ceil(H/128), ceil(I/128)]
  // row-major from the start of each slot's row; pitches multiples of 4.
  const uint8_t* gate_up_scales = nullptr;
  uint64_t gate_up_scales_pitch = 0;
  const uint8_t* down_scales = nullptr;
  uint64_t down_scales_pitch = 0;
  // nvfp4: one f32 per slot (at the start of its row) for the gate rows, the up rows and down;
  // pitches multiples of 4.
  const uint8_t* gate_global_scale = nullptr;
  uint64_t gate_global_scale_pitch = 0;
  const uint8_t* up_global_scale = nullptr;
  uint64_t up_global_scale_pitch = 0;
  const uint8_t* down_global_scale = nullptr;
  uint64_t down_global_scale_pitch = 0;
};

// One bank of an expert as the loader lays it out: its name in the store's BankLayout and its
// payload bytes per expert.
struct ExpertBankSize {
  std::string_view name;
  uint64_t bytes = 0;
};

// Every bank an expert of `format` occupies, in the loader's order (engine/loader.cc): bf16 and
// q4_0 "gate_up", "down"; fp8_block "gate_up", "gate_up_scales", "down", "down_scales"; nvfp4
// "gate_up", "down", "gate_up_global_scale", "up_global_scale", "down_global_scale".
// InvalidArgument for formats without a GPU kernel here (mxfp4) or shapes that are not
// multiples of 32 in [32, 16384].
absl::StatusOr<std::vector<ExpertBankSize>> ExpertBankSizes(WeightFormat format, int hidden,
                                                            int intermediate);

// Payload bytes per expert of the "gate_up" and "down" banks in `format`, as the loader writes
// them (the codes, and the scales that live inside them: q4_0 and nvfp4 panels). Errors as
// ExpertBankSizes.
absl::StatusOr<uint64_t> GateUpBankBytes(WeightFormat format, int hidden, int intermediate);
absl::StatusOr<uint64_t> DownBankBytes(WeightFormat format, int hidden, int intermediate);

// SlotBanks over banks laid out by `layout` whose slot 0 starts at bases[b] (one per bank of the
// layout, device addresses), slot s at bases[b] + s * layout.bank(b).pitch: a SlotPool, or any
// buffer holding num_slots experts at the store's pitches (the prefill stream's layer buffers).
// InvalidArgument when a bank of `format` is missing, null or of another size.
absl::StatusOr<SlotBanks> SlotBanksFromLayout(const moe_cache::BankLayout& layout,
                                              const uint8_t* const* bases, int num_slots,
                                              WeightFormat format, int hidden, int intermediate);

// The pool's banks as SlotBanks (SlotBanksFromLayout over the pool's banks).
absl::StatusOr<SlotBanks> SlotBanksFromPool(const moe_cache::SlotPool& pool, WeightFormat format,
                                            int hidden, int intermediate);

// The base (slot 0) of the bank of `banks` that the store names `name`, or nullptr when `banks`
// has no such bank (for copying a layer bank by bank).
const uint8_t* SlotBankBase(const SlotBanks& banks, std::string_view name);

struct ExpertWorkspaceOptions {
  int max_tokens = 0;    // largest T a launch may take
  int top_k = 0;         // k of every launch
  int hidden = 0;        // H
  int intermediate = 0;  // I
  // Most distinct slots one call can route to (the layer's experts, E); bounds the grid of the
  // per-slot kernels, which loop over any extra. 0: max_tokens * top_k.
  int max_groups = 0;
};

// Device scratch for LaunchRoutedExperts, sized once for the largest call: the intermediate
// h [T*k, I] f32, per-route outputs [T*k, H] f32 and the route grouping. Also sets the kernels'
// dynamic shared memory limits (once per process and device, outside any capture). Owns its
// device memory; one launch at a time may use it (calls on one stream are fine).
class ExpertWorkspace {
 public:
  // Unavailable without CUDA or a device; InvalidArgument for bad sizes (T * k above
  // kMaxRoutes, top_k above kMaxTopK, shapes not multiples of 32 or above 16384, or activations
  // that do not fit in shared memory); ResourceExhausted when cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<ExpertWorkspace>> Create(
      const ExpertWorkspaceOptions& options);
  ~ExpertWorkspace();
  ExpertWorkspace(const ExpertWorkspace&) = delete;
  ExpertWorkspace& operator=(const ExpertWorkspace&) = delete;

  static constexpr int kMaxRoutes = 8192;  // T * k of one call (the grouping sorts in one block)
  static constexpr int kMaxTopK = 64;

  const ExpertWorkspaceOptions& options() const { return options_; }
  // Tokens of one slot handled per read of its weights in kBySlot (8 where the activations fit
  // in shared memory; larger groups read the weights again, mostly from L2).
  int token_chunk() const { return token_chunk_; }
  // All scratch as one device range (tests fill it with a NaN pattern to prove every value read
  // was written first).
  void* scratch() const { return block_; }
  uint64_t scratch_bytes() const { return block_bytes_; }

  // Device arrays (for the launch).
  float* h() const { return h_; }
  float* route_out() const { return route_out_; }
  int32_t* order() const { return order_; }
  int32_t* group_slot() const { return group_slot_; }
  int32_t* group_start() const { return group_start_; }
  int32_t* num_groups() const { return num_groups_; }

 private:
  ExpertWorkspace() = default;
  ExpertWorkspaceOptions options_;
  int token_chunk_ = 1;
  void* block_ = nullptr;
  uint64_t block_bytes_ = 0;
  float* h_ = nullptr;
  float* route_out_ = nullptr;
  int32_t* order_ = nullptr;
  int32_t* group_slot_ = nullptr;
  int32_t* group_start_ = nullptr;
  int32_t* num_groups_ = nullptr;
};

enum class RouteGrouping { kAuto, kPerRoute, kBySlot };
inline constexpr int kAutoPerRouteMaxTokens = 32;

// One MoE layer's routed experts, accumulated into y. All pointers are device memory:
//   x:             [T, H] f32, 16-byte aligned
//   slot_ids:      [T * k] int32, row-major [T, k]; < 0 (or >= banks.num_slots) is padding
//   route_weights: [T * k] f32 (read only for routes with a slot)
//   y:             [T, H] f32, 16-byte aligned, accumulated into (y += ...); rows whose routes
//                  are all padding are left bit-identical
// T = num_tokens in [1, options().max_tokens], k = options().top_k, banks' shape must match the
// workspace's. Enqueues on `stream` only; InvalidArgument for bad arguments, Internal when a
// launch fails.
absl::Status LaunchRoutedExperts(const SlotBanks& banks, ExpertWorkspace& workspace,
                                 int num_tokens, const float* x, const int32_t* slot_ids,
                                 const float* route_weights, float* y, CUstream_st* stream,
                                 RouteGrouping grouping = RouteGrouping::kAuto);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_EXPERTS_ROUTED_EXPERTS_H_
