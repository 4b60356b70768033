// Per-token operators of the GPU engine's dense path, each one kernel launch on a given stream:
// embedding gather, RMSNorm, Qwen3's per-head q/k RMSNorm with rotate-half RoPE (full or
// partial), SiLU(gate)*up, residual and bias adds, the router's softmax top-k, the sigmoid-gated
// shared-expert combine, greedy argmax over the vocabulary, f32 <-> bf16 casts, the gated
// attention's query split and output gate, and seeded uniform fills (synthetic benchmark
// contexts).
//
// They compute what the CPU engine computes (engine/model.cc, engine/kernels.h, engine/rope.h,
// engine/sampler.cc), in f32, with the same formulas and tie-breaking; sums run in a different
// order, so f32 results differ from the CPU's by rounding only. bf16 values are raw bits,
// rounded to nearest even exactly as common/formats.h's FloatToBf16.
//
// Every launch validates its sizes on the host (InvalidArgument), never allocates or
// synchronizes, and uses a grid that depends only on its size arguments, so it can be captured
// in a CUDA graph and replayed with new device data. Launch errors come back as Internal.
// Pointers are device addresses. Plain C++ header: no CUDA includes; without CUDA every launch
// returns Unavailable.
#ifndef MOE_ENGINE_CUDA_OPS_TOKEN_OPS_H_
#define MOE_ENGINE_CUDA_OPS_TOKEN_OPS_H_

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;

