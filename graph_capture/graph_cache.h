// GraphCache: the instantiated decode-step graphs, one per batch bucket (1, 2, 4, 8, 16, ...),
// least recently used first out. A batch runs in the smallest bucket that holds it (the caller
// pads the rest). When the cache is full, the least recently used executable is re-used for the
// new bucket through DecodeGraph::Recapture, so cudaGraphExecUpdate is tried before a new
// instantiation (buckets of one model usually share a topology and differ in parameters).
//
// Ownership: owns its DecodeGraphs; pointers returned by Get() stay valid until that bucket is
// evicted. Not thread-safe: one decode thread owns it.
#ifndef MOE_GRAPH_CAPTURE_GRAPH_CACHE_H_
#define MOE_GRAPH_CAPTURE_GRAPH_CACHE_H_

#include <list>
#include <memory>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "graph_capture/decode_graph.h"

namespace moe::graph_capture {

// Smallest power of two >= batch. InvalidArgument when batch < 1 or the bucket would exceed
// max_bucket (which must itself be a power of two).
absl::StatusOr<int> BucketFor(int batch, int max_bucket);

// Enqueues the decode step of `bucket` rows on `stream` (what gets captured).
using BucketStepFn = absl::FunctionRef<absl::Status(int bucket, CUstream_st* stream)>;

class GraphCache {
 public:
  // capacity: most instantiated graphs kept (>= 1).
  explicit GraphCache(int capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // The graph of `bucket`, captured with step(bucket, stream) if not cached. Marks it most
  // recently used.
  absl::StatusOr<DecodeGraph*> Get(int bucket, CUstream_st* stream, BucketStepFn step);
  // Get() and Launch() in one.
  absl::Status Replay(int bucket, CUstream_st* stream, BucketStepFn step);

  bool Contains(int bucket) const;
  int size() const { return static_cast<int>(entries_.size()); }
  int captures() const { return captures_; }
  // Evictions whose executable was updated in place for the new bucket.
  int updates_in_place() const { return updates_in_place_; }

 private:
  int capacity_;
  // Most recently used first: (bucket, graph).
  std::list<std::pair<int, std::unique_ptr<DecodeGraph>>> entries_;
  int captures_ = 0;
  int updates_in_place_ = 0;
};

}  // namespace moe::graph_capture

#endif  // MOE_GRAPH_CAPTURE_GRAPH_CACHE_H_
