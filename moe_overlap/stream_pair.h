// StreamPair: the compute stream, the side stream and the two events ("ready": compute -> side,
// "done": side -> compute) that one MoE layer's fork/join uses. Everything is created when the
// pair is built, before any graph capture: creating a stream or an event inside a capture is
// either refused or silently puts the object outside the graph.
//
// OverlapOptions carries the A/B switch (MOE_DECODE_SHARED_OVERLAP=0|1, read only when options
// are built) and the side-stream priority setting.
//
// Ownership: the pair owns the streams it created and both events; a stream passed in by the
// caller stays the caller's (it must outlive the pair). Thread-compatible: the pair is read-only
// after construction, but the streams themselves are used by one host thread at a time.
// Plain C++ header (no CUDA includes); without CUDA, Create() returns Unavailable.
#ifndef MOE_MOE_OVERLAP_STREAM_PAIR_H_
#define MOE_MOE_OVERLAP_STREAM_PAIR_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
struct CUevent_st;

namespace moe::moe_overlap {

// Name of the environment switch that turns the overlap on (1) or off (0) for A/B runs.
inline constexpr char kOverlapEnvVar[] = "MOE_DECODE_SHARED_OVERLAP";

struct OverlapOptions {
  // Run copy_missing on the side stream beside the shared expert. Off: both branches run on the
  // compute stream in order (copy, then shared expert), with no events.
  bool overlap = true;
  // Give the side stream the device's highest priority. Off by default: the measurement this
  // feature comes from found high priority 0.5-2% slower per decode step.
  bool side_high_priority = false;
};

// `base` with the switch applied: nullptr or "" leaves it; "0" / "1" set `overlap`; anything else
// is InvalidArgument (a typo must not silently run the other arm of an A/B comparison).
absl::StatusOr<OverlapOptions> ApplyOverlapSwitch(OverlapOptions base, const char* value);

// `base` with MOE_DECODE_SHARED_OVERLAP from the environment applied (see ApplyOverlapSwitch).
// Read once here, when options are built, never in the decode loop.
absl::StatusOr<OverlapOptions> OverlapOptionsFromEnv(OverlapOptions base = {});

class StreamPair {
 public:
  // Creates both streams (non-blocking) and both events (timing disabled).
  static absl::StatusOr<std::unique_ptr<StreamPair>> Create(const OverlapOptions& options);

  // Uses the caller's `compute` stream and, if not null, the caller's `side` stream (else one is
  // created). InvalidArgument when `compute` is null (the legacy default stream cannot be
  // captured and synchronises with every other stream) or when `side` is the same stream as
  // `compute` (compared by stream id): an aliased side stream would silently serialise the
  // layer, which is never what a caller who asked for overlap wants.
  static absl::StatusOr<std::unique_ptr<StreamPair>> CreateWithStreams(
      const OverlapOptions& options, CUstream_st* compute, CUstream_st* side);

  ~StreamPair();
  StreamPair(const StreamPair&) = delete;
  StreamPair& operator=(const StreamPair&) = delete;

  const OverlapOptions& options() const { return options_; }
  CUstream_st* compute() const { return compute_; }
  CUstream_st* side() const { return side_; }
  CUevent_st* ready() const { return ready_; }
  CUevent_st* done() const { return done_; }

 private:
  StreamPair() = default;
  absl::Status Init(const OverlapOptions& options, CUstream_st* compute, CUstream_st* side);

  OverlapOptions options_;
  CUstream_st* compute_ = nullptr;
  CUstream_st* side_ = nullptr;
  bool owns_compute_ = false;
  bool owns_side_ = false;
  CUevent_st* ready_ = nullptr;
  CUevent_st* done_ = nullptr;
};

}  // namespace moe::moe_overlap

#endif  // MOE_MOE_OVERLAP_STREAM_PAIR_H_
