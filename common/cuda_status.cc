#include "common/cuda_status.h"

#include "absl/strings/str_cat.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::common {

absl::Status CudaErrorToStatus(int cuda_error, const char* expr, const char* file, int line) {
  if (cuda_error == 0) return absl::OkStatus();
  // cudaErrorMemoryAllocation (2): out of device or pinned memory, which the caller may report
  // as such (free something, ask for less) rather than as an internal failure.
  const absl::StatusCode code =
      cuda_error == 2 ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
#if MOE_HAVE_CUDA
  const cudaError_t e = static_cast<cudaError_t>(cuda_error);
  return absl::Status(code, absl::StrCat(cudaGetErrorName(e), " (", cuda_error,
                                          "): ", cudaGetErrorString(e), " in ", expr, " at ",
                                          file, ":", line));
#else
  return absl::Status(code,
      absl::StrCat("CUDA error ", cuda_error, " in ", expr, " at ", file, ":", line));
#endif
}

namespace {

#if MOE_HAVE_CUDA
// The probe's own error, kept for CudaAvailable's message.
int ProbeDevices(cudaError_t* error) {
  int count = 0;
  *error = cudaGetDeviceCount(&count);
  if (*error != cudaSuccess) {
    cudaGetLastError();  // clear it: "no device" must not stick to the next unrelated call
    return 0;
  }
  return count;
}
#endif

}  // namespace

int CudaDeviceCount() {
#if MOE_HAVE_CUDA
  cudaError_t error;
  return ProbeDevices(&error);
#else
  return 0;
#endif
}

absl::Status CudaAvailable() {
#if MOE_HAVE_CUDA
  cudaError_t error;
  const int count = ProbeDevices(&error);
  if (error != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no CUDA device visible: ",
                                               cudaGetErrorName(error), ": ",
                                               cudaGetErrorString(error)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device visible: device count is 0");
  return absl::OkStatus();
#else
  return absl::UnavailableError("built without CUDA");
#endif
}

}  // namespace moe::common
