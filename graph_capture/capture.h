// Stream capture of one decode step, with the guard: capture runs in thread-local mode, so this
// thread may not allocate or synchronise while it captures (the call fails and invalidates the
// capture), and the guard turns every symptom of that (the step's own error, an invalidated
// capture, an allocation node in the graph) into one clear FailedPrecondition instead of a
// graph whose buffer addresses moved or a half-captured step. The capture is always ended, so
// a failed capture leaves the stream usable.
//
// Graph: owns one cudaGraph_t (movable, not copyable, not thread-safe).
// Plain C++ header (no CUDA includes); without CUDA, CaptureGraph returns Unavailable.
#ifndef MOE_GRAPH_CAPTURE_CAPTURE_H_
#define MOE_GRAPH_CAPTURE_CAPTURE_H_

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
struct CUgraph_st;

namespace moe::graph_capture {

// Enqueues one whole step on `stream` (and on streams it forks from it, which must join back).
using StepFn = absl::FunctionRef<absl::Status(CUstream_st* stream)>;

class Graph {
 public:
  Graph() = default;
  explicit Graph(CUgraph_st* graph) : graph_(graph) {}
  ~Graph();
  Graph(Graph&& other) noexcept : graph_(other.graph_) { other.graph_ = nullptr; }
  Graph& operator=(Graph&& other) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  CUgraph_st* get() const { return graph_; }

 private:
  CUgraph_st* graph_ = nullptr;
};

// Captures `step(stream)` into a graph. Errors:
//  - FailedPrecondition "capture guard: ..." when something allocated or synchronised inside the
//    capture (or the capture was otherwise invalidated), or the graph holds allocation nodes;
//  - FailedPrecondition when `stream` is null (the legacy stream cannot be captured) or is
//    already capturing;
//  - the step's own error otherwise (the capture is ended and discarded).
absl::StatusOr<Graph> CaptureGraph(CUstream_st* stream, StepFn step);

}  // namespace moe::graph_capture

#endif  // MOE_GRAPH_CAPTURE_CAPTURE_H_
