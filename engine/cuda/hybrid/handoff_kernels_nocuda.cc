#include "engine/cuda/hybrid/handoff_kernels.h"

namespace moe::engine::hybrid {

absl::StatusOr<std::unique_ptr<GpuHandoff>> GpuHandoff::Create(const HandoffShape&,
                                                               HandoffCompute) {
  return absl::UnavailableError("hybrid handoff: built without CUDA");
}

GpuHandoff::~GpuHandoff() = default;

absl::Status GpuHandoff::Post(int, int, const int32_t*, const int32_t*, const float*,
                              const float*, CUstream_st*) {
  return absl::UnavailableError("hybrid handoff: built without CUDA");
}

absl::Status GpuHandoff::WaitAndAdd(int, float*, CUstream_st*, bool) {
  return absl::UnavailableError("hybrid handoff: built without CUDA");
}

absl::Status GpuHandoff::TakeError() { return absl::OkStatus(); }

}  // namespace moe::engine::hybrid
