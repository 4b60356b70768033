#include "engine/cuda/ops/gemm.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/cuda/ops/token_ops.h"

namespace moe::engine::gpu {
namespace {

#define BLAS_RETURN_IF_ERROR(expr)                                                        \
  do {                                                                                    \
    const cublasStatus_t moe_blas_status_ = (expr);                                       \
    if (moe_blas_status_ != CUBLAS_STATUS_SUCCESS) {                                      \
      return absl::InternalError(                                                         \
          absl::StrCat("cuBLAS ", cublasGetStatusName(moe_blas_status_), " in ", #expr)); \
    }                                                                                     \
  } while (0)

cublasHandle_t Handle(void* h) { return static_cast<cublasHandle_t>(h); }

}  // namespace

absl::StatusOr<std::unique_ptr<DenseGemm>> DenseGemm::Create(CUstream_st* stream,
                                                             uint64_t workspace_bytes) {
  RETURN_IF_ERROR(common::CudaAvailable());
  std::unique_ptr<DenseGemm> g(new DenseGemm());
  g->stream_ = stream;
  cublasHandle_t handle = nullptr;
  BLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  g->handle_ = handle;
  if (workspace_bytes > 0) {
    if (cudaMalloc(&g->workspace_, workspace_bytes) != cudaSuccess) {
      cudaGetLastError();
      g->workspace_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("gemm: cudaMalloc of a ", workspace_bytes, "-byte workspace failed"));
    }
  }
  g->workspace_bytes_ = workspace_bytes;
  // cublasSetStream resets the workspace to cuBLAS's own, so ours is set after it: cuBLAS then
  // has no reason to allocate, which it must not do inside a capture.
  BLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  BLAS_RETURN_IF_ERROR(cublasSetWorkspace(handle, g->workspace_, workspace_bytes));
  BLAS_RETURN_IF_ERROR(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  return g;
}

DenseGemm::~DenseGemm() {
  if (handle_ != nullptr) cublasDestroy(Handle(handle_));
  if (workspace_ != nullptr) cudaFree(workspace_);
}

absl::Status DenseGemm::Run(const GemmArgs& a) {
  if (a.rows < 0 || a.n <= 0 || a.k <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: rows ", a.rows, ", n ", a.n, ", k ", a.k));
  }
  if (a.y_bf16 && (a.bias != nullptr || a.accumulate)) {
    return absl::InvalidArgumentError("gemm: bias and accumulate need f32 output");
  }
  if (a.rows == 0) return absl::OkStatus();
  if (a.x == nullptr || a.w == nullptr || a.y == nullptr) {
    return absl::InvalidArgumentError("gemm: x, w and y must be set");
  }
  // Row-major y[rows, n] = x[rows, k] . W[n, k]^T is column-major y^T (n x rows) = W^T x^T,
  // where W read column-major is k x n (lda k) and transposed, x^T is k x rows (ldb k).
  const float alpha = 1.0f;
  const float beta = a.accumulate ? 1.0f : 0.0f;
  BLAS_RETURN_IF_ERROR(cublasGemmEx(Handle(handle_), CUBLAS_OP_T, CUBLAS_OP_N, a.n, a.rows, a.k,
                                    &alpha, a.w, CUDA_R_16BF, a.k, a.x, CUDA_R_16BF, a.k, &beta,
                                    a.y, a.y_bf16 ? CUDA_R_16BF : CUDA_R_32F, a.n,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (a.bias != nullptr) {
    RETURN_IF_ERROR(LaunchAddBias(static_cast<float*>(a.y), a.rows, a.n, a.bias, stream_));
  }
  return absl::OkStatus();
}

}  // namespace moe::engine::gpu
