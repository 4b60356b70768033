// How well does this machine hide compute under a DRAM stream, with all cores running?
//
// The dedup cases of cpu_moe_bench take longer than both their DRAM time and their compute floor
// (the cache-hot rate): the cores lose part of the compute under the stream. This probe asks
// whether any kernel could do better: the workers stream a buffer far larger than the last-level
// cache in 1 MiB runs taken from a shared counter, as the library's DRAM probe and work items do
// (each run two sequential streams, its halves, with software prefetch 2 KiB ahead into L1 and
// 8 KiB ahead into L2, the panel kernels' defaults), and
// spends W `vpdpbusd` per 64-byte line on that line's bytes (into 8 independent accumulators, so
// latency does not bound it). The same loop over a buffer that stays in each worker's L2 gives
// the compute-only rate. With perfect overlap a worker would run at min(DRAM share, compute
// rate): the table prints the streamed GB/s, the cache-hot GB/s, the ideal min(first row's
// streamed GB/s, hot GB/s), and the streamed rate's fraction of that ideal.
//
// The q4_0 panel kernel spends 2 decode operations per line of codes and 3 per line and route
// (8 dot products, a conversion, a multiply and an FMA per 4 lines): about W = 4 at one route
// per expert, 16 at four, 24-32 at eight.
//   bazel-bin/cpu_moe/overlap_probe [workers=physical cores] [GB=2]
// GCC 12's avx512fintrin.h builds masked and converting intrinsics on self-initialized undefined
// vectors, which -Wmaybe-uninitialized and -Wuninitialized report wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/thread_pool.h"

namespace {

constexpr size_t kL1Ahead = 2048, kL2Ahead = 8192;

// Streams [p, p + n) as two halves side by side, W vpdpbusd per line; returns a value that
// depends on every accumulator (so nothing is optimized away).
template <int W>
int32_t Stream(const uint8_t* p, size_t n, bool prefetch) {
  __m512i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i x = _mm512_set1_epi32(0x01020304);
  const size_t half = n / 2;
  const uint8_t* a = p;
  const uint8_t* b = p + half;
  for (size_t o = 0; o < half; o += 64) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(a + o + kL1Ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + o + kL1Ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a + o + kL2Ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(b + o + kL2Ahead), _MM_HINT_T1);
    }
    const __m512i va = _mm512_load_si512(a + o);
    const __m512i vb = _mm512_load_si512(b + o);
    if constexpr (W == 0) {
      acc[0] = _mm512_add_epi32(acc[0], va);
      acc[1] = _mm512_add_epi32(acc[1], vb);
    } else {
      // Fully unrolled, so that the accumulators stay in registers.
#pragma GCC unroll 64
      for (int i = 0; i < W; ++i) acc[i % 8] = _mm512_dpbusd_epi32(acc[i % 8], i % 2 ? vb : va, x);
    }
  }
  __m512i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

using StreamFn = int32_t (*)(const uint8_t*, size_t, bool);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    std::printf("overlap_probe: this CPU lacks AVX-512 VNNI; nothing to measure\n");
    return 0;
  }
  const int workers = argc > 1 ? std::atoi(argv[1]) : moe::common::PhysicalCoreCount();
  const double gb = argc > 2 ? std::atof(argv[2]) : 2.0;
  if (workers < 1 || !(gb > 0.0)) {
    std::fprintf(stderr, "usage: overlap_probe [workers >= 1] [GB > 0]\n");
    return 2;
  }
  moe::common::ThreadPool pool(workers);
  constexpr size_t kRun = 1 << 20;
  const size_t runs = std::max<size_t>(1, static_cast<size_t>(gb * 1e9) / kRun);
  moe::common::AlignedBuffer<uint8_t> big(runs * kRun + kL2Ahead * 2, 2 << 20);
  std::memset(big.data(), 1, big.size());  // fault the pages in
  constexpr size_t kHot = 256 << 10;       // per worker, in its L2
  moe::common::AlignedBuffer<uint8_t> hot(kHot * workers + kL2Ahead * 2, 64);
  std::memset(hot.data(), 1, hot.size());
  const int kWs[] = {0, 2, 4, 8, 16, 24, 32, 48, 64};
  const StreamFn fns[] = {Stream<0>, Stream<2>, Stream<4>, Stream<8>, Stream<16>,
                          Stream<24>, Stream<32>, Stream<48>, Stream<64>};
  std::atomic<int64_t> sink{0};
  // GB/s of the whole buffer (cold) or of hot_reps passes over each worker's L2 part.
  auto run = [&](StreamFn fn, bool cold) {
    const int hot_reps = 64;
    const auto t0 = std::chrono::steady_clock::now();
    if (cold) {
      pool.ParallelFor(runs, [&](uint64_t r, int) {
        sink.fetch_add(fn(big.data() + r * kRun, kRun, true), std::memory_order_relaxed);
      });
    } else {
      pool.ParallelFor(workers, [&](uint64_t, int w) {
        int32_t s = 0;
        for (int r = 0; r < hot_reps; ++r) s += fn(hot.data() + w * kHot, kHot, false);
        sink.fetch_add(s, std::memory_order_relaxed);
      });
    }
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = cold ? static_cast<double>(runs) * kRun
                              : static_cast<double>(kHot) * hot_reps * workers;
    return bytes / sec * 1e-9;
  };
  std::printf("overlap_probe: %d workers, %.2f GB streamed per pass in 1 MiB runs (two streams "
              "each, prefetch %zu B into L1 and %zu B into L2 ahead), median of 5 passes, the W "
              "values interleaved\n", workers, static_cast<double>(runs) * kRun * 1e-9, kL1Ahead,
              kL2Ahead);
  constexpr int kN = sizeof(kWs) / sizeof(kWs[0]);
  std::vector<std::vector<double>> cold(kN), hotr(kN);
  run(fns[0], true);  // warm-up
  for (int rep = 0; rep < 5; ++rep) {
    for (int i = 0; i < kN; ++i) {
      const int j = (i + rep) % kN;  // rotate the order
      cold[j].push_back(run(fns[j], true));
      hotr[j].push_back(run(fns[j], false));
    }
  }
  const double dram = Median(cold[0]);
  std::printf("%-4s %-14s %-14s %-22s %-10s\n", "W", "streamed GB/s", "hot GB/s",
              "ideal min(DRAM, hot)", "fraction");
  for (int i = 0; i < kN; ++i) {
    const double c = Median(cold[i]), h = Median(hotr[i]);
    const double ideal = std::min(dram, h);
    std::printf("%-4d %-14.1f %-14.1f %-22.1f %-10.3f\n", kWs[i], c, h, ideal, c / ideal);
  }
  std::printf("(sink %lld)\n", static_cast<long long>(sink.load()));
  return 0;
}
