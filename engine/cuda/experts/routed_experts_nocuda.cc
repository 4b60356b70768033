// Routed experts without CUDA: the same entry points, reporting that the build has no GPU code.
// cpu_moe computes the same experts on the host.
#include "engine/cuda/experts/routed_experts.h"

namespace moe::engine::gpu {

absl::StatusOr<std::unique_ptr<ExpertWorkspace>> ExpertWorkspace::Create(
    const ExpertWorkspaceOptions&) {
  return absl::UnavailableError("routed experts on the GPU: built without CUDA");
}

ExpertWorkspace::~ExpertWorkspace() = default;

absl::Status LaunchRoutedExperts(const SlotBanks&, ExpertWorkspace&, int, const float*,
                                 const int32_t*, const float*, float*, CUstream_st*,
                                 RouteGrouping) {
  return absl::UnavailableError("routed experts on the GPU: built without CUDA");
}

}  // namespace moe::engine::gpu
