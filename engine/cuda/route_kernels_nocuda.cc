// route_kernels.h without CUDA: the same entry point, reporting that the build has no GPU code.
#include "engine/cuda/route_kernels.h"

namespace moe::engine::gpu {

absl::Status LaunchForcedRouteWeights(const float*, int, int, const int32_t*, int, bool, float*,
                                      CUstream_st*) {
  return absl::UnavailableError("forced route weights: built without CUDA");
}

absl::Status LaunchMaskPaddedRoutes(int32_t*, const int32_t*, int, int, CUstream_st*) {
  return absl::UnavailableError("mask padded routes: built without CUDA");
}

}  // namespace moe::engine::gpu
