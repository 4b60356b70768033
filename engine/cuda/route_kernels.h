// Routing kernels of the GPU model that //engine/cuda/ops does not have: the routing override's
// weights (engine/routing_override.h's ForcedRouteWeights on the device) and the masking of
// padding rows' routes. One launch on a given
// stream; no allocation, no synchronization, a grid that depends only on the sizes (capturable).
// Plain C++ header: no CUDA includes; without CUDA the launch returns Unavailable.
#ifndef MOE_ENGINE_CUDA_ROUTE_KERNELS_H_
#define MOE_ENGINE_CUDA_ROUTE_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;

namespace moe::engine::gpu {

// Per token t: p = softmax(logits[t]) in f32 (as the CPU: exp(l - max) / sum), then
// weights[t, j] = p[ids[t, j]] for ids >= 0 and 0 for padding ids (< 0), divided by their sum
// (summed in j order) when renormalize and the sum is > 0.
// logits: f32 [num_tokens, num_experts]; ids: int32 [num_tokens, top_k], every id below
// num_experts (the caller checks); weights: f32 [num_tokens, top_k].
absl::Status LaunchForcedRouteWeights(const float* logits, int num_tokens, int num_experts,
                                      const int32_t* ids, int top_k, bool renormalize,
                                      float* weights, CUstream_st* stream);

// Padding rows of a batch bucket: ids[t, j] = -1 for every token t whose positions[t] < 0, so
// padding rows route nowhere (no slot, no miss, no expert work). ids: int32 [num_tokens, top_k].
absl::Status LaunchMaskPaddedRoutes(int32_t* ids, const int32_t* positions, int num_tokens,
                                    int top_k, CUstream_st* stream);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_ROUTE_KERNELS_H_
