// Kernels of the Gated DeltaNet token mixer (qwen3_5_moe's linear-attention layers), on the CPU
// in float32, for the tokens of one sequence at a time:
//   - the causal depthwise conv over in_proj_qkv's channels with SiLU, continuing from the
//     sequence's conv state (its last kernel - 1 inputs);
//   - the gated delta rule of one value head, continuing from the sequence's recurrent state
//     S [key_head_dim, value_head_dim]: per token t,
//       S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t,
//     either token by token (DeltaRuleRecurrent: decode) or in transformers' chunked form
//     (DeltaRuleChunked: prefill; per chunk a UT transform by forward substitution, one read and
//     one update of S), which is the same function up to rounding.
// Plain arrays in, arrays out; no state of their own. Thread-safe for distinct outputs.
#ifndef MOE_ENGINE_GATED_DELTA_NET_H_
#define MOE_ENGINE_GATED_DELTA_NET_H_

#include <cstddef>
#include <cstdint>

namespace moe::engine {

// out[t, c] = silu(sum_j weight[j, c] * x[t - (kernel - 1) + j, c]) for t in [0, n), where
// rows before the chunk come from `state` ([kernel - 1, channels], oldest first; zeros at the
// start of a sequence). `state` is then replaced by the chunk's last kernel - 1 inputs (older
// state rows where n < kernel - 1).
//   x: [n, channels] (row stride x_stride), weight: [kernel, channels] (tap-major: the
//   transpose of torch's [channels, 1, kernel]), out: [n, channels].
void CausalConvSilu(const float* x, int64_t x_stride, int n, int channels, int kernel,
                    const float* weight, float* state, float* out);

// One value head of one sequence over n consecutive tokens.
struct DeltaRuleArgs {
  int n = 0;
  int key_dim = 0;    // dk
  int value_dim = 0;  // dv
  // Row t of q, k (dk floats, L2-normalised; q also scaled by dk^-0.5) at t * qk_stride, of v
  // (dv floats) at t * v_stride, g_t (log decay, <= 0) and beta_t at t * gb_stride.
  const float* q = nullptr;
  const float* k = nullptr;
  int64_t qk_stride = 0;
  const float* v = nullptr;
  int64_t v_stride = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  int64_t gb_stride = 0;
  float* state = nullptr;  // [dk, dv], read and updated
  float* out = nullptr;    // row t (dv floats) at t * out_stride
  int64_t out_stride = 0;
};

// `scratch`: value_dim floats.
void DeltaRuleRecurrent(const DeltaRuleArgs& args, float* scratch);

// The chunk length of transformers' torch_chunk_gated_delta_rule.
inline constexpr int kDeltaRuleChunk = 64;

// Floats of scratch DeltaRuleChunked needs for chunks of `chunk` tokens (at least value_dim).
size_t DeltaRuleChunkedScratch(int chunk, int key_dim, int value_dim);
void DeltaRuleChunked(const DeltaRuleArgs& args, int chunk, float* scratch);

}  // namespace moe::engine

#endif  // MOE_ENGINE_GATED_DELTA_NET_H_
