// CUDA runtime errors as absl::Status, and whether a usable GPU exists. The header includes no
// CUDA headers, so CPU-only code (and builds without a toolkit) can use it; error codes travel
// as int (the value of a cudaError_t).
#ifndef MOE_COMMON_CUDA_STATUS_H_
#define MOE_COMMON_CUDA_STATUS_H_

#include "absl/status/status.h"

namespace moe::common {

// OK for 0 (cudaSuccess); ResourceExhausted for cudaErrorMemoryAllocation (2), Internal for any
// other error; the message holds the error's name and description (when built with CUDA), the
// failing expression and file:line.
absl::Status CudaErrorToStatus(int cuda_error, const char* expr, const char* file, int line);

// Number of visible CUDA devices: 0 when built without CUDA, with no driver or no device. Never
// aborts. Clears the sticky "no device" error so later CUDA calls are not poisoned by the probe.
int CudaDeviceCount();

// OK when at least one device is usable; Unavailable("built without CUDA") or
// Unavailable("no CUDA device visible: <reason>") otherwise.
absl::Status CudaAvailable();

}  // namespace moe::common

// Evaluates a CUDA runtime call once and returns its error as a Status from the enclosing
// function (which must return absl::Status or absl::StatusOr<T>).
#define CUDA_RETURN_IF_ERROR(expr)                                                           \
  do {                                                                                       \
    const int moe_cuda_error_ = static_cast<int>(expr);                                      \
    if (moe_cuda_error_ != 0) {                                                              \
      return ::moe::common::CudaErrorToStatus(moe_cuda_error_, #expr, __FILE__, __LINE__);   \
    }                                                                                        \
  } while (0)

#endif  // MOE_COMMON_CUDA_STATUS_H_
