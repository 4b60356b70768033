#include "graph_capture/capture.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::graph_capture {

namespace {
constexpr char kGuard[] =
    "capture guard: something allocated or synchronised inside the captured decode step "
    "(allocate and synchronise before capture; buffers must not move)";
}  // namespace

#if MOE_HAVE_CUDA

Graph::~Graph() {
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    graph_ = other.graph_;
    other.graph_ = nullptr;
  }
  return *this;
}

namespace {

bool IsCaptureViolation(cudaError_t e) {
  return e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
         e == cudaErrorStreamCaptureImplicit || e == cudaErrorStreamCaptureWrongThread ||
         e == cudaErrorStreamCaptureIsolation;
}

// Allocation nodes come from stream-ordered allocation (cudaMallocAsync) inside the step: legal
// in a graph, but the addresses would belong to the graph and move between instantiations.
absl::Status CheckNoAllocationNodes(cudaGraph_t graph) {
  size_t n = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeMemAlloc || type == cudaGraphNodeTypeMemFree) {
      return absl::FailedPreconditionError(
          absl::StrCat(kGuard, ": the graph holds a stream-ordered allocation or free"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Graph> CaptureGraph(CUstream_st* stream, StepFn step) {
  if (stream == nullptr) {
    return absl::FailedPreconditionError("cannot capture the legacy default stream");
  }
  // Capture is rare (once per bucket): the probe costs nothing that matters, and without a device
  // the caller gets Unavailable rather than an opaque driver error.
  RETURN_IF_ERROR(common::CudaAvailable());
  cudaStreamCaptureStatus before = cudaStreamCaptureStatusNone;
  CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &before));
  if (before != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError("the stream is already capturing");
  }
  // Errors left over from earlier calls must not be blamed on the step.
  cudaGetLastError();
  // Thread-local: this thread's unsafe calls (cudaMalloc, synchronous copies, synchronize) fail
  // and invalidate the capture; other threads (e.g. CPU MoE workers, another engine) are free.
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status step_status = step(stream);
  // A prohibited call's error is also left for cudaGetLastError; read (and clear) it.
  const cudaError_t last = cudaGetLastError();
  cudaStreamCaptureStatus during = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(stream, &during);
  cudaGraph_t raw = nullptr;
  // Always end, so the stream leaves capture mode whatever happened.
  const cudaError_t end = cudaStreamEndCapture(stream, &raw);
  Graph graph(raw);
  cudaGetLastError();
  const bool invalidated = query == cudaSuccess && during == cudaStreamCaptureStatusInvalidated;
  if (invalidated || IsCaptureViolation(last) || IsCaptureViolation(end)) {
    std::string detail;
    if (last != cudaSuccess) absl::StrAppend(&detail, " first error: ", cudaGetErrorName(last));
    if (end != cudaSuccess) absl::StrAppend(&detail, "; end of capture: ", cudaGetErrorName(end));
    if (!step_status.ok()) absl::StrAppend(&detail, "; step: ", step_status.message());
    return absl::FailedPreconditionError(absl::StrCat(kGuard, ";", detail));
  }
  if (!step_status.ok()) return step_status;
  CUDA_RETURN_IF_ERROR(last);
  CUDA_RETURN_IF_ERROR(query);
  CUDA_RETURN_IF_ERROR(end);
  if (graph.get() == nullptr) return absl::InternalError("stream capture produced no graph");
  absl::Status nodes = CheckNoAllocationNodes(graph.get());
  if (!nodes.ok()) return nodes;
  return graph;
}

#else  // !MOE_HAVE_CUDA

Graph::~Graph() = default;

Graph& Graph::operator=(Graph&& other) noexcept {
  graph_ = other.graph_;
  other.graph_ = nullptr;
  return *this;
}

absl::StatusOr<Graph> CaptureGraph(CUstream_st*, StepFn) {
  (void)kGuard;
  return absl::UnavailableError("graph_capture: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::graph_capture