namespace moe::engine::gpu {

// out[t, :] = table[ids[t], :] widened to f32. table: bf16 [vocab, hidden]; ids: int32
// [num_tokens]; out: f32 [num_tokens, hidden]. An id outside [0, vocab) (the padding of a
// fixed-size captured batch) gives a row of zeros.
absl::Status LaunchEmbeddingGather(const uint16_t* table, int vocab, int hidden, const int32_t* ids,
                                   int num_tokens, float* out, CUstream_st* stream);

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for `rows` rows of n (the CPU's
// RmsNormRows). x: f32 [rows, n]; weight: f32 [n]; out_f32: f32 [rows, n] (may equal x);
// out_bf16: bf16 [rows, n]. Either output may be null, not both.
absl::Status LaunchRmsNorm(const float* x, int rows, int n, const float* weight, float eps,
                           float* out_f32, uint16_t* out_bf16, CUstream_st* stream);

// Attention's per-head steps on the q/k projections, in place, in the CPU engine's order:
// optional RMSNorm of every head (Qwen3's q_norm/k_norm, one weight [head_dim] shared by the
// heads), then optional rotate-half RoPE at each token's position over the first r = rotary_dim
// dimensions (the rest pass through):
//   x[i] = x[i] * cos[p, i] - x[i + r/2] * sin[p, i],
//   x[i + r/2] = x[i + r/2] * cos[p, i] + x[i] * sin[p, i]      (i < r/2),
// with the tables of rope_table.h (attention factor included), rounded as the CPU rounds them
// (no fused multiply-add). A token whose position is outside [0, max_positions) is normalised
// but not rotated (padding).
struct QkNormRopeArgs {
  float* q = nullptr;  // f32 [num_tokens, num_q_heads, head_dim]
  float* k = nullptr;  // f32 [num_tokens, num_kv_heads, head_dim]
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // even, at most kMaxHeadDim
  // RMSNorm when both are set (f32 [head_dim] each); none when both are null.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  // RoPE when cos is set: cos, sin f32 [max_positions, rotary_dim / 2]; positions int32
  // [num_tokens]. rotary_dim: even, at most head_dim; 0 means head_dim.
  const int32_t* positions = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int max_positions = 0;
  int rotary_dim = 0;
};
inline constexpr int kMaxHeadDim = 512;
absl::Status LaunchQkNormRope(const QkNormRopeArgs& args, CUstream_st* stream);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i], silu(g) = g / (1 + exp(-g)).
// gate_up: f32 [num_tokens, 2 * inter] ([gate | up], the output of a stacked [gate; up]
// projection); out_f32: f32 [num_tokens, inter]; out_bf16: bf16 [num_tokens, inter]. Either
// output may be null, not both.
absl::Status LaunchSiluMul(const float* gate_up, int num_tokens, int inter, float* out_f32,
                           uint16_t* out_bf16, CUstream_st* stream);

// y[i] += x[i] for i < n (residual add). y, x: f32 [n].
absl::Status LaunchAdd(float* y, const float* x, int64_t n, CUstream_st* stream);

// y[r, j] += bias[j]. y: f32 [rows, n]; bias: f32 [n].
absl::Status LaunchAddBias(float* y, int rows, int n, const float* bias, CUstream_st* stream);

// The router as the CPU computes it: p = softmax(logits[t]) in f32, the top_k largest p (larger
// first, the lower expert id first on exact ties, as the CPU's partial_sort comparator), weights
// p, or p / (sum of the top_k p, summed in rank order) when renormalize (norm_topk_prob).
// logits: f32 [num_tokens, num_experts]; ids: int32 [num_tokens, top_k]; weights: f32
// [num_tokens, top_k]. num_experts <= kMaxRouterExperts, top_k <= min(kMaxRouterTopK, experts).
inline constexpr int kMaxRouterExperts = 512;
inline constexpr int kMaxRouterTopK = 16;
absl::Status LaunchRouterTopK(const float* logits, int num_tokens, int num_experts, int top_k,
                              bool renormalize, int32_t* ids, float* weights, CUstream_st* stream);

// qwen2_moe's shared expert: h[t, i] += sigmoid(gate_logit[t]) * shared[t, i].
// h, shared: f32 [num_tokens, hidden]; gate_logit: f32 [num_tokens].
absl::Status LaunchSharedExpertCombine(float* h, const float* shared, const float* gate_logit,
                                       int num_tokens, int hidden, CUstream_st* stream);

// Greedy argmax per row: the largest entry, the lowest index on ties (the CPU sampler's
// ArgMax); NaN entries are never chosen (a row of NaN only gives 0). Two kernels: partial
// maxima of fixed chunks of each row into `scratch`, then one pass per row.
// logits: f32 [num_tokens, vocab]; out: int32 [num_tokens]; scratch: device memory of at least
// ArgmaxScratchBytes(num_tokens, vocab) bytes, 8-byte aligned, used by this launch only.
inline constexpr int kArgmaxChunk = 4096;        // entries per partial maximum
inline constexpr int kArgmaxCandidateBytes = 8;  // one partial maximum: f32 value, int32 index
int64_t ArgmaxScratchBytes(int num_tokens, int vocab);
absl::Status LaunchArgmax(const float* logits, int num_tokens, int vocab, void* scratch,
                          int32_t* out, CUstream_st* stream);

// Casts of n values: f32 -> bf16 (round to nearest even, NaN kept quiet) and bf16 -> f32.
absl::Status LaunchF32ToBf16(const float* x, int64_t n, uint16_t* out, CUstream_st* stream);
absl::Status LaunchBf16ToF32(const uint16_t* x, int64_t n, float* out, CUstream_st* stream);

// Gated attention (qwen3_5_moe's full-attention layers): q_proj gives per head head_dim query
// values, then head_dim gate values. Splits qg f32 [num_tokens, num_heads, 2, head_dim] into
// q and gate, f32 [num_tokens, num_heads, head_dim] each.
absl::Status LaunchSplitGatedQuery(const float* qg, int num_tokens, int num_heads, int head_dim,
                                   float* q, float* gate, CUstream_st* stream);

// out[i] = bf16(x[i] * sigmoid(gate[i])) for i < n: the attention output under its gate, cast for
// the o projection. x, gate: f32 [n]; out: bf16 [n].
absl::Status LaunchSigmoidGateToBf16(const float* x, const float* gate, int64_t n, uint16_t* out,
                                     CUstream_st* stream);

// Benchmark fill: x[i] = lo + (hi - lo) * u(seed, i), u a hash of (seed, i) in [0, 1): the same
// values for the same seed. The bf16 form rounds them to bf16.
absl::Status LaunchFillUniformF32(float* x, int64_t n, float lo, float hi, uint64_t seed,
                                  CUstream_st* stream);
absl::Status LaunchFillUniformBf16(uint16_t* x, int64_t n, float lo, float hi, uint64_t seed,
                                   CUstream_st* stream);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_OPS_TOKEN_OPS_H_
