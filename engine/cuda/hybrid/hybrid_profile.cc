#include "engine/cuda/hybrid/hybrid_profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::engine::hybrid {

#if MOE_HAVE_CUDA
namespace {

using Clock = std::chrono::steady_clock;

// Batch-1 steps of top_k random experts of rotating layers until `stop`; GB/s of expert bytes.
absl::StatusOr<double> CpuLoop(const std::vector<cpu_moe::ExpertBank>& banks, int top_k,
                               const cpu_moe::Options& options, common::ThreadPool& pool,
                               const std::atomic<bool>& stop) {
  const int E = banks[0].num_experts, H = banks[0].hidden;
  std::mt19937 rng(11);
  std::vector<int32_t> all(E), ids(top_k);
  for (int e = 0; e < E; ++e) all[e] = e;
  std::vector<float> weights(top_k, 1.0f / top_k), x(H, 0.01f), y(H);
  uint64_t bytes = 0;
  size_t layer = 0;
  const auto t0 = Clock::now();
  while (!stop.load(std::memory_order_relaxed)) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy_n(all.begin(), top_k, ids.begin());
    RETURN_IF_ERROR(cpu_moe::Forward(banks[layer], 1, top_k, ids, weights, x, absl::MakeSpan(y),
                                     options, pool));
    bytes += static_cast<uint64_t>(top_k) * banks[layer].BytesPerExpert();
    layer = (layer + 1) % banks.size();
  }
  return bytes / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
}

// Copies of top_k random experts (every bank) from the store into device memory until `stop`.
absl::StatusOr<double> LinkLoop(const moe_cache::ExpertStore& store, int top_k, uint8_t* dst,
                                cudaStream_t stream, const std::atomic<bool>& stop) {
  const moe_cache::BankLayout& lay = store.layout();
  const int experts = store.num_layers() * store.num_experts();
  std::mt19937 rng(5);
  uint64_t bytes = 0;
  const auto t0 = Clock::now();
  while (!stop.load(std::memory_order_relaxed)) {
    uint64_t off = 0;
    for (int k = 0; k < top_k; ++k) {
      const int g = static_cast<int>(rng() % experts);
      for (int b = 0; b < lay.num_banks(); ++b) {
        const uint64_t n = lay.bank(b).pitch;
        CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst + off, store.expert_bank(g, b), n, cudaMemcpyHostToDevice, stream));
        off += n;
        bytes += n;
      }
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return bytes / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
}

template <typename F>
auto RunFor(double seconds, F&& f) {
  std::atomic<bool> stop{false};
  std::thread timer([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop = true;
  });
  auto r = f(stop);
  timer.join();
  return r;
}

}  // namespace

absl::StatusOr<HybridProfileMeasurement> MeasureHybridProfile(
    const moe_cache::ExpertStore& store, const std::vector<cpu_moe::ExpertBank>& banks,
    int top_k, const cpu_moe::Options& options, common::ThreadPool& pool,
    double seconds_per_phase) {
  if (banks.empty() || top_k < 1 || top_k > banks[0].num_experts || seconds_per_phase <= 0) {
    return absl::InvalidArgumentError("hybrid profile: no banks, a bad top_k or no time");
  }
  RETURN_IF_ERROR(common::CudaAvailable());
  uint8_t* dst = nullptr;
  cudaStream_t stream = nullptr;
  const uint64_t dst_bytes = static_cast<uint64_t>(top_k) * store.layout().padded_bytes_per_expert();
  CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&dst), dst_bytes));
  struct Free {
    uint8_t* p;
    cudaStream_t* s;
    ~Free() {
      if (*s != nullptr) cudaStreamDestroy(*s);
      cudaFree(p);
    }
  } free_dst{dst, &stream};
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  HybridProfileMeasurement m;
  m.bytes_per_expert = banks[0].BytesPerExpert();
  auto cpu = [&](const std::atomic<bool>& stop) {
    return CpuLoop(banks, top_k, options, pool, stop);
  };
  auto link = [&](const std::atomic<bool>& stop) {
    return LinkLoop(store, top_k, dst, stream, stop);
  };
  RETURN_IF_ERROR(RunFor(0.2, cpu).status());  // warm-up
  ASSIGN_OR_RETURN(m.cpu_alone_gbps, RunFor(seconds_per_phase, cpu));
  ASSIGN_OR_RETURN(m.link_alone_gbps, RunFor(seconds_per_phase, link));
  absl::StatusOr<double> link_both = 0.0;
  std::thread t([&] { link_both = RunFor(seconds_per_phase, link); });
  absl::StatusOr<double> cpu_both = RunFor(seconds_per_phase, cpu);
  t.join();
  RETURN_IF_ERROR(link_both.status());
  RETURN_IF_ERROR(cpu_both.status());
  m.link_both_gbps = *link_both;
  m.cpu_both_gbps = *cpu_both;
  return m;
}

#else

absl::StatusOr<HybridProfileMeasurement> MeasureHybridProfile(
    const moe_cache::ExpertStore&, const std::vector<cpu_moe::ExpertBank>&, int,
    const cpu_moe::Options&, common::ThreadPool&, double) {
  return absl::UnavailableError("hybrid profile: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::engine::hybrid
