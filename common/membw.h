// The DRAM read bandwidth of this machine, measured: the physical limit that CPU MoE kernels
// (which stream expert weights from host RAM) and their benchmarks are compared against. Also the
// last-level cache size, so callers can pick a buffer that defeats the cache.
#ifndef MOE_COMMON_MEMBW_H_
#define MOE_COMMON_MEMBW_H_

#include <cstddef>
#include <vector>

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
  // Median GB/s over `reps` rounds; a round reads the whole buffer once per pattern of
  // MeasureEach and counts its fastest read.
  double Measure(int reps);
  // One read of the whole buffer per pattern, GB/s each, in this order: one stream per worker
  // with the hardware prefetchers only, then with a software prefetch 2 KiB and 4 KiB ahead,
  // then two streams per worker with prefetches 4 KiB ahead into L1 and 8 KiB ahead into L2 (the
  // bf16 expert kernel's pattern, which on the GPU machine's host streamed 10-15% faster than
  // the one-stream reads on some days). Workers take 1 MiB runs of the buffer.
  struct Reading {
    const char* name;
    double gbps;
  };
  std::vector<Reading> MeasureEach();
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
