// Aggregate register-only throughput of vpdpbusd / vfmadd231ps zmm with 1..N threads pinned to
// CPUs 0..n-1: tells whether a VM's vCPUs are separate physical cores (aggregate grows n-fold)
// or hyperthread siblings (grows about n/2-fold past half the vCPUs). Then vCPU 0 paired with
// each other vCPU: a sibling pair shows half the per-thread rate.
//   bazel-bin/cpu_moe/benchmarks/threadscale   (no arguments; about 10 s on 16 vCPUs; AVX-512 VNNI CPUs)
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

constexpr long kIters = 1'000'000'000 / 12;

// 12 independent chains of one instruction (so its throughput, not its latency, sets the pace).
struct DpBusd {
  using V = __m512i;
  static V Init(int i) { return _mm512_set1_epi32(i); }
  static V Step(V a) { return _mm512_dpbusd_epi32(a, _mm512_set1_epi8(1), _mm512_set1_epi8(2)); }
  static double Lane(V v) {
    alignas(64) int32_t l[16];
    _mm512_store_si512(l, v);
    return l[0];
  }
};
struct Fma {
  using V = __m512;
  static V Init(int i) { return _mm512_set1_ps(static_cast<float>(i)); }
  static V Step(V a) { return _mm512_fmadd_ps(a, _mm512_set1_ps(1.0000001f), _mm512_set1_ps(1e-9f)); }
  static double Lane(V v) {
    alignas(64) float l[16];
    _mm512_store_ps(l, v);
    return l[0];
  }
};

template <class Op>
double Chains() {
  typename Op::V a[12];
  for (int i = 0; i < 12; ++i) a[i] = Op::Init(i);
  for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = Op::Step(a[i]);
  }
  double total = 0;
  for (int i = 0; i < 12; ++i) total += Op::Lane(a[i]);
  return total;
}

// Runs the chains of `kind` (0: vpdpbusd, 1: FMA) on one thread per CPU of `cpus`, started
// together; returns the mean per-thread rate (G instructions/s) and the slowest thread's time.
void RunOn(const std::vector<int>& cpus, int kind, double* per_thread, double* worst) {
  std::atomic<int> ready{0}, go{0};
  std::vector<double> dt(cpus.size());
  std::vector<std::thread> th;
  for (size_t t = 0; t < cpus.size(); ++t) {
    th.emplace_back([&, t] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[t], &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      ready++;
      while (!go.load()) {
      }
      const auto t0 = std::chrono::steady_clock::now();
      volatile double r = kind == 0 ? Chains<DpBusd>() : Chains<Fma>();
      (void)r;
      dt[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  while (ready.load() < static_cast<int>(cpus.size())) {
  }
  go = 1;
  for (auto& x : th) x.join();
  double sum = 0;
  *worst = 0;
  for (double d : dt) {
    sum += d;
    if (d > *worst) *worst = d;
  }
  *per_thread = kIters * 12.0 / (sum / cpus.size()) / 1e9;
}

}  // namespace

int main() {
  const int maxn = static_cast<int>(std::thread::hardware_concurrency());
  double per = 0, worst = 0;
  // Warm-up: the first loop of a process runs while the core still ramps up.
  RunOn({0}, 0, &per, &worst);
  RunOn({0}, 1, &per, &worst);
  for (int kind = 0; kind < 2; ++kind) {
    double base = 0;
    for (int n : {1, 2, 4, 6, 8, 10, 12, 14, 16, 32}) {
      if (n > maxn) continue;
      std::vector<int> cpus(n);
      for (int t = 0; t < n; ++t) cpus[t] = t;
      RunOn(cpus, kind, &per, &worst);
      if (n == 1) base = per;
      std::printf("%s threads=%2d per_thread=%.2f Ginstr/s aggregate=%.1f scaling=%.2fx (of 1 "
                  "thread) worst=%.3fs\n",
                  kind == 0 ? "vpdpbusd" : "vfmadd231ps", n, per, per * n, per * n / base, worst);
    }
  }
  for (int j = 1; j < maxn; ++j) {
    RunOn({0, j}, 1, &per, &worst);
    std::printf("pair cpu0+cpu%-2d fma per_thread=%.2f Ginstr/s\n", j, per);
  }
  return 0;
}
