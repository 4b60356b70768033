#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/route_kernels.h"

namespace moe::engine::gpu {
namespace {

constexpr int kThreads = 128;

// One block per token: block-wide max and sum of the softmax, then thread 0 gathers the k
// weights in j order.
__global__ void ForcedRouteWeightsKernel(const float* __restrict__ logits, int num_experts,
                                         const int32_t* __restrict__ ids, int top_k,
                                         bool renormalize, float* __restrict__ weights) {
  __shared__ float red[kThreads];
  const int t = blockIdx.x;
  const float* l = logits + static_cast<int64_t>(t) * num_experts;
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += kThreads) mx = fmaxf(mx, l[e]);
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();
  float sum = 0.0f;
  for (int e = threadIdx.x; e < num_experts; e += kThreads) sum += expf(l[e] - mx);
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  sum = red[0];
  const int32_t* id = ids + static_cast<int64_t>(t) * top_k;
  float* w = weights + static_cast<int64_t>(t) * top_k;
  float wsum = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    w[j] = id[j] < 0 || id[j] >= num_experts ? 0.0f : expf(l[id[j]] - mx) / sum;
    wsum += w[j];
  }
  if (renormalize && wsum > 0.0f) {
    for (int j = 0; j < top_k; ++j) w[j] /= wsum;
  }
}

__global__ void MaskPaddedRoutesKernel(int32_t* __restrict__ ids,
                                       const int32_t* __restrict__ positions, int num_ids,
                                       int top_k) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_ids && positions[i / top_k] < 0) ids[i] = -1;
}

}  // namespace

absl::Status LaunchMaskPaddedRoutes(int32_t* ids, const int32_t* positions, int num_tokens,
                                    int top_k, CUstream_st* stream) {
  if (num_tokens < 0 || top_k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask padded routes: tokens ", num_tokens, ", k ", top_k));
  }
  if (num_tokens == 0) return absl::OkStatus();
  const int n = num_tokens * top_k;
  MaskPaddedRoutesKernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, positions, n, top_k);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("MaskPaddedRoutesKernel launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::Status LaunchForcedRouteWeights(const float* logits, int num_tokens, int num_experts,
                                      const int32_t* ids, int top_k, bool renormalize,
                                      float* weights, CUstream_st* stream) {
  if (num_tokens < 0 || num_experts <= 0 || top_k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("forced route weights: tokens ", num_tokens,
                                                   ", experts ", num_experts, ", k ", top_k));
  }
  if (num_tokens == 0) return absl::OkStatus();
  ForcedRouteWeightsKernel<<<num_tokens, kThreads, 0, stream>>>(logits, num_experts, ids, top_k,
                                                                renormalize, weights);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("ForcedRouteWeightsKernel launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace moe::engine::gpu
