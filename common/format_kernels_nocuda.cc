// format_kernels.h without CUDA: every entry point reports Unavailable.
#include "common/format_kernels.h"

namespace moe::common {

absl::Status GpuDecodeToFloat(GpuCodeFormat, absl::Span<const uint16_t>, absl::Span<float>,
                              CUstream_st*) {
  return absl::UnavailableError("built without CUDA");
}

absl::Status GpuEncodeFromFloat(GpuCodeFormat, absl::Span<const float>, absl::Span<uint16_t>,
                                CUstream_st*) {
  return absl::UnavailableError("built without CUDA");
}

}  // namespace moe::common
