// Test and benchmark helpers for //engine/cuda/ops: device arrays that upload, download and
// poison themselves, and a fast seeded generator of random inputs. Aborts on CUDA errors (test
// setup, not product code). Only with CUDA.
#ifndef MOE_ENGINE_CUDA_OPS_OPS_TEST_UTIL_H_
#define MOE_ENGINE_CUDA_OPS_OPS_TEST_UTIL_H_

#if MOE_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/formats.h"

namespace moe::engine::gpu::testing {

inline void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}

// n values of T in device memory; owns it.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    CheckCuda(cudaMalloc(reinterpret_cast<void**>(&p_), (n > 0 ? n : 1) * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  void Upload(const std::vector<T>& host) {
    if (host.size() != n_) std::abort();
    CheckCuda(cudaMemcpy(p_, host.data(), bytes(), cudaMemcpyHostToDevice), "upload");
    // Kernels may run on non-blocking streams, which do not wait for the legacy stream.
    CheckCuda(cudaDeviceSynchronize(), "upload");
  }
  std::vector<T> Download() const {
    CheckCuda(cudaDeviceSynchronize(), "kernel");
    std::vector<T> host(n_);
    CheckCuda(cudaMemcpy(host.data(), p_, bytes(), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // All bytes 0xFF: NaN as f32 and bf16, -1 as int32, so an unwritten value shows.
  void Poison() {
    CheckCuda(cudaMemset(p_, 0xFF, bytes()), "poison");
    CheckCuda(cudaDeviceSynchronize(), "poison");
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

// splitmix64: fast enough for the LM head's 311M weights.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f);
  }
  int Int(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_;
};

// A seed that differs from run to run (print it to reproduce a failure).
inline uint64_t FreshSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

inline std::vector<float> RandomF32(Rng& rng, size_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (float& x : v) x = rng.Uniform(lo, hi);
  return v;
}

inline std::vector<uint16_t> RandomBf16(Rng& rng, size_t n, float lo, float hi) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = common::FloatToBf16(rng.Uniform(lo, hi));
  return v;
}

}  // namespace moe::engine::gpu::testing

#endif  // MOE_HAVE_CUDA
#endif  // MOE_ENGINE_CUDA_OPS_OPS_TEST_UTIL_H_
