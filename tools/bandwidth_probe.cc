// bandwidth_probe: measures the two bandwidths the hybrid miss split needs, with both paths busy
// at once, and writes them to a profile file (moe_cache/hybrid_split.h describes the format):
//   - PCIe gather: the one-launch copy_missing kernel moving batch-1 miss sets (8 experts of
//     Qwen3-30B-A3B shape) from pinned host memory into GPU slots;
//   - CPU experts: cpu_moe::Forward at batch 1, top-8, bf16, weights streamed from DRAM (rotating
//     through layer banks several times the last-level cache).
// Each path is measured alone, then both together; the profile gets the contended figures,
// because the two compete for host DRAM and a ratio measured without contention picks the wrong
// mode. Without a GPU only the CPU figure is measured and no profile is written.
//
//   bandwidth_probe --out=$HOME/.cache/moe-offload/bandwidth_profile.txt --seconds=3
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/aligned_buffer.h"
#include "common/cuda_status.h"
#include "common/formats.h"
#include "common/membw.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"
#include "moe_cache/hybrid_split.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, out, "", "profile file to write (default: ~/.cache/moe-offload/bandwidth_profile.txt)");
ABSL_FLAG(double, seconds, 3.0, "seconds per measurement phase");
ABSL_FLAG(int, threads, 0, "CPU worker threads (0: one per physical core)");
ABSL_FLAG(double, cpu_gb, 0.0,
          "GB of bf16 expert banks the CPU path rotates through (0: 4x the last-level cache, "
          "at least 2 GB)");
ABSL_FLAG(int, misses, 8, "experts per gather (a batch-1 miss set)");

namespace moe::tools {
namespace {

constexpr int kExperts = 128, kHidden = 2048, kInter = 768, kTopK = 8;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU side: banks of bf16 experts and a batch-1 Forward loop over them.
class CpuPath {
 public:
  CpuPath(int layers, common::ThreadPool& pool) : pool_(pool) {
    const size_t gu = size_t{kExperts} * 2 * kInter * kHidden, dn = size_t{kExperts} * kHidden * kInter;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-0.05f, 0.05f);
    // A small table of random bf16 values, tiled: non-zero data without a slow fill.
    std::vector<uint16_t> tile(4096);
    for (auto& v : tile) v = common::FloatToBf16(u(rng));
    for (int l = 0; l < layers; ++l) {
      gate_up_.emplace_back(gu);
      down_.emplace_back(dn);
      for (size_t i = 0; i < gu; i += tile.size()) {
        std::copy_n(tile.begin(), std::min(tile.size(), gu - i), gate_up_.back().data() + i);
      }
      for (size_t i = 0; i < dn; i += tile.size()) {
        std::copy_n(tile.begin(), std::min(tile.size(), dn - i), down_.back().data() + i);
      }
    }
    x_.resize(kHidden, 0.01f);
    y_.resize(kHidden);
    // The engine's settings: cpu_moe's options and tuning from the environment, as
    // engine::CpuExpertBackend reads them, so that a profile matches the runs it is used for.
    options_ = cpu_moe::Options::FromEnv();
    tuning_ = cpu_moe::internal::Tuning::FromEnv();
  }

  uint64_t bytes_per_expert() const { return Bank(0).BytesPerExpert(); }

  // Runs until `stop`; returns GB/s of expert weights consumed.
  double Run(const std::atomic<bool>& stop) {
    std::mt19937 rng(11);
    std::vector<int32_t> ids(kTopK);
    std::vector<float> weights(kTopK, 1.0f / kTopK);
    std::vector<int32_t> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    uint64_t bytes = 0;
    size_t layer = 0;
    const auto t0 = Clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      std::shuffle(all.begin(), all.end(), rng);
      std::copy_n(all.begin(), kTopK, ids.begin());
      const absl::Status s =
          cpu_moe::internal::Forward(Bank(layer), 1, kTopK, ids, weights, x_, absl::MakeSpan(y_),
                                     options_, tuning_, pool_);
      if (!s.ok()) {
        std::fprintf(stderr, "cpu_moe::Forward failed: %s\n", s.ToString().c_str());
        std::exit(1);
      }
      bytes += kTopK * bytes_per_expert();
      layer = (layer + 1) % gate_up_.size();
    }
    return bytes / Seconds(t0, Clock::now()) / 1e9;
  }

