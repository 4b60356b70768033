#include "engine/cuda/hybrid/handoff_test_kernels.h"

namespace moe::engine::hybrid {

absl::Status LaunchProduce(const SyntheticStep&, CUstream_st*) {
  return absl::UnavailableError("built without CUDA");
}
absl::Status LaunchCheck(const SyntheticStep&, CUstream_st*) {
  return absl::UnavailableError("built without CUDA");
}

}  // namespace moe::engine::hybrid
