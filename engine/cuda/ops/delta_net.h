// The Gated DeltaNet token mixer (qwen3_5_moe's linear-attention layers) on the GPU: the same
// steps as the CPU engine's Model::LinearAttention (engine/model.cc, engine/gated_delta_net.h), in
// f32, for the pieces of one pass (each piece: consecutive tokens of one sequence, its rows
// consecutive in the pass), each continuing from its sequence's state slot:
//
//   1. LaunchDeltaNetConv: the causal depthwise conv over in_proj_qkv's channels with SiLU, the
//      rows before a piece taken from its slot's conv state (its last kernel - 1 inputs); then
//      the state is replaced by the piece's last kernel - 1 inputs.
//   2. LaunchDeltaNetGates: per row, q and k heads L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q
//      scaled by key_head_dim^-0.5, in place; beta = sigmoid(b), g = -exp(A_log) *
//      softplus(a + dt_bias) (torch's softplus, threshold 20).
//   3. LaunchDeltaRule: per (piece, value head), token by token from the slot's recurrent state
//      S [key_head_dim, value_head_dim] (value head h reads key head h / (nv / nk)):
//        S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t;
//      S is written back after the piece's last token.
//   4. LaunchGatedRmsNorm: per (row, value head), o = weight * (o * rsqrt(mean(o^2) + eps)) *
//      silu(z), out as bf16 for the output projection.
//
// A piece whose start position is 0 begins a sequence: it reads zeros instead of its slot's
// conv and recurrent state (so slots need no reset). A piece with start position < 0 is padding
// (a captured decode bucket's unused rows): nothing of its slot is read or written, and its
// rows' outputs are zeros.
//
// Every launch validates its sizes on the host (InvalidArgument), never allocates or
// synchronizes, and uses a grid that depends only on its size arguments (never on the device
// arrays' contents), so a pass can be captured in a CUDA graph and replayed with new pieces.
// Pointers are device addresses. Plain C++ header: no CUDA includes; without CUDA every launch
// returns Unavailable.
#ifndef MOE_ENGINE_CUDA_OPS_DELTA_NET_H_
#define MOE_ENGINE_CUDA_OPS_DELTA_NET_H_

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;

namespace moe::engine::gpu {

// Sizes of the linear-attention layers (engine::LinearAttentionConfig).
struct DeltaNetShape {
  int num_key_heads = 0;    // nk
  int num_value_heads = 0;  // nv, a multiple of nk
  int key_head_dim = 0;     // dk, at most kMaxDeltaHeadDim
  int value_head_dim = 0;   // dv, at most kMaxDeltaHeadDim
  int conv_kernel = 0;      // taps of the causal conv, 2 to 8
  int key_dim() const { return num_key_heads * key_head_dim; }
  int value_dim() const { return num_value_heads * value_head_dim; }
  // Channels of the conv: q (key_dim), k (key_dim), v (value_dim).
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
};
inline constexpr int kMaxDeltaHeadDim = 256;

// The pieces of one pass, in device memory: piece p covers rows [first_row[p], first_row[p] +
// num_rows[p]) at positions start_pos[p], start_pos[p] + 1, ... and its sequence's state is slot
// state_slot[p]. Pieces must not share a slot.
struct DeltaNetPieces {
  int num_pieces = 0;  // the grid's size: a bucket's padding pieces included
  const int32_t* first_row = nullptr;
  const int32_t* num_rows = nullptr;
  const int32_t* start_pos = nullptr;   // 0: the sequence starts here; < 0: padding
  const int32_t* state_slot = nullptr;  // in [0, num_slots) for pieces that are not padding
};

// One linear-attention layer's state of every slot (f32): slot s's conv inputs
// [conv_kernel - 1, conv_dim] (oldest first) at conv + s * slot_stride, its recurrent state
// [nv, dk, dv] at recurrent + s * slot_stride (engine::LinearAttentionState's layout, one layer).
struct DeltaNetState {
  float* conv = nullptr;
  float* recurrent = nullptr;
  int64_t slot_stride = 0;  // floats
  int num_slots = 0;
};

// in: f32 [rows, *] whose columns [0, conv_dim) are in_proj_qkv's output (row stride
// in_stride); weight: f32 [conv_kernel, conv_dim] (tap-major); out: f32 [rows, conv_dim].
// Reads and then updates the conv state of each piece's slot.
absl::Status LaunchDeltaNetConv(const float* in, int64_t in_stride, int rows,
                                const DeltaNetShape& shape, const float* weight,
                                const DeltaNetPieces& pieces, const DeltaNetState& state,
                                float* out, CUstream_st* stream);

// qkv: f32 [rows, conv_dim], the conv's output, normalised in place. b and a: f32 columns of
// `proj` (row stride proj_stride) at b_offset and a_offset, nv each. a_log, dt_bias: f32 [nv].
// g, beta: f32 [rows, nv]. Rows at positions < 0 (padding) are left as they are.
absl::Status LaunchDeltaNetGates(float* qkv, int rows, const DeltaNetShape& shape,
                                 const int32_t* positions, const float* proj, int64_t proj_stride,
                                 int b_offset, int a_offset, const float* a_log,
                                 const float* dt_bias, float* g, float* beta, CUstream_st* stream);

// qkv: f32 [rows, conv_dim] after LaunchDeltaNetGates; g, beta: f32 [rows, nv]; out: f32
// [rows, value_dim]. Reads and then updates the recurrent state of each piece's slot.
absl::Status LaunchDeltaRule(const float* qkv, const float* g, const float* beta, int rows,
                             const DeltaNetShape& shape, const DeltaNetPieces& pieces,
                             const DeltaNetState& state, float* out, CUstream_st* stream);

// core: f32 [rows, nv * dv]; z: f32 columns of `proj` (row stride z_stride) starting at z, nv * dv
// each row; weight: f32 [dv]; out: bf16 [rows, nv * dv].
absl::Status LaunchGatedRmsNorm(const float* core, const float* z, int64_t z_stride, int rows,
                                int num_heads, int head_dim, const float* weight, float eps,
                                uint16_t* out, CUstream_st* stream);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_OPS_DELTA_NET_H_
