#include "engine/cuda/link_probe.h"

#include <algorithm>

#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::engine::gpu {

#if MOE_HAVE_CUDA

absl::StatusOr<LinkBandwidth> MeasureLinkBandwidth(uint64_t bytes, int reps) {
  RETURN_IF_ERROR(common::CudaAvailable());
  bytes = std::max<uint64_t>(bytes / 16 * 16, 16);
  reps = std::max(reps, 1);
  void *host = nullptr, *a = nullptr, *b = nullptr;
  cudaStream_t s = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  auto cleanup = [&] {
    if (s != nullptr) cudaStreamSynchronize(s);
    if (host != nullptr) cudaFreeHost(host);
    if (a != nullptr) cudaFree(a);
    if (b != nullptr) cudaFree(b);
    if (e0 != nullptr) cudaEventDestroy(e0);
    if (e1 != nullptr) cudaEventDestroy(e1);
    if (s != nullptr) cudaStreamDestroy(s);
  };
  auto run = [&]() -> absl::StatusOr<LinkBandwidth> {
    CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    CUDA_RETURN_IF_ERROR(cudaMalloc(&a, bytes));
    CUDA_RETURN_IF_ERROR(cudaMalloc(&b, bytes));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(cudaEventCreate(&e0));
    CUDA_RETURN_IF_ERROR(cudaEventCreate(&e1));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a, 1, bytes, s));
    std::fill_n(static_cast<uint8_t*>(host), bytes, uint8_t{1});
    LinkBandwidth bw;
    for (int kind = 0; kind < 2; ++kind) {
      float best_ms = 0;
      for (int r = 0; r <= reps; ++r) {  // the first repetition warms up
        CUDA_RETURN_IF_ERROR(cudaEventRecord(e0, s));
        if (kind == 0) {
          CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b, host, bytes, cudaMemcpyHostToDevice, s));
        } else {
          CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
        }
        CUDA_RETURN_IF_ERROR(cudaEventRecord(e1, s));
        CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
      }
      const double gbps = static_cast<double>(bytes) / (best_ms * 1e-3) / 1e9;
      if (kind == 0) {
        bw.host_to_device_gbps = gbps;
      } else {
        bw.device_gbps = 2 * gbps;
      }
    }
    return bw;
  };
  auto result = run();
  cleanup();
  return result;
}

#else  // !MOE_HAVE_CUDA

absl::StatusOr<LinkBandwidth> MeasureLinkBandwidth(uint64_t, int) {
  return absl::UnavailableError("link probe: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::engine::gpu
