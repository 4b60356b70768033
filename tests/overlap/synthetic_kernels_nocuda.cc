// The synthetic stack's kernels without CUDA: the same entry points, reporting no GPU code.
#include "tests/overlap/synthetic_kernels.h"

namespace moe::overlap_test {
namespace {
absl::Status NoCuda() { return absl::UnavailableError("synthetic kernels: built without CUDA"); }
}  // namespace

absl::Status LaunchEmbed(const int32_t*, const uint16_t*, int, int, int, uint16_t*, float*,
                         CUstream_st*) {
  return NoCuda();
}
absl::Status LaunchTopK(const float*, int, int, int, int32_t*, float*, CUstream_st*) {
  return NoCuda();
}
absl::Status LaunchSiluMul(const uint16_t*, int, int, uint16_t*, CUstream_st*) { return NoCuda(); }
absl::Status LaunchChecksum(const moe_cache::GatherDescriptor&, const int32_t*, int, uint32_t*,
                            CUstream_st*) {
  return NoCuda();
}
absl::Status LaunchCombine(const uint32_t*, const float*, const uint16_t*, int, int, int,
                           uint32_t*, float*, uint16_t*, CUstream_st*) {
  return NoCuda();
}

}  // namespace moe::overlap_test
