// copy_missing: moves every bank of every missed expert from the host ExpertStore into its GPU
// slot. Two implementations with the same result, byte for byte:
//  - LaunchCopyMissing: ONE kernel launch that reads the miss plan from device memory and
//    gathers from mapped pinned host memory with 16-byte loads. Fixed descriptors and a fixed
//    grid, no host synchronization: capturable in a CUDA graph and replayable with new plans.
//    The grid follows the bytes that must be in flight to saturate PCIe, not the miss count.
//  - CopyMissingMemcpy: one cudaMemcpyAsync per bank per miss from a host-side plan (the
//    fallback, and the reference the kernel is tested and benchmarked against).
// Plain C++ header (no CUDA includes); without CUDA both return Unavailable.
#ifndef MOE_MOE_CACHE_GPU_GATHER_KERNELS_H_
#define MOE_MOE_CACHE_GPU_GATHER_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "moe_cache/gpu/bank_layout.h"
#include "moe_cache/policy_core.h"

struct CUstream_st;

namespace moe::moe_cache {

class ExpertStore;
class SlotPool;

struct GatherBank {
  const uint8_t* src_device = nullptr;  // mapped alias of the store's bank (for kernels)
  const uint8_t* src_host = nullptr;    // the store's bank (for cudaMemcpyAsync)
  uint8_t* dst = nullptr;               // the slot pool's bank
  uint64_t pitch = 0;                   // bytes per expert row, a multiple of 16
};

// Fixed for the life of a store/pool pair: what a captured graph bakes in.
struct GatherDescriptor {
  GatherBank banks[kMaxBanks];
  int32_t num_banks = 0;
  uint64_t chunks_per_expert = 0;  // sum over banks of pitch / 16
};

// InvalidArgument when the layouts differ; FailedPrecondition when the store is not
// pinned-mapped (the kernel must be able to read it).
absl::StatusOr<GatherDescriptor> MakeGatherDescriptor(const ExpertStore& store,
                                                      const SlotPool& pool);

struct GatherLaunchConfig {
  // Measured on an H200 (gather_bench, benchmarks/): 16 blocks of 512 threads, each with four
  // 16-byte loads in flight (512 KB in all), reach 94-97% of per-expert cudaMemcpyAsync at 1 to
  // 28 misses; 8 blocks reach only ~70%, more than 16 add nothing. 16 of 132 SMs stay busy.
  int blocks = 16;
  int threads = 512;
};

// count: device [1], number of valid entries; entries: device [capacity] (only the first
// *count are read). Enqueued on `stream`; returns launch errors only.
absl::Status LaunchCopyMissing(const GatherDescriptor& desc, const int32_t* count,
                               const MissPlanEntry* entries, const GatherLaunchConfig& config,
                               CUstream_st* stream);

// entries: host [count]. Enqueues count * num_banks cudaMemcpyAsync calls on `stream`.
absl::Status CopyMissingMemcpy(const GatherDescriptor& desc, const MissPlanEntry* entries, int count,
                               CUstream_st* stream);

}  // namespace moe::moe_cache

#endif  // MOE_MOE_CACHE_GPU_GATHER_KERNELS_H_
