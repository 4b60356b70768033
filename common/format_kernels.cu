#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/format_kernels.h"

namespace moe::common {
namespace {

__device__ float DecodeOne(GpuCodeFormat format, uint16_t code) {
  switch (format) {
    case GpuCodeFormat::kBf16: {
      __nv_bfloat16_raw r;
      r.x = code;
      return __bfloat162float(__nv_bfloat16(r));
    }
    case GpuCodeFormat::kFp16: {
      __half_raw r;
      r.x = code;
      return __half2float(__half(r));
    }
    case GpuCodeFormat::kFp8E4M3:
      return __half2float(
          __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
    case GpuCodeFormat::kFp8E5M2:
      return __half2float(
          __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E5M2)));
    case GpuCodeFormat::kFp4E2M1:
      return __half2float(
          __half(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(code), __NV_E2M1)));
  }
  return 0.0f;
}

__device__ uint16_t EncodeOne(GpuCodeFormat format, float x) {
  switch (format) {
    case GpuCodeFormat::kBf16:
      return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
    case GpuCodeFormat::kFp16:
      return __half_raw(__float2half_rn(x)).x;
    case GpuCodeFormat::kFp8E4M3:
      return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    case GpuCodeFormat::kFp8E5M2:
      return __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
    case GpuCodeFormat::kFp4E2M1:
      return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
  }
  return 0;
}

// codes [n] -> out [n]; grid-stride loop, so any grid size covers any n.
__global__ void DecodeKernel(GpuCodeFormat format, const uint16_t* __restrict__ codes,
                             float* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = DecodeOne(format, codes[i]);
  }
}

// in [n] -> codes [n].
__global__ void EncodeKernel(GpuCodeFormat format, const float* __restrict__ in,
                             uint16_t* __restrict__ codes, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    codes[i] = EncodeOne(format, in[i]);
  }
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

template <typename T>
absl::Status DeviceAlloc(size_t n, DevicePtr<T>* out) {
  void* p = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&p, n * sizeof(T) + 1));  // +1: n == 0 still gets a pointer
  out->reset(static_cast<T*>(p));
  return absl::OkStatus();
}

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

// Runs kernel(format, in, out, n) on device copies of in / out: the shared host wrapper.
template <typename In, typename Out, typename Kernel>
absl::Status RunOnDevice(Kernel kernel, GpuCodeFormat format, absl::Span<const In> in,
                         absl::Span<Out> out, CUstream_st* stream) {
  if (in.size() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("input has ", in.size(),
                                                   " elements but output has ", out.size()));
  }
  const int64_t n = static_cast<int64_t>(in.size());
  DevicePtr<In> d_in;
  DevicePtr<Out> d_out;
  if (absl::Status s = DeviceAlloc<In>(in.size(), &d_in); !s.ok()) return s;
  if (absl::Status s = DeviceAlloc<Out>(out.size(), &d_out); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in.get(), in.data(), n * sizeof(In),
                                       cudaMemcpyHostToDevice, stream));
  kernel<<<Blocks(n), kThreads, 0, stream>>>(format, d_in.get(), d_out.get(), n);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.data(), d_out.get(), n * sizeof(Out),
                                       cudaMemcpyDeviceToHost, stream));
  // The caller reads `out` on the host as soon as we return; also keeps d_in / d_out alive until
  // the stream is done with them.
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuDecodeToFloat(GpuCodeFormat format, absl::Span<const uint16_t> codes,
                              absl::Span<float> out, CUstream_st* stream) {
  return RunOnDevice(DecodeKernel, format, codes, out, stream);
}

absl::Status GpuEncodeFromFloat(GpuCodeFormat format, absl::Span<const float> in,
                                absl::Span<uint16_t> codes, CUstream_st* stream) {
  return RunOnDevice(EncodeKernel, format, in, codes, stream);
}

}  // namespace moe::common
