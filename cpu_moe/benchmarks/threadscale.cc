// Aggregate register-only throughput of vpdpbusd / vfmadd231ps zmm with 1..N threads pinned to
// CPUs 0..n-1: tells whether a VM's vCPUs are separate physical cores (aggregate grows n-fold)
// or hyperthread siblings (grows about n/2-fold past half the vCPUs). Then vCPU 0 paired with
// each other vCPU: a sibling pair shows half the per-thread rate.
//   bazel-bin/cpu_moe/threadscale   (no arguments; about 10 s on 16 vCPUs)
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <atomic>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static std::atomic<int> go{0};
static constexpr long kIters = 1'000'000'000 / 12;

__attribute__((target("avx512f,avx512vnni"))) static double Dp(int) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(2);
  for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
  }
  __m512i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, s);
  double total = 0;
  for (int32_t v : lanes) total += v;
  return total;
}
__attribute__((target("avx512f"))) static double Fma(int) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(i);
  const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-9f);
  for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  double total = 0;
  for (float v : lanes) total += v;
  return total;
}

int main() {
  const int maxn = static_cast<int>(std::thread::hardware_concurrency());
  // Warm-up: the first loop of a process runs while the core still ramps up.
  { volatile double r = Dp(0) + Fma(0); (void)r; }
  for (int kind = 0; kind < 2; ++kind) {
    double base = 0;
    for (int n : {1, 2, 4, 6, 8, 10, 12, 14, 16, 32}) {
      if (n > maxn) continue;
      std::vector<std::thread> th;
      std::vector<double> dt(n);
      std::atomic<int> ready{0};
      go = 0;
      for (int t = 0; t < n; ++t) {
        th.emplace_back([&, t] {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(t, &set);
          pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
          ready++;
          while (!go.load()) {}
          auto t0 = std::chrono::steady_clock::now();
          volatile double r = kind == 0 ? Dp(t) : Fma(t);
          (void)r;
          dt[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        });
      }
      while (ready.load() < n) {}
      go = 1;
      for (auto& x : th) x.join();
      double worst = 0, sum = 0;
      for (double d : dt) { worst = d > worst ? d : worst; sum += d; }
      const double per = kIters * 12.0 / (sum / n) / 1e9;  // Ginstr/s per thread (mean)
      if (n == 1) base = per;
      std::printf("%s threads=%2d per_thread=%.2f Ginstr/s aggregate=%.1f scaling=%.2fx (of 1 thread) worst=%.3fs\n",
                  kind == 0 ? "vpdpbusd" : "vfmadd231ps", n, per, per * n, per * n / base, worst);
    }
  }
  // Pairs: 2 threads on CPUs (0, j) for every j: a sibling pair shows half the per-thread rate.
  for (int j = 1; j < maxn; ++j) {
    std::vector<double> dt(2);
    std::atomic<int> ready{0};
    go = 0;
    std::vector<std::thread> th;
    for (int t = 0; t < 2; ++t) {
      const int cpu = t == 0 ? 0 : j;
      th.emplace_back([&, t, cpu] {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        ready++;
        while (!go.load()) {}
        auto t0 = std::chrono::steady_clock::now();
        volatile double r = Fma(0);
        (void)r;
        dt[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
    }
    while (ready.load() < 2) {}
    go = 1;
    for (auto& x : th) x.join();
    std::printf("pair cpu0+cpu%-2d fma per_thread=%.2f Ginstr/s\n", j,
                kIters * 12.0 / ((dt[0] + dt[1]) / 2) / 1e9);
  }
  return 0;
}
