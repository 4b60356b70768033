// Dense projections of the GPU engine over cuBLAS: y[rows, n] = x[rows, k] . W[n, k]^T (+ bias)
// with bf16 weights (row-major [out, in], as the loader stores them) and bf16 activations,
// f32 accumulation, f32 or bf16 output. Serves the q/k/v/o projections, the router, the shared
// expert and the LM head.
//
// DenseGemm owns one cuBLAS handle bound to one stream and a workspace it gives cuBLAS
// explicitly, so a Run neither allocates nor synchronizes and can be captured in a CUDA graph
// (run each shape once eagerly before capturing it, so cuBLAS has loaded its kernels). Not
// thread-safe: one DenseGemm per stream. Plain C++ header: no CUDA includes; without CUDA,
// Create returns Unavailable.
#ifndef MOE_ENGINE_CUDA_OPS_GEMM_H_
#define MOE_ENGINE_CUDA_OPS_GEMM_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;

namespace moe::engine::gpu {

struct GemmArgs {
  const uint16_t* x = nullptr;  // device bf16 [rows, k]
  const uint16_t* w = nullptr;  // device bf16 [n, k]
  // Optional device f32 [n], added to every row (qwen2_moe's q/k/v biases); f32 output only.
  const float* bias = nullptr;
  void* y = nullptr;  // device [rows, n]: f32, or bf16 when y_bf16
  bool y_bf16 = false;
  // y += x . W^T (f32 output only): the o projection adding into the residual stream.
  bool accumulate = false;
  int rows = 0;
  int n = 0;
  int k = 0;
};

class DenseGemm {
 public:
  // 32 MiB, what cuBLAS recommends for Hopper.
  static constexpr uint64_t kDefaultWorkspaceBytes = 32ull << 20;

  // Creates the handle, binds it to `stream` and allocates the workspace (setup time only).
  // Unavailable without CUDA or a device; Internal on a cuBLAS failure; ResourceExhausted when
  // the workspace cannot be allocated.
  static absl::StatusOr<std::unique_ptr<DenseGemm>> Create(
      CUstream_st* stream, uint64_t workspace_bytes = kDefaultWorkspaceBytes);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;

  // Enqueues y = x . W^T (+ bias, or += when accumulate) on the bound stream: one cuBLAS call
  // and, with a bias, one more kernel. InvalidArgument for bad sizes or a bias/accumulate with
  // bf16 output; Internal on a cuBLAS or launch failure.
  absl::Status Run(const GemmArgs& args);

  CUstream_st* stream() const { return stream_; }

 private:
  DenseGemm() = default;
  CUstream_st* stream_ = nullptr;
  void* handle_ = nullptr;  // cublasHandle_t
  void* workspace_ = nullptr;
  uint64_t workspace_bytes_ = 0;
};

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_OPS_GEMM_H_
