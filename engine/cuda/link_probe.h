// The two bandwidths the offload-only floor of a decode step is computed from, measured on the
// current device in the running process: host -> device copies from pinned memory (what every
// expert miss crosses) and device-to-device copies (read + write bytes over time: the speed
// resident weights are read at). Setup-time use only: allocates, synchronizes.
// Plain C++ header; without CUDA or a device, Unavailable.
#ifndef MOE_ENGINE_CUDA_LINK_PROBE_H_
#define MOE_ENGINE_CUDA_LINK_PROBE_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace moe::engine::gpu {

struct LinkBandwidth {
  double host_to_device_gbps = 0;  // pinned cudaMemcpyAsync, best of the repetitions
  double device_gbps = 0;          // 2 x bytes / time of a device-to-device copy, best
};

// Copies `bytes` (rounded down to 16) `reps` times each way and keeps the best time.
absl::StatusOr<LinkBandwidth> MeasureLinkBandwidth(uint64_t bytes = uint64_t{1} << 30,
                                                   int reps = 5);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_LINK_PROBE_H_
