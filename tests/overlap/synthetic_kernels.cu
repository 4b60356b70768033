// Kernels of the synthetic MoE stack: see synthetic_kernels.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/cuda_status.h"
#include "tests/overlap/synthetic_kernels.h"

namespace moe::overlap_test {
namespace {

__device__ __forceinline__ float Bf16ToFloat(uint16_t v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}

__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<const uint16_t*>(&b);
}

__global__ void EmbedKernel(const int32_t* tokens, const uint16_t* table, int vocab, int hidden,
                            uint16_t* x, float* h) {
  const int t = blockIdx.x;
  int tok = tokens[t] % vocab;
  if (tok < 0) tok += vocab;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const uint16_t v = table[static_cast<int64_t>(tok) * hidden + i];
    x[static_cast<int64_t>(t) * hidden + i] = v;
    h[static_cast<int64_t>(t) * hidden + i] = Bf16ToFloat(v);
  }
}

// One block of 256 threads per token: k rounds of a block-wide argmax over the logits.
__global__ void TopKKernel(const float* logits, int experts, int k, int32_t* ids,
                           float* weights) {
  __shared__ float vals[kMaxRoutedExperts];
  __shared__ float best_v[256];
  __shared__ int best_i[256];
  __shared__ float chosen[kMaxTopK];
  const int t = blockIdx.x;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    vals[e] = logits[static_cast<int64_t>(t) * experts + e];
  }
  __syncthreads();
  for (int j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int bi = -1;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float v = vals[e];
      if (bi < 0 || v > bv) {  // e increases within a thread: ties keep the lower index
        bv = v;
        bi = e;
      }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) {
        const float ov = best_v[threadIdx.x + s];
        const int oi = best_i[threadIdx.x + s];
        const float mv = best_v[threadIdx.x];
        const int mi = best_i[threadIdx.x];
        if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
          best_v[threadIdx.x] = ov;
          best_i[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      ids[t * k + j] = best_i[0];
      chosen[j] = best_v[0];
      vals[best_i[0]] = -INFINITY;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    // Softmax over the chosen logits, in a fixed order.
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += expf(chosen[j] - chosen[0]);
    for (int j = 0; j < k; ++j) weights[t * k + j] = expf(chosen[j] - chosen[0]) / sum;
  }
}

__global__ void SiluMulKernel(const uint16_t* gate_up, int inter, uint16_t* act) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = Bf16ToFloat(gate_up[static_cast<int64_t>(t) * 2 * inter + i]);
    const float u = Bf16ToFloat(gate_up[static_cast<int64_t>(t) * 2 * inter + inter + i]);
    act[static_cast<int64_t>(t) * inter + i] = FloatToBf16(g / (1.f + expf(-g)) * u);
  }
}

// grid (routes, kChecksumSplit), 256 threads. Each split takes a contiguous share of every bank's
// words; integer sums are exact, so the result does not depend on the order of additions.
__global__ void ChecksumKernel(const __grid_constant__ moe_cache::GatherDescriptor desc,
                               const int32_t* slot_ids, uint32_t* partials) {
  __shared__ uint32_t warp_sums[8];
  const int r = blockIdx.x;
  const int split = blockIdx.y;
  const int32_t slot = slot_ids[r];
  uint32_t acc = 0;
  if (slot >= 0) {
    for (int b = 0; b < desc.num_banks; ++b) {
      const moe_cache::GatherBank& bank = desc.banks[b];
      const uint64_t words = bank.pitch / 4;
      const uint64_t share = (words + kChecksumSplit - 1) / kChecksumSplit;
      const uint64_t begin = share * split;
      const uint64_t end = min(words, begin + share);
      const uint32_t* row =
          reinterpret_cast<const uint32_t*>(bank.dst + static_cast<uint64_t>(slot) * bank.pitch);
      for (uint64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        acc += __ldcg(row + i) * static_cast<uint32_t>(2 * i + 1);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += warp_sums[w];
    partials[r * kChecksumSplit + split] = total;
  }
}

__device__ __forceinline__ float Mix(uint32_t checksum, int i) {
  uint32_t v = checksum ^ (static_cast<uint32_t>(i) * 0x9E3779B9u);
  v ^= v >> 15;
  v *= 0x2C1B3C6Du;
  v ^= v >> 12;
  return (static_cast<float>(v >> 8) * (1.f / 16777216.f) - 0.5f) * 0.25f;
}

__global__ void CombineKernel(const uint32_t* partials, const float* weights,
                              const uint16_t* shared, int k, int hidden, uint32_t* checksums,
                              float* h, uint16_t* x) {
  __shared__ uint32_t sums[kMaxTopK];
  __shared__ float w[kMaxTopK];
  const int t = blockIdx.x;
  if (threadIdx.x < k) {
    uint32_t s = 0;
    for (int p = 0; p < kChecksumSplit; ++p) s += partials[(t * k + threadIdx.x) * kChecksumSplit + p];
    sums[threadIdx.x] = s;
    w[threadIdx.x] = weights[t * k + threadIdx.x];
    checksums[t * k + threadIdx.x] = s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const int64_t at = static_cast<int64_t>(t) * hidden + i;
    float routed = 0.f;
    for (int j = 0; j < k; ++j) routed += w[j] * Mix(sums[j], i);
    const float v = 0.5f * h[at] + Bf16ToFloat(shared[at]) + routed;
    h[at] = v;
    x[at] = FloatToBf16(v);
  }
}

absl::Status LastError() {
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchEmbed(const int32_t* tokens, const uint16_t* table, int vocab, int tokens_n,
                         int hidden, uint16_t* x, float* h, CUstream_st* stream) {
  if (tokens_n <= 0 || vocab <= 0) return absl::InvalidArgumentError("embed: empty");
  EmbedKernel<<<tokens_n, 256, 0, stream>>>(tokens, table, vocab, hidden, x, h);
  return LastError();
}

absl::Status LaunchTopK(const float* logits, int tokens_n, int experts, int k, int32_t* ids,
                        float* weights, CUstream_st* stream) {
  if (experts > kMaxRoutedExperts || k > kMaxTopK || k > experts || k <= 0 || tokens_n <= 0) {
    return absl::InvalidArgumentError("top-k: unsupported shape");
  }
  TopKKernel<<<tokens_n, 256, 0, stream>>>(logits, experts, k, ids, weights);
  return LastError();
}

absl::Status LaunchSiluMul(const uint16_t* gate_up, int tokens_n, int inter, uint16_t* act,
                           CUstream_st* stream) {
  SiluMulKernel<<<tokens_n, 256, 0, stream>>>(gate_up, inter, act);
  return LastError();
}

absl::Status LaunchChecksum(const moe_cache::GatherDescriptor& desc, const int32_t* slot_ids,
                            int routes, uint32_t* partials, CUstream_st* stream) {
  if (routes <= 0) return absl::InvalidArgumentError("checksum: no routes");
  ChecksumKernel<<<dim3(routes, kChecksumSplit), 256, 0, stream>>>(desc, slot_ids, partials);
  return LastError();
}

absl::Status LaunchCombine(const uint32_t* partials, const float* weights,
                           const uint16_t* shared, int tokens_n, int k, int hidden,
                           uint32_t* checksums, float* h, uint16_t* x, CUstream_st* stream) {
  if (k > kMaxTopK || k > 256) return absl::InvalidArgumentError("combine: k too large");
  CombineKernel<<<tokens_n, 256, 0, stream>>>(partials, weights, shared, k, hidden, checksums, h,
                                              x);
  return LastError();
}

}  // namespace moe::overlap_test
