// The DRAM read bandwidth of this machine, measured: the physical limit that CPU MoE kernels
// (which stream expert weights from host RAM) and their benchmarks are compared against. Also the
// last-level cache size, so callers can pick a buffer that defeats the cache.
#ifndef MOE_COMMON_MEMBW_H_
#define MOE_COMMON_MEMBW_H_

#include <cstddef>

#include "common/thread_pool.h"

namespace moe::common {

// Allocates `bytes` (2 MiB aligned, huge pages requested), writes every page from the workers that
// will read it, then times `reps` full streaming reads split across all of pool's workers
// (vectorized sums, Highway dynamic dispatch: AVX-512 / AVX2 / SSE4 as the CPU allows) and
// returns the median in GB/s (1e9 bytes per second). `bytes` should be far larger than
// LastLevelCacheBytes() (1 GiB is the usual choice), else this measures the cache. bytes is
// rounded down to a multiple of 64 KiB (minimum 64 KiB); reps below 1 count as 1. Aborts if the
// buffer cannot be allocated (a programmer's choice of size, not input).
double MeasureDramReadGBps(ThreadPool& pool, size_t bytes, int reps);

// Size in bytes of the highest-level data or unified CPU cache, from sysfs; 0 if unknown.
size_t LastLevelCacheBytes();

}  // namespace moe::common

#endif  // MOE_COMMON_MEMBW_H_