 private:
  cpu_moe::ExpertBank Bank(size_t layer) const {
    cpu_moe::ExpertBank b;
    b.format = common::WeightFormat::kBf16;
    b.num_experts = kExperts;
    b.hidden = kHidden;
    b.intermediate = kInter;
    b.gate_up_weights = gate_up_[layer].data();
    b.down_weights = down_[layer].data();
    return b;
  }

  common::ThreadPool& pool_;
  std::vector<common::AlignedBuffer<uint16_t>> gate_up_, down_;
  std::vector<float> x_, y_;
  cpu_moe::Options options_;
  cpu_moe::internal::Tuning tuning_;
};

#if MOE_HAVE_CUDA
// GPU side: a pinned-mapped store of 256 experts and a slot pool; gathers of `misses` experts.
class GpuPath {
 public:
  static absl::StatusOr<std::unique_ptr<GpuPath>> Create(int misses) {
    auto layout = moe_cache::BankLayout::Create(
        {{"gate_up", uint64_t{2} * kInter * kHidden * 2}, {"down", uint64_t{kHidden} * kInter * 2}});
    if (!layout.ok()) return layout.status();
    std::unique_ptr<GpuPath> p(new GpuPath());
    p->misses_ = misses;
    auto store = moe_cache::ExpertStore::Create({1, 256, true}, *layout);
    if (!store.ok()) return store.status();
    p->store_ = std::move(*store);
    auto pool = moe_cache::SlotPool::Create(misses, *layout);
    if (!pool.ok()) return pool.status();
    p->pool_ = std::move(*pool);
    auto desc = moe_cache::MakeGatherDescriptor(*p->store_, *p->pool_);
    if (!desc.ok()) return desc.status();
    p->desc_ = *desc;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&p->stream_, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(cudaMalloc(&p->d_count_, sizeof(int32_t)));
    CUDA_RETURN_IF_ERROR(cudaMalloc(&p->d_plan_, sizeof(moe_cache::MissPlanEntry) * misses));
    return p;
  }
  ~GpuPath() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaFree(d_count_);
    cudaFree(d_plan_);
  }

  double Run(const std::atomic<bool>& stop) {
    std::vector<moe_cache::MissPlanEntry> plan(misses_);
    int next = 0;
    uint64_t bytes = 0;
    const auto t0 = Clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      for (int i = 0; i < misses_; ++i) {
        plan[i] = {next, i};
        next = (next + 1) % store_->num_experts();
      }
      cudaMemcpyAsync(d_count_, &misses_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_);
      cudaMemcpyAsync(d_plan_, plan.data(), sizeof(plan[0]) * misses_, cudaMemcpyHostToDevice,
                      stream_);
      const absl::Status s = moe_cache::LaunchCopyMissing(desc_, d_count_, d_plan_, {}, stream_);
      const cudaError_t e = cudaStreamSynchronize(stream_);
      if (!s.ok() || e != cudaSuccess) {
        std::fprintf(stderr, "gather failed: %s / %s\n", s.ToString().c_str(), cudaGetErrorString(e));
        std::exit(1);
      }
      bytes += uint64_t(misses_) * store_->layout().padded_bytes_per_expert();
    }
    return bytes / Seconds(t0, Clock::now()) / 1e9;
  }

 private:
  GpuPath() = default;
  int misses_ = 0;
  std::unique_ptr<moe_cache::ExpertStore> store_;
  std::unique_ptr<moe_cache::SlotPool> pool_;
  moe_cache::GatherDescriptor desc_;
  cudaStream_t stream_ = nullptr;
  int32_t* d_count_ = nullptr;
  moe_cache::MissPlanEntry* d_plan_ = nullptr;
};
#endif  // MOE_HAVE_CUDA

template <typename Path>
double RunFor(Path& path, double seconds) {
  std::atomic<bool> stop{false};
  std::thread timer([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop = true;
  });
  const double gbps = path.Run(stop);
  timer.join();
  return gbps;
}

