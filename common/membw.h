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
// returns the median in GB/s (1e9 bytes per second) as DramProbe::Measure does. `bytes` should be
// far larger than LastLevelCacheBytes() (1 GiB is the usual choice), else this measures the cache. bytes is
// rounded down to a multiple of 64 KiB (minimum 64 KiB); reps below 1 count as 1. Aborts if the
// buffer cannot be allocated (a programmer's choice of size, not input).
double MeasureDramReadGBps(ThreadPool& pool, size_t bytes, int reps);

// The same measurement with the buffer kept, for taking readings next to the work they judge: on
// a virtual machine the bandwidth available moves by 20% and more over minutes (the GPU
// machine's host read 120-175 GB/s in successive processes), so a benchmark should divide by a
// reading taken beside each case, not by one taken at start-up.
class DramProbe {
 public:
  // Allocates and first-touches `bytes` (as MeasureDramReadGBps does).
  DramProbe(ThreadPool& pool, size_t bytes);
  ~DramProbe();
  DramProbe(const DramProbe&) = delete;
  DramProbe& operator=(const DramProbe&) = delete;
  // Median GB/s over `reps` rounds; a round reads the whole buffer with no software prefetch,
  // then 2 KiB and 4 KiB ahead, and counts its fastest read.
  double Measure(int reps);
  size_t bytes() const { return bytes_; }

 private:
  ThreadPool& pool_;
  size_t bytes_;
  void* buf_;  // AlignedBuffer<uint64_t>, kept opaque here
};

// Size in bytes of the highest-level data or unified CPU cache, from sysfs; 0 if unknown.
size_t LastLevelCacheBytes();

}  // namespace moe::common

#endif  // MOE_COMMON_MEMBW_H_
