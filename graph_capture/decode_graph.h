// DecodeGraph: one captured decode step (one batch bucket), instantiated, uploaded and replayed.
// Re-capturing tries cudaGraphExecUpdate on the existing executable first (cheap, keeps the
// device-side upload) and instantiates anew only when the topology changed.
//
// StaticBuffer: device memory allocated once, before any capture, whose address never moves; a
// captured graph bakes in the addresses of its inputs and outputs, so the host writes each
// step's inputs into the same StaticBuffer and reads outputs from another.
//
// Ownership: DecodeGraph owns its cudaGraph_t and cudaGraphExec_t; StaticBuffer owns its memory.
// Neither is thread-safe. Plain C++ header; without CUDA the factories return Unavailable.
#ifndef MOE_GRAPH_CAPTURE_DECODE_GRAPH_H_
#define MOE_GRAPH_CAPTURE_DECODE_GRAPH_H_

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "graph_capture/capture.h"

struct CUgraphExec_st;

namespace moe::graph_capture {

class StaticBuffer {
 public:
  // ResourceExhausted when the memory cannot be had; InvalidArgument for 0 bytes.
  static absl::StatusOr<std::unique_ptr<StaticBuffer>> Create(size_t bytes);
  ~StaticBuffer();
  StaticBuffer(const StaticBuffer&) = delete;
  StaticBuffer& operator=(const StaticBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  StaticBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data_;
  size_t bytes_;
};

class DecodeGraph {
 public:
  // Captures `step` on `stream` (see CaptureGraph for the guard's errors), instantiates the graph
  // and uploads it on `stream` so the first replay does not pay for the upload.
  static absl::StatusOr<std::unique_ptr<DecodeGraph>> Create(CUstream_st* stream, StepFn step);
  ~DecodeGraph();
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;

  // Captures `step` again and applies it to the executable: in place through cudaGraphExecUpdate
  // when the topology matches (returns true), else by instantiating anew (returns false). On a
  // capture error the previous executable stays usable.
  absl::StatusOr<bool> Recapture(CUstream_st* stream, StepFn step);

  // Enqueues one replay on `stream`.
  absl::Status Launch(CUstream_st* stream) const;

  // The graph of the last capture, for inspection (cudaGraphGetNodes / cudaGraphGetEdges).
  CUgraph_st* graph() const { return graph_.get(); }
  // Instantiations so far (1 after Create; +1 per Recapture that could not update in place).
  int instantiations() const { return instantiations_; }

 private:
  DecodeGraph() = default;
  absl::Status Instantiate(CUstream_st* stream);

  Graph graph_;
  CUgraphExec_st* exec_ = nullptr;
  int instantiations_ = 0;
};

}  // namespace moe::graph_capture

#endif  // MOE_GRAPH_CAPTURE_DECODE_GRAPH_H_