int Main() {
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (seconds <= 0) {
    std::fprintf(stderr, "bandwidth_probe: --seconds must be > 0\n");
    return 2;
  }
  std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    const char* home = std::getenv("HOME");
    out = absl::StrCat(home ? home : ".", "/.cache/moe-offload/bandwidth_profile.txt");
  }
  const int threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : common::PhysicalCoreCount();
  common::ThreadPool pool(threads);
  const size_t llc = common::LastLevelCacheBytes();
  double cpu_gb = absl::GetFlag(FLAGS_cpu_gb);
  if (cpu_gb <= 0) cpu_gb = std::max(2.0, 4.0 * llc / 1e9);
  const double layer_gb = double(kExperts) * 3 * kInter * kHidden * 2 / 1e9;
  const int layers = std::max(1, static_cast<int>(cpu_gb / layer_gb + 0.999));
  std::printf("bandwidth_probe: %d CPU workers, LLC %.0f MiB, CPU path rotates %d bf16 layer banks "
              "(%.1f GB), %.1f s per phase\n",
              threads, llc / 1048576.0, layers, layers * layer_gb, seconds);

  const double dram = common::MeasureDramReadGBps(pool, size_t{1} << 31, 5);
  std::printf("DRAM read bandwidth, %d workers: %.1f GB/s\n", threads, dram);
  CpuPath cpu(layers, pool);
  RunFor(cpu, 0.5);  // warm-up
  const double cpu_alone = RunFor(cpu, seconds);
  std::printf("CPU experts alone:  %.1f GB/s (%.0f%% of DRAM)\n", cpu_alone, 100 * cpu_alone / dram);

#if MOE_HAVE_CUDA
  if (common::CudaDeviceCount() > 0) {
    cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);  // the GPU thread must not eat a core
    auto gpu = GpuPath::Create(absl::GetFlag(FLAGS_misses));
    if (!gpu.ok()) {
      std::fprintf(stderr, "bandwidth_probe: GPU path: %s\n", gpu.status().ToString().c_str());
      return 1;
    }
    RunFor(**gpu, 0.5);
    const double gpu_alone = RunFor(**gpu, seconds);
    std::printf("PCIe gather alone:  %.1f GB/s\n", gpu_alone);
    double gpu_both = 0;
    std::thread gpu_thread([&] { gpu_both = RunFor(**gpu, seconds); });
    const double cpu_both = RunFor(cpu, seconds);
    gpu_thread.join();
    std::printf("both at once:       CPU %.1f GB/s (%.0f%% of alone), PCIe %.1f GB/s (%.0f%% of alone)\n",
                cpu_both, 100 * cpu_both / cpu_alone, gpu_both, 100 * gpu_both / gpu_alone);
    std::printf("split at batch 1: fetch %.0f%% of misses, compute %.0f%% on the CPU "
                "(uncontended figures would say %.0f%%)\n",
                100 * gpu_both / (gpu_both + cpu_both), 100 * cpu_both / (gpu_both + cpu_both),
                100 * gpu_alone / (gpu_alone + cpu_alone));
    moe_cache::BandwidthProfile profile;
    profile.pcie_gather_gbps = gpu_both;
    profile.cpu_expert_gbps = cpu_both;
    profile.contended = true;
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(out).parent_path(), ec);
    const absl::Status s = moe_cache::WriteBandwidthProfile(profile, out);
    if (!s.ok()) {
      std::fprintf(stderr, "bandwidth_probe: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("wrote %s\n", out.c_str());
    return 0;
  }
#endif
  std::printf("no GPU (%s): PCIe not measured, no profile written\n",
              common::CudaAvailable().ToString().c_str());
  return 0;
}

}  // namespace
}  // namespace moe::tools

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Measures PCIe gather and CPU expert bandwidth with both paths busy at once and writes the "
      "hybrid-split profile.\n  bandwidth_probe [--out=FILE] [--seconds=3] [--threads=N]");
  absl::ParseCommandLine(argc, argv);
  return moe::tools::Main();
}
