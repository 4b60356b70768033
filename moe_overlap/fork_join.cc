#include "moe_overlap/fork_join.h"

#include "common/cuda_status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <vector>
#endif

// MOE_OVERLAP_TESTONLY_SKIP_JOIN builds the negative control of //tests/overlap: the same scope
// without the compute stream's wait on `done`. It exists so a test can prove the join is what
// keeps the routed GEMM from reading slots that copy_missing has not filled yet. Never defined
// outside the testonly target :fork_join_without_join.

namespace moe::moe_overlap {


#if MOE_HAVE_CUDA

namespace {

void Keep(absl::Status* first, const absl::Status& next) {
  if (first->ok() && !next.ok()) *first = next;
}

}  // namespace

ForkJoinScope::ForkJoinScope(const StreamPair& pair) : pair_(pair) {
  if (!pair_.options().overlap) return;
  absl::Status s = [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(pair_.ready(), pair_.compute()));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(pair_.side(), pair_.ready(), 0));
#ifndef MOE_OVERLAP_TESTONLY_SKIP_JOIN
    // Under capture a wait adds the event's nodes to the side stream's dependencies, so the side
    // branch would also hang off the previous layer's copy: an edge the join already implies
    // (that copy precedes this fork on the compute stream). Set the side stream's dependencies
    // to the fork point alone, so the graph holds exactly one fork edge per layer.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t num_deps = 0;
    CUDA_RETURN_IF_ERROR(cudaStreamGetCaptureInfo(pair_.compute(), &capture, nullptr, nullptr,
                                                  &deps, &edges, &num_deps));
    if (capture == cudaStreamCaptureStatusActive) {
      std::vector<cudaGraphNode_t> fork(deps, deps + num_deps);
      std::vector<cudaGraphEdgeData> fork_edges;
      if (edges != nullptr) fork_edges.assign(edges, edges + num_deps);
      CUDA_RETURN_IF_ERROR(cudaStreamUpdateCaptureDependencies(
          pair_.side(), fork.data(), fork_edges.empty() ? nullptr : fork_edges.data(),
          fork.size(), cudaStreamSetCaptureDependencies));
    }
#endif
    return absl::OkStatus();
  }();
  // If the record failed the side stream never joined: nothing to join, branches run serially.
  forked_ = s.ok();
  Keep(&status_, s);
}

ForkJoinScope::~ForkJoinScope() { Join().IgnoreError(); }

absl::Status ForkJoinScope::Side(BranchFn fn) {
  if (side_called_ || joined_) {
    Keep(&status_, absl::FailedPreconditionError("ForkJoinScope::Side called twice or after Join"));
    return status_;
  }
  side_called_ = true;
  if (!forked_) {
    // Overlap off (or the fork failed): the serial order, copy before the shared expert.
    absl::Status s = status_.ok() ? fn(pair_.compute()) : status_;
    Keep(&status_, s);
    return status_;
  }
  Keep(&status_, fn(pair_.side()));
  const int e = static_cast<int>(cudaEventRecord(pair_.done(), pair_.side()));
  done_recorded_ = e == 0;
  Keep(&status_, common::CudaErrorToStatus(e, "cudaEventRecord(done, side)", __FILE__, __LINE__));
  return status_;
}

absl::Status ForkJoinScope::Compute(BranchFn fn) {
  if (joined_) {
    Keep(&status_, absl::FailedPreconditionError("ForkJoinScope::Compute called after Join"));
    return status_;
  }
  // After an error nothing more is enqueued; the join still runs.
  if (status_.ok()) Keep(&status_, fn(pair_.compute()));
  return status_;
}

absl::Status ForkJoinScope::Join() {
  if (joined_) return status_;
  joined_ = true;
  if (!forked_) return status_;
  if (!done_recorded_) {
    // Side() was never called (or its record failed): the side stream waited on `ready` and
    // nothing else, so record `done` now to give the join this layer's event.
    const int e = static_cast<int>(cudaEventRecord(pair_.done(), pair_.side()));
    Keep(&status_, common::CudaErrorToStatus(e, "cudaEventRecord(done, side)", __FILE__, __LINE__));
    if (e != 0) return status_;
  }
#ifndef MOE_OVERLAP_TESTONLY_SKIP_JOIN
  const int e = static_cast<int>(cudaStreamWaitEvent(pair_.compute(), pair_.done(), 0));
  Keep(&status_, common::CudaErrorToStatus(e, "cudaStreamWaitEvent(compute, done)", __FILE__,
                                           __LINE__));
#endif
  return status_;
}

#else  // !MOE_HAVE_CUDA

ForkJoinScope::ForkJoinScope(const StreamPair& pair)
    : pair_(pair), status_(absl::UnavailableError("moe_overlap: built without CUDA")) {}

ForkJoinScope::~ForkJoinScope() = default;

absl::Status ForkJoinScope::Side(BranchFn) { return status_; }
absl::Status ForkJoinScope::Compute(BranchFn) { return status_; }
absl::Status ForkJoinScope::Join() {
  joined_ = true;
  return status_;
}

#endif  // MOE_HAVE_CUDA

absl::Status RunForkJoin(const StreamPair& pair, BranchFn side, BranchFn compute) {
  ForkJoinScope scope(pair);
  scope.Side(side).IgnoreError();        // the scope keeps the first error,
  scope.Compute(compute).IgnoreError();  // skips branches after one,
  return scope.Join();                   // and joins regardless.
}

}  // namespace moe::moe_overlap
