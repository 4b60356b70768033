// delta_net.h without CUDA: the same entry points, reporting that the build has no GPU code.
#include <string>

#include "engine/cuda/ops/delta_net.h"

namespace moe::engine::gpu {
namespace {
absl::Status NoCuda(const char* what) {
  return absl::UnavailableError(std::string(what) + ": built without CUDA");
}
}  // namespace

absl::Status LaunchDeltaNetConv(const float*, int64_t, int, const DeltaNetShape&, const float*,
                                const DeltaNetPieces&, const DeltaNetState&, float*,
                                CUstream_st*) {
  return NoCuda("delta net conv");
}
absl::Status LaunchDeltaNetGates(float*, int, const DeltaNetShape&, const int32_t*, const float*,
                                 int64_t, int, int, const float*, const float*, float*, float*,
                                 CUstream_st*) {
  return NoCuda("delta net gates");
}
absl::Status LaunchDeltaRule(const float*, const float*, const float*, int, const DeltaNetShape&,
                             const DeltaNetPieces&, const DeltaNetState&, float*, CUstream_st*) {
  return NoCuda("delta rule");
}
absl::Status LaunchGatedRmsNorm(const float*, const float*, int64_t, int, int, int, const float*,
                                float, uint16_t*, CUstream_st*) {
  return NoCuda("gated rms norm");
}

}  // namespace moe::engine::gpu
