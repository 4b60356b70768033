// gemm.h without CUDA: Create reports that the build has no GPU code.
#include "engine/cuda/ops/gemm.h"

namespace moe::engine::gpu {

absl::StatusOr<std::unique_ptr<DenseGemm>> DenseGemm::Create(CUstream_st*, uint64_t) {
  return absl::UnavailableError("gemm: built without CUDA");
}

DenseGemm::~DenseGemm() = default;

absl::Status DenseGemm::Run(const GemmArgs&) {
  return absl::UnavailableError("gemm: built without CUDA");
}

}  // namespace moe::engine::gpu
