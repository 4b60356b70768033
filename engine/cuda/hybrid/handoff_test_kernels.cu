#include "engine/cuda/hybrid/handoff_test_kernels.h"

#include <cuda_runtime.h>

#include "common/cuda_status.h"
#include "moe_cache/policy_core.h"

namespace moe::engine::hybrid {
namespace {

__global__ void ProduceKernel(SyntheticStep s) {
  __shared__ uint32_t step;
  if (threadIdx.x == 0) step = ++*s.step;
  __syncthreads();
  const int routes = s.rows * s.top_k;
  for (int i = threadIdx.x; i < routes; i += blockDim.x) {
    s.ids[i] = static_cast<int32_t>((step * 7u + i * 13u) % 64u);
    s.slot_ids[i] = (step + i) % s.cpu_every == 0 ? moe_cache::kCpuSlot : i;
    s.weights[i] = 0.25f * static_cast<float>((step + i) % 4u + 1u);
  }
  const int n = s.rows * s.hidden;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int t = i / s.hidden, c = i % s.hidden;
    s.x[i] = static_cast<float>(step % 1024u) + static_cast<float>(t) + 0.5f * (c % 16);
    s.y[i] = 0.0f;
  }
}

__global__ void CheckKernel(SyntheticStep s) {
  const int t = blockIdx.x;
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int c = threadIdx.x; c < s.hidden; c += blockDim.x) {
    float want = 0.0f;
    for (int j = 0; j < s.top_k; ++j) {
      const int i = t * s.top_k + j;
      if (s.slot_ids[i] != moe_cache::kCpuSlot) continue;
      want = __fadd_rn(want, __fmul_rn(s.weights[i], __fadd_rn(s.x[t * s.hidden + c],
                                                               static_cast<float>(s.ids[i]))));
    }
    if (s.y[t * s.hidden + c] != want) bad = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0 && bad) atomicAdd(s.mismatches, 1u);
}

}  // namespace

absl::Status LaunchProduce(const SyntheticStep& s, CUstream_st* stream) {
  ProduceKernel<<<1, 256, 0, stream>>>(s);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status LaunchCheck(const SyntheticStep& s, CUstream_st* stream) {
  CheckKernel<<<s.rows, 256, 0, stream>>>(s);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace moe::engine::hybrid
