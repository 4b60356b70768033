// Prints this machine's DRAM read bandwidth: membw_probe [GiB=1] [reps=7] [workers=physical cores]
#include <cstdio>
#include <cstdlib>

#include "common/membw.h"
#include "common/thread_pool.h"

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 1.0;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const int workers = argc > 3 ? std::atoi(argv[3]) : moe::common::PhysicalCoreCount();
  if (!(gib > 0) || reps < 1 || workers < 1) {
    std::fprintf(stderr, "usage: membw_probe [GiB > 0] [reps >= 1] [workers >= 1]\n");
    return 2;
  }
  moe::common::ThreadPool pool(workers);
  const size_t bytes = static_cast<size_t>(gib * (1u << 30));
  std::printf("last-level cache %.1f MiB; buffer %.2f GiB; %d workers; %d reps\n",
              moe::common::LastLevelCacheBytes() / 1048576.0, gib, workers, reps);
  moe::common::DramProbe probe(pool, bytes);
  // Every pattern's reading per round; then, from reps further rounds, the figure benchmarks use
  // (the median of those rounds' best).
  for (int r = 0; r < reps; ++r) {
    for (const auto& reading : probe.MeasureEach()) {
      std::printf("round %d: %6.2f GB/s  %s\n", r, reading.gbps, reading.name);
    }
  }
  std::printf("DRAM read: %.2f GB/s (median of %d further rounds' best pattern)\n",
              probe.Measure(reps), reps);
  return 0;
}
