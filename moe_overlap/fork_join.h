// ForkJoinScope: one MoE layer's overlap of the routed-expert miss copy (side stream) with the
// shared expert (compute stream). The stream ordering is the feature:
//
//   compute: ... ensure_experts (single writer of slot map + miss plan) -> record(ready) ->
//            shared expert -> wait(done) -> routed GEMM ...
//   side:    wait(ready) -> copy_missing -> record(done)
//
// so copy_missing reads the miss plan only after ensure_experts wrote it, and the routed GEMM
// reads the slots only after copy_missing filled them. The host enqueues in that order: the
// fork in the constructor, then Side(), then Compute(); the join (compute waits on done) runs in
// Join() or, at the latest, in the destructor, so every path joins, errors included. Under graph
// capture the same calls record a fork and a join inside the graph, giving it two branches per
// layer; a missing join would leave the side stream unjoined and EndCapture would fail.
//
// With the overlap switched off (OverlapOptions::overlap == false) there are no events: Side()
// and Compute() both run on the compute stream, in that order (the serial reference).
//
// Usage (copy_missing and the shared expert are the caller's; this package knows nothing of them):
//   {
//     ForkJoinScope scope(pair);
//     RETURN_IF_ERROR(scope.Side([&](CUstream_st* s) { return LaunchCopyMissing(..., s); }));
//     RETURN_IF_ERROR(scope.Compute([&](CUstream_st* s) { return SharedExpert(..., s); }));
//     RETURN_IF_ERROR(scope.Join());
//   }
//
// Ownership: the scope borrows the StreamPair (which must outlive it). Not thread-safe: one host
// thread enqueues a layer. Not copyable or movable (the join belongs to this frame).
#ifndef MOE_MOE_OVERLAP_FORK_JOIN_H_
#define MOE_MOE_OVERLAP_FORK_JOIN_H_

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "moe_overlap/stream_pair.h"

namespace moe::moe_overlap {

// A branch: enqueues work on the stream it is given and returns launch errors.
using BranchFn = absl::FunctionRef<absl::Status(CUstream_st* stream)>;

class ForkJoinScope {
 public:
  // Forks: records `ready` on the compute stream and makes the side stream wait on it.
  explicit ForkJoinScope(const StreamPair& pair);
  // Joins if Join() was not called (its error cannot be returned from here; call Join()).
  ~ForkJoinScope();
  ForkJoinScope(const ForkJoinScope&) = delete;
  ForkJoinScope& operator=(const ForkJoinScope&) = delete;

  // Whether the layer really forks (overlap on and the fork succeeded).
  bool forked() const { return forked_; }

  // Enqueues the side branch (copy_missing) and then records `done` on the side stream, even when
  // `fn` fails (the join must have this layer's event to wait on). At most once per scope, before
  // Compute(). Returns the fork's error, `fn`'s error, or the record's.
  absl::Status Side(BranchFn fn);
  // Enqueues the compute branch (the shared expert) on the compute stream.
  absl::Status Compute(BranchFn fn);
  // Compute stream waits on `done`. Idempotent; returns the first error of the scope.
  absl::Status Join();

 private:
  const StreamPair& pair_;
  absl::Status status_;      // first error seen (fork, branches, join)
  bool forked_ = false;      // ready recorded and waited on by the side stream
  bool done_recorded_ = false;
  bool side_called_ = false;
  bool joined_ = false;
};

// One whole fork/join: the scope, Side(side), Compute(compute), Join().
absl::Status RunForkJoin(const StreamPair& pair, BranchFn side, BranchFn compute);

}  // namespace moe::moe_overlap

#endif  // MOE_MOE_OVERLAP_FORK_JOIN_H_
