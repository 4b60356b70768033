// copy_missing kernel: see gather_kernels.h.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "moe_cache/gpu/gather_kernels.h"

namespace moe::moe_cache {
namespace {

constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

// Flattened work: chunk j of the plan is (miss m = j / chunks_per_expert, remainder r), and r
// walks the banks in order. Consecutive threads take consecutive 16-byte chunks of one row, so
// each warp moves 512 contiguous bytes. The loads stream (evict-first): the host rows are read
// once; the stores stay in L2 because the routed GEMM reads the slots right after.
__global__ void __launch_bounds__(1024)
    CopyMissingKernel(const __grid_constant__ GatherDescriptor desc, const int32_t* count,
                      const MissPlanEntry* entries) {
  const uint64_t cpe = desc.chunks_per_expert;
  const uint64_t n = static_cast<uint64_t>(max(*count, 0)) * cpe;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < n;
       base += stride * kUnroll) {
    int4 v[kUnroll];
    int4* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = base + u * stride;
      dst[u] = nullptr;
      if (j < n) {
        const uint64_t m = j / cpe;
        uint64_t r = j - m * cpe;
        const MissPlanEntry e = entries[m];
        int b = 0;
        while (r >= desc.banks[b].pitch / 16) {
          r -= desc.banks[b].pitch / 16;
          ++b;
        }
        const GatherBank& bank = desc.banks[b];
        const int4* src =
            reinterpret_cast<const int4*>(bank.src_device + static_cast<uint64_t>(e.expert) * bank.pitch) + r;
        v[u] = __ldcs(src);
        dst[u] = reinterpret_cast<int4*>(bank.dst + static_cast<uint64_t>(e.slot) * bank.pitch) + r;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) *dst[u] = v[u];
    }
  }
}

}  // namespace

absl::Status LaunchCopyMissing(const GatherDescriptor& desc, const int32_t* count,
                               const MissPlanEntry* entries, const GatherLaunchConfig& config,
                               CUstream_st* stream) {
  if (config.blocks <= 0 || config.threads <= 0 || config.threads > 1024 ||
      config.threads % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad gather launch config: ", config.blocks,
                                                   " blocks x ", config.threads, " threads"));
  }
  CopyMissingKernel<<<config.blocks, config.threads, 0, stream>>>(desc, count, entries);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status CopyMissingMemcpy(const GatherDescriptor& desc, const MissPlanEntry* entries, int count,
                               CUstream_st* stream) {
  for (int m = 0; m < count; ++m) {
    for (int b = 0; b < desc.num_banks; ++b) {
      const GatherBank& bank = desc.banks[b];
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          bank.dst + static_cast<uint64_t>(entries[m].slot) * bank.pitch,
          bank.src_host + static_cast<uint64_t>(entries[m].expert) * bank.pitch, bank.pitch,
          cudaMemcpyHostToDevice, stream));
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::moe_cache
