#include "moe_overlap/stream_pair.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::moe_overlap {

absl::StatusOr<OverlapOptions> ApplyOverlapSwitch(OverlapOptions base, const char* value) {
  if (value == nullptr || value[0] == '\0') return base;
  if (std::strcmp(value, "0") == 0) {
    base.overlap = false;
  } else if (std::strcmp(value, "1") == 0) {
    base.overlap = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(kOverlapEnvVar, " must be 0 or 1, got '", value, "'"));
  }
  return base;
}

absl::StatusOr<OverlapOptions> OverlapOptionsFromEnv(OverlapOptions base) {
  return ApplyOverlapSwitch(base, std::getenv(kOverlapEnvVar));
}

absl::StatusOr<std::unique_ptr<StreamPair>> StreamPair::Create(const OverlapOptions& options) {
  std::unique_ptr<StreamPair> pair(new StreamPair());
  RETURN_IF_ERROR(pair->Init(options, nullptr, nullptr));
  return pair;
}

absl::StatusOr<std::unique_ptr<StreamPair>> StreamPair::CreateWithStreams(
    const OverlapOptions& options, CUstream_st* compute, CUstream_st* side) {
  if (compute == nullptr) {
    return absl::InvalidArgumentError(
        "the compute stream must be a created stream, not the legacy default stream");
  }
  std::unique_ptr<StreamPair> pair(new StreamPair());
  RETURN_IF_ERROR(pair->Init(options, compute, side));
  return pair;
}

#if MOE_HAVE_CUDA

absl::Status StreamPair::Init(const OverlapOptions& options, CUstream_st* compute,
                              CUstream_st* side) {
  RETURN_IF_ERROR(common::CudaAvailable());
  options_ = options;
  if (compute != nullptr && side != nullptr) {
    // Compare ids, not handles: two handles (e.g. cudaStreamPerThread and the stream it names)
    // can denote the same stream.
    unsigned long long compute_id = 0, side_id = 0;
    CUDA_RETURN_IF_ERROR(cudaStreamGetId(compute, &compute_id));
    CUDA_RETURN_IF_ERROR(cudaStreamGetId(side, &side_id));
    if (compute == side || compute_id == side_id) {
      return absl::InvalidArgumentError(
          "the side stream aliases the compute stream; the overlap needs two distinct streams");
    }
  }
  if (compute == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    owns_compute_ = true;
  }
  compute_ = compute;
  if (side == nullptr) {
    int priority = 0;
    if (options.side_high_priority) {
      int least = 0, greatest = 0;
      CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      priority = greatest;
    }
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, priority));
    owns_side_ = true;
  }
  side_ = side;
  // Synchronisation only: timing would make every record heavier.
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  return absl::OkStatus();
}

StreamPair::~StreamPair() {
  // Destruction is not a place to report errors; pending work on owned streams completes first
  // (cudaStreamDestroy returns at once and the stream is released when its work is done).
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (owns_side_ && side_ != nullptr) cudaStreamDestroy(side_);
  if (owns_compute_ && compute_ != nullptr) cudaStreamDestroy(compute_);
}

#else  // !MOE_HAVE_CUDA

absl::Status StreamPair::Init(const OverlapOptions&, CUstream_st*, CUstream_st*) {
  return absl::UnavailableError("moe_overlap: built without CUDA");
}

StreamPair::~StreamPair() = default;

#endif  // MOE_HAVE_CUDA

}  // namespace moe::moe_overlap
