// ensure_experts without CUDA: the same entry points, reporting that the build has no GPU code.
// The CPU mirror (moe_cache/ensure_cpu.h) makes the same decisions on the host.
#include "moe_cache/gpu/ensure_kernels.h"

namespace moe::moe_cache {

absl::StatusOr<std::unique_ptr<DeviceCacheState>> DeviceCacheState::Create(int, int, int,
                                                                          const PolicyParams&) {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

DeviceCacheState::~DeviceCacheState() = default;

absl::Status DeviceCacheState::Upload(const CacheStateView&) {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

absl::Status DeviceCacheState::Download(const CacheStateView&) const {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

absl::Status DeviceCacheState::Reset() {
  return absl::UnavailableError("moe_cache ensure kernels: built without CUDA");
}

absl::Status DeviceCacheState::UploadPinned(const uint8_t*) {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

absl::Status LaunchEnsureExperts(const CacheStateView&, int32_t, const int32_t*, int32_t,
                                 int32_t*, int32_t*, MissPlanEntry*, CUstream_st*, int32_t*,
                                 const int32_t*) {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

absl::Status TakeEnsureError(int32_t*, CUstream_st*) {
  return absl::UnavailableError("ensure_experts: built without CUDA");
}

}  // namespace moe::moe_cache
