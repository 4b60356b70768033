// How well does this machine hide compute under a DRAM stream, with all cores running?
//
// The dedup cases of cpu_moe_bench take longer than both their DRAM time and their compute floor
// (the cache-hot rate): the cores lose part of the compute under the stream. This probe asks
// whether any kernel could do better: the workers stream a buffer far larger than the last-level
// cache in 1 MiB runs taken from a shared counter, as the library's DRAM probe and work items do
// (each run two sequential streams, its halves, with software prefetch 2 KiB ahead into L1 and
// 8 KiB ahead into L2, the panel kernels' defaults), and spends W `vpdpbusd` on each pair of
// 64-byte lines, one from each stream (into 8 independent accumulators, so latency does not bound
// it, unless a row names fewer). The same loop over a buffer that stays in each worker's L2 gives
// the compute-only rate. With perfect overlap a worker would run at min(DRAM share, compute
// rate): the table prints the streamed GB/s, the cache-hot GB/s, the ideal min(first row's
// streamed GB/s, hot GB/s), and the streamed rate's fraction of that ideal.
//
// The q4_0 panel kernel spends 2 decode operations per line of codes and 3 per line and route
// (8 dot products, a conversion, a multiply and an FMA per 4 lines). Its dot products alone
// come to W = 4 per pair of lines at one route per expert, 16 at four, 32 at eight.
//   bazel-bin/cpu_moe/benchmarks/overlap_probe [workers=physical cores] [GB=2] [run KiB=1024] [random order 0|1]
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

// Streams [p, p + n) as two halves side by side, W vpdpbusd per pair of lines; returns a value
// that depends on every accumulator (so nothing is optimized away).
// C: the number of independent accumulators (8 unless a row says otherwise: "32c4" is W = 32
// into 4), so that rows with fewer show how much the dot product's latency costs.
template <int W, int C = 8>
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
      for (int i = 0; i < W; ++i) acc[i % C] = _mm512_dpbusd_epi32(acc[i % C], i % 2 ? vb : va, x);
    }
  }
  __m512i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

// The q4_0 panel kernel's own instruction mix (PanelDot at NP = 2, R routes) over the same two
// streams: each stream is a panel in the layout of Layout::kPanels, every two 32-column blocks'
// codes (2 x 256 bytes) followed by their 64-byte line of fp16 scales. Per block and stream:
// 4 loads, AND / shift / AND into 8 code vectors, the block's 16 scales converted; per route 8
// broadcast activation groups into two vpdpbusd chains, an add, a conversion, a multiply and an
// FMA. What it adds to Stream<W> is the kernel's dependency structure (decode -> dot -> scale),
// so its streamed fraction of min(DRAM, hot) says whether that structure hides under the stream.
alignas(64) int8_t g_acts[8][64];

//
// Variants of the dependency structure, same instructions otherwise (kChains - 2 more additions
// per route and stream when kChains = 4): kChains int32 chains per route and stream (the kernel's
// 2; "P4c1" one, "P4c4" four), and kPairs: two routes' chains interleaved in program order
// ("P4i"), so that twice as many independent chains are in flight without relying on the
// out-of-order window.
//
// kPorts moves work off port 0, where `vpdpbusd`, shifts and vcvtdq2ps all run on Intel's
// server cores: bit 1 takes the nibbles by vpermb (a port-5 shuffle) over a table of i & 15
// instead of the two ANDs ("P4v"); bit 2 converts the sums by the magic-number trick (the first
// chain seeded with 0x4B400000, the float bits minus 12582912.0f, exact for |sum| < 2^22)
// instead of vcvtdq2ps ("P4m"); "P4vm" both.
alignas(64) uint8_t g_low4[64];

