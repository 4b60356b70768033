#include "graph_capture/decode_graph.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::graph_capture {

#if MOE_HAVE_CUDA

absl::StatusOr<std::unique_ptr<StaticBuffer>> StaticBuffer::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("StaticBuffer of 0 bytes");
  RETURN_IF_ERROR(common::CudaAvailable());
  void* data = nullptr;
  const cudaError_t e = cudaMalloc(&data, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", bytes, "-byte static buffer: ", cudaGetErrorName(e)));
  }
  return std::unique_ptr<StaticBuffer>(new StaticBuffer(data, bytes));
}

StaticBuffer::~StaticBuffer() { cudaFree(data_); }

absl::StatusOr<std::unique_ptr<DecodeGraph>> DecodeGraph::Create(CUstream_st* stream,
                                                                StepFn step) {
  std::unique_ptr<DecodeGraph> g(new DecodeGraph());
  ASSIGN_OR_RETURN(g->graph_, CaptureGraph(stream, step));
  RETURN_IF_ERROR(g->Instantiate(stream));
  return g;
}

DecodeGraph::~DecodeGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
}

absl::Status DecodeGraph::Instantiate(CUstream_st* stream) {
  cudaGraphExec_t exec = nullptr;
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph_.get(), 0));
  const cudaError_t up = cudaGraphUpload(exec, stream);
  if (up != cudaSuccess) {
    cudaGraphExecDestroy(exec);
    CUDA_RETURN_IF_ERROR(up);
  }
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  exec_ = exec;
  ++instantiations_;
  return absl::OkStatus();
}

absl::StatusOr<bool> DecodeGraph::Recapture(CUstream_st* stream, StepFn step) {
  ASSIGN_OR_RETURN(Graph fresh, CaptureGraph(stream, step));
  cudaGraphExecUpdateResultInfo info{};
  const cudaError_t e = cudaGraphExecUpdate(exec_, fresh.get(), &info);
  graph_ = std::move(fresh);
  if (e == cudaSuccess) {
    // Updated parameters reach the device with the next launch; upload now to keep replays even.
    CUDA_RETURN_IF_ERROR(cudaGraphUpload(exec_, stream));
    return true;
  }
  // cudaErrorGraphExecUpdateFailure: the topology (or a node kind that cannot change) differs.
  cudaGetLastError();
  if (e != cudaErrorGraphExecUpdateFailure) CUDA_RETURN_IF_ERROR(e);
  RETURN_IF_ERROR(Instantiate(stream));
  return false;
}

absl::Status DecodeGraph::Launch(CUstream_st* stream) const {
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
  return absl::OkStatus();
}

#else  // !MOE_HAVE_CUDA

absl::StatusOr<std::unique_ptr<StaticBuffer>> StaticBuffer::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("StaticBuffer of 0 bytes");
  return absl::UnavailableError("graph_capture: built without CUDA");
}

StaticBuffer::~StaticBuffer() = default;

absl::StatusOr<std::unique_ptr<DecodeGraph>> DecodeGraph::Create(CUstream_st*, StepFn) {
  return absl::UnavailableError("graph_capture: built without CUDA");
}

DecodeGraph::~DecodeGraph() = default;

absl::StatusOr<bool> DecodeGraph::Recapture(CUstream_st*, StepFn) {
  return absl::UnavailableError("graph_capture: built without CUDA");
}

absl::Status DecodeGraph::Launch(CUstream_st*) const {
  return absl::UnavailableError("graph_capture: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::graph_capture
