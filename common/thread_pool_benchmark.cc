// Fork-join overhead of ThreadPool::ParallelFor: the cost a decode step pays per MoE layer.
#include <atomic>
#include <cstdint>

#include "benchmark/benchmark.h"
#include "common/thread_pool.h"

namespace moe::common {
namespace {

void BM_ParallelForOverhead(benchmark::State& state) {
  ThreadPool pool(static_cast<int>(state.range(0)));
  std::atomic<uint64_t> sink{0};
  for (auto _ : state) {
    pool.ParallelFor(pool.num_workers(), [&](uint64_t task, int) {
      sink.fetch_add(task, std::memory_order_relaxed);
    });
  }
  benchmark::DoNotOptimize(sink.load());
}
BENCHMARK(BM_ParallelForOverhead)->Arg(1)->Arg(2)->Arg(PhysicalCoreCount())->UseRealTime();

}  // namespace
}  // namespace moe::common

BENCHMARK_MAIN();