template <int R, int kChains = 2, bool kPairs = false, int kPorts = 0>
int32_t Panel(const uint8_t* p, size_t n, bool prefetch) {
  static_assert(!kPairs || R % 2 == 0, "routes go in pairs");
  const __m512i low4 = _mm512_load_si512(g_low4);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  constexpr size_t kGroup = 576;  // two blocks' codes and their scale line
  __m512 acc[2][R];
  for (int s = 0; s < 2; ++s) {
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  }
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const size_t half = n / 2 / kGroup * kGroup;
  const uint8_t* base[2] = {p, p + half};
  for (size_t o = 0; o + kGroup <= half; o += kGroup) {
    for (int b = 0; b < 2; ++b) {
      __m512i w[2][8];
      __m512 ws[2];
      for (int s = 0; s < 2; ++s) {
        const uint8_t* c = base[s] + o + 256 * b;
        if (prefetch) {
          for (size_t q = 0; q < 320; q += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(c + kL1Ahead + q), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(c + kL2Ahead + q), _MM_HINT_T1);
          }
        }
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_load_si512(c + 64 * v);
          if constexpr (kPorts & 1) {
            w[s][2 * v] = _mm512_permutexvar_epi8(raw, low4);
            w[s][2 * v + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), low4);
          } else {
            w[s][2 * v] = _mm512_and_si512(raw, mask);
            w[s][2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
          }
        }
        ws[s] = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[s] + o + 512 + 32 * b)));
      }
      constexpr int kStep = kPairs ? 2 : 1;
      for (int r0 = 0; r0 < R; r0 += kStep) {
        __m512i sum[kStep][2][kChains];
        for (int i = 0; i < kStep; ++i) {
          for (int s = 0; s < 2; ++s) {
            sum[i][s][0] = _mm512_set1_epi32(-8 * (r0 + i + 1) + ((kPorts & 2) ? 0x4B400000 : 0));
            for (int c = 1; c < kChains; ++c) sum[i][s][c] = _mm512_setzero_si512();
          }
        }
        for (int g = 0; g < 8; ++g) {
          for (int i = 0; i < kStep; ++i) {
            int32_t word;
            std::memcpy(&word, g_acts[r0 + i] + 32 * b + 4 * g, 4);
            const __m512i x = _mm512_set1_epi32(word);
            for (int s = 0; s < 2; ++s) {
              sum[i][s][g % kChains] = _mm512_dpbusd_epi32(sum[i][s][g % kChains], w[s][g], x);
            }
          }
        }
        for (int i = 0; i < kStep; ++i) {
          const __m512 xv = _mm512_set1_ps(1.0f / (r0 + i + 1));
          for (int s = 0; s < 2; ++s) {
            __m512i t = sum[i][s][0];
            for (int c = 1; c < kChains; ++c) t = _mm512_add_epi32(t, sum[i][s][c]);
            const __m512 f = (kPorts & 2)
                                 ? _mm512_sub_ps(_mm512_castsi512_ps(t), magic)
                                 : _mm512_cvtepi32_ps(t);
            acc[s][r0 + i] = _mm512_fmadd_ps(f, _mm512_mul_ps(ws[s], xv), acc[s][r0 + i]);
          }
        }
      }
    }
  }
  __m512 t = _mm512_setzero_ps();
  for (int s = 0; s < 2; ++s) {
    for (int r = 0; r < R; ++r) t = _mm512_add_ps(t, acc[s][r]);
  }
  return static_cast<int32_t>(_mm512_reduce_add_ps(t));
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
    std::fprintf(stderr, "usage: overlap_probe [workers >= 1] [GB > 0] [run KiB] [random 0|1]\n");
    return 2;
  }
  moe::common::ThreadPool pool(workers);
  // The run size (KiB, argv[3], default 1024) and whether the runs go in a random order
  // (argv[4] = 1) rather than in address order: the library's work items are shorter and land
  // on experts anywhere in memory.
  const long run_kib = argc > 3 ? std::atol(argv[3]) : 1024;
  const bool shuffle = argc > 4 && std::atoi(argv[4]) == 1;
  if (run_kib < 4 || run_kib % 4 != 0 || run_kib > (1L << 20)) {
    std::fprintf(stderr,
                 "overlap_probe: the run size must be a multiple of 4 KiB, at most 1 GiB\n");
    return 2;
  }
  const size_t run_bytes = static_cast<size_t>(run_kib) << 10;
  const size_t runs = std::max<size_t>(1, static_cast<size_t>(gb * 1e9) / run_bytes);
  std::vector<uint32_t> order(runs);
  for (size_t r = 0; r < runs; ++r) order[r] = static_cast<uint32_t>(r);
  if (shuffle) {
    uint64_t st = 88172645463325252ull;
    for (size_t r = runs - 1; r > 0; --r) {
      st ^= st << 13; st ^= st >> 7; st ^= st << 17;
      std::swap(order[r], order[st % (r + 1)]);
    }
  }
  moe::common::AlignedBuffer<uint8_t> big(runs * run_bytes + kL2Ahead * 2, 2 << 20);
  std::memset(big.data(), 1, big.size());  // fault the pages in
  constexpr size_t kHot = 256 << 10;       // per worker, in its L2
  moe::common::AlignedBuffer<uint8_t> hot(kHot * workers + kL2Ahead * 2, 64);
  std::memset(hot.data(), 1, hot.size());
  for (int i = 0; i < 64; ++i) g_low4[i] = static_cast<uint8_t>(i & 15);
  for (auto& a : g_acts) {
    for (int i = 0; i < 64; ++i) a[i] = static_cast<int8_t>(i - 32);
  }
  // Rows: W (Stream<W>, 8 accumulators), W with fewer accumulators, and the panel kernel's mix
  // at R routes (P<R>) with its variants.
  struct Row {
    const char* name;
    StreamFn fn;
  };
  const Row rows[] = {{"0", Stream<0>},        {"2", Stream<2>},        {"4", Stream<4>},
                      {"8", Stream<8>},        {"16", Stream<16>},      {"24", Stream<24>},
                      {"32", Stream<32>},      {"32c4", Stream<32, 4>}, {"32c2", Stream<32, 2>},
                      {"48", Stream<48>},      {"64", Stream<64>},      {"P1", Panel<1>},
                      {"P2", Panel<2>},        {"P4", Panel<4>},        {"P4c1", Panel<4, 1>},
                      {"P4c4", Panel<4, 4>},   {"P4i", Panel<4, 2, true>},
                      {"P4v", Panel<4, 2, false, 1>}, {"P4m", Panel<4, 2, false, 2>},
                      {"P4vm", Panel<4, 2, false, 3>}, {"P8", Panel<8>},
                      {"P8vm", Panel<8, 2, false, 3>}};
  std::atomic<int64_t> sink{0};
  // GB/s of the whole buffer (cold) or of hot_reps passes over each worker's L2 part.
  auto run = [&](StreamFn fn, bool cold) {
    const int hot_reps = 64;
    const auto t0 = std::chrono::steady_clock::now();
    if (cold) {
      pool.ParallelFor(runs, [&](uint64_t r, int) {
        sink.fetch_add(fn(big.data() + order[r] * run_bytes, run_bytes, true),
                       std::memory_order_relaxed);
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
    const double bytes = cold ? static_cast<double>(runs) * run_bytes
                              : static_cast<double>(kHot) * hot_reps * workers;
    return bytes / sec * 1e-9;
  };
  std::printf("overlap_probe: %d workers, %.2f GB streamed per pass in %zu KiB runs (%s; two "
              "streams each, prefetch %zu B into L1 and %zu B into L2 ahead), median of 5 passes, "
              "the W values interleaved\n", workers, static_cast<double>(runs) * run_bytes * 1e-9,
              run_bytes >> 10, shuffle ? "random order" : "address order", kL1Ahead, kL2Ahead);
  constexpr int kN = sizeof(rows) / sizeof(rows[0]);
  std::vector<std::vector<double>> cold(kN), hotr(kN);
  run(rows[0].fn, true);  // warm-up
  for (int rep = 0; rep < 5; ++rep) {
    for (int i = 0; i < kN; ++i) {
      const int j = (i + rep) % kN;  // rotate the order
      cold[j].push_back(run(rows[j].fn, true));
      hotr[j].push_back(run(rows[j].fn, false));
    }
  }
  const double dram = Median(cold[0]);
  std::printf("%-5s %-14s %-14s %-22s %-10s\n", "W", "streamed GB/s", "hot GB/s",
              "ideal min(DRAM, hot)", "fraction");
  for (int i = 0; i < kN; ++i) {
    const double c = Median(cold[i]), h = Median(hotr[i]);
    const double ideal = std::min(dram, h);
    std::printf("%-5s %-14.1f %-14.1f %-22.1f %-10.3f\n", rows[i].name, c, h, ideal, c / ideal);
  }
  std::printf("(sink %lld)\n", static_cast<long long>(sink.load()));
  return 0;
}
