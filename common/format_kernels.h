// GPU conversions between float and the scalar codes of formats.h (bf16, fp16, fp8 e4m3 / e5m2,
// fp4 e2m1), computed with CUDA's own types and intrinsics (cuda_bf16.h, cuda_fp16.h, cuda_fp8.h,
// cuda_fp4.h). They are an implementation independent of ours, so the GPU test checks the CPU
// code (formats.h) against NVIDIA's, code by code; they are also the smallest real kernels that
// prove the CUDA build works end to end. Plain C++ header: no CUDA includes.
//
// Semantics (CUDA's): round to nearest even everywhere; bf16 / fp16 / e5m2 overflow to inf
// (e5m2 converted with __NV_NOSAT); e4m3 saturates to +-448 (__NV_SATFINITE); fp4 saturates to
// +-6. These match formats.h. Intentional difference: NaN. CUDA returns canonical NaNs (e.g.
// 0x7FFF for bf16) where formats.h keeps the sign and payload, so NaN results are compared as
// "is a NaN", not bit for bit (fp4 has no NaN: both give +6).
#ifndef MOE_COMMON_FORMAT_KERNELS_H_
#define MOE_COMMON_FORMAT_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace moe::common {

enum class GpuCodeFormat { kBf16, kFp16, kFp8E4M3, kFp8E5M2, kFp4E2M1 };

// Decodes codes[n] (a bf16 / fp16 bit pattern, an fp8 byte or an fp4 nibble in the low bits of
// each element; higher bits must be zero) into out[n], on the GPU. Allocates device memory,
// copies, launches on `stream` (nullptr: the legacy default stream) and synchronizes that stream
// before returning, since the results land in host memory. InvalidArgument if the sizes differ,
// Unavailable without CUDA, Internal for CUDA errors.
absl::Status GpuDecodeToFloat(GpuCodeFormat format, absl::Span<const uint16_t> codes,
                              absl::Span<float> out, CUstream_st* stream);

// Encodes in[n] into codes[n] with CUDA's round-to-nearest-even conversions (see the file
// comment for saturation). Same memory, stream and error behaviour as GpuDecodeToFloat.
absl::Status GpuEncodeFromFloat(GpuCodeFormat format, absl::Span<const float> in,
                                absl::Span<uint16_t> codes, CUstream_st* stream);

}  // namespace moe::common

#endif  // MOE_COMMON_FORMAT_KERNELS_H_
