// Benchmark of copy_missing on a GPU machine, held against the host link measured in the same
// run: for each miss count, per-expert cudaMemcpyAsync H2D (the reference) and the one-launch
// gather kernel at a sweep of grid sizes, interleaved rep by rep, medians reported, with the
// fraction of memcpy bandwidth and the smallest grid that reaches the target fraction. Then
// ensure_experts + copy_missing for one layer at batch 1 with 8 misses.
//
//   gather_bench --misses=1,2,4,8,28 --blocks=4,8,16,28,32,64,132 --json=/tmp/gather.json
//
// Expert shape defaults to Qwen3-30B-A3B in bf16 (gate_up 2*768*2048*2 B, down 2048*768*2 B).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "moe_cache/gpu/ensure_kernels.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(int, store_experts, 256, "experts in the host store (rotated through, >> GPU L2)");
ABSL_FLAG(uint64_t, gate_up_bytes, 2ull * 768 * 2048 * 2, "gate_up bank bytes per expert");
ABSL_FLAG(uint64_t, down_bytes, 2048ull * 768 * 2, "down bank bytes per expert");
ABSL_FLAG(std::string, misses, "1,2,4,8,28", "miss counts to measure");
ABSL_FLAG(std::string, blocks, "4,8,16,28,32,64,132", "gather grid sizes to sweep");
ABSL_FLAG(int, threads, 512, "threads per gather block");
ABSL_FLAG(int, reps, 15, "timed repetitions per case (after 3 warm-ups)");
ABSL_FLAG(double, target_fraction, 0.92, "fraction of memcpy bandwidth the gather must reach");
ABSL_FLAG(std::string, json, "", "also write one JSON object per case to this file");

namespace moe::moe_cache {
namespace {

#if MOE_HAVE_CUDA
#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));             \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

#define CHECK_OK(x)                                                                    \
  do {                                                                                 \
    absl::Status s_ = (x);                                                             \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "%s failed: %s\n", #x, s_.ToString().c_str());              \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    out.push_back(std::stoi(std::string(p)));
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  float Ms() {
    float ms = 0;
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

int Main() {
  const uint64_t gu = absl::GetFlag(FLAGS_gate_up_bytes), dn = absl::GetFlag(FLAGS_down_bytes);
  auto layout = BankLayout::Create({{"gate_up", gu}, {"down", dn}});
  CHECK_OK(layout.status());
  const int store_experts = absl::GetFlag(FLAGS_store_experts);
  const std::vector<int> misses = ParseInts(absl::GetFlag(FLAGS_misses));
  const std::vector<int> blocks = ParseInts(absl::GetFlag(FLAGS_blocks));
  const int max_miss = *std::max_element(misses.begin(), misses.end());
  const int reps = absl::GetFlag(FLAGS_reps);

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; expert %.2f MB (gate_up %lu + down %lu B); store %d experts "
              "(%.1f GB pinned-mapped)\n",
              prop.name, prop.multiProcessorCount, layout->bytes_per_expert() / 1e6,
              static_cast<unsigned long>(gu), static_cast<unsigned long>(dn), store_experts,
              store_experts * layout->padded_bytes_per_expert() / 1e9);

  auto store = ExpertStore::Create({1, store_experts, true}, *layout);
  CHECK_OK(store.status());
  // Non-zero, non-repeating contents (zeros can take faster paths).
  for (int b = 0; b < layout->num_banks(); ++b) {
    uint64_t* p = reinterpret_cast<uint64_t*>(const_cast<uint8_t*>((*store)->bank_host(b)));
    const uint64_t n = store_experts * layout->bank(b).pitch / 8;
    for (uint64_t i = 0; i < n; ++i) p[i] = i * 0x9E3779B97F4A7C15ull;
  }
  auto pool = SlotPool::Create(std::max(max_miss, 32), *layout);
  CHECK_OK(pool.status());
  auto desc = MakeGatherDescriptor(**store, **pool);
  CHECK_OK(desc.status());
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int32_t* d_count;
  MissPlanEntry* d_plan;
  CHECK_CUDA(cudaMalloc(&d_count, sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * 1024));
  int32_t* h_count;
  MissPlanEntry* h_plan;
  CHECK_CUDA(cudaMallocHost(&h_count, sizeof(int32_t)));
  CHECK_CUDA(cudaMallocHost(&h_plan, sizeof(MissPlanEntry) * 1024));

  // The link's ceiling: one large pinned H2D copy.
  {
    const uint64_t bytes = std::min<uint64_t>(
        2300000000ull, static_cast<uint64_t>(store_experts) * layout->bank(0).pitch);
    void* dst;
    CHECK_CUDA(cudaMalloc(&dst, bytes));
    std::vector<double> gbps;
    Timer t;
    for (int r = 0; r < 5; ++r) {
      CHECK_CUDA(cudaEventRecord(t.a, stream));
      CHECK_CUDA(cudaMemcpyAsync(dst, (*store)->bank_host(0), bytes, cudaMemcpyHostToDevice,
                                 stream));
      CHECK_CUDA(cudaEventRecord(t.b, stream));
      if (r >= 1) gbps.push_back(bytes / (t.Ms() * 1e6));
      else t.Ms();
    }
    std::printf("host link: one %.2f GB cudaMemcpyAsync H2D: %.1f GB/s (median of 4)\n",
                bytes / 1e9, Median(gbps));
    CHECK_CUDA(cudaFree(dst));
  }

  FILE* json = nullptr;
  if (!absl::GetFlag(FLAGS_json).empty()) json = std::fopen(absl::GetFlag(FLAGS_json).c_str(), "w");
  std::mt19937 rng(1);
  int next_expert = 0;
  auto make_plan = [&](int m) {
    // Rotate through the store so no row is re-read while it could still sit in a cache.
    for (int i = 0; i < m; ++i) {
      h_plan[i] = {next_expert, i};
      next_expert = (next_expert + 1) % store_experts;
    }
    *h_count = m;
  };

  std::printf("\n%6s %12s %8s %10s %8s %8s\n", "misses", "path", "blocks", "GB/s", "of_memcpy",
              "us");
  const double target = absl::GetFlag(FLAGS_target_fraction);
  for (int m : misses) {
    const double bytes = static_cast<double>(m) * layout->padded_bytes_per_expert();
    std::vector<double> memcpy_ms;
    std::vector<std::vector<double>> kernel_ms(blocks.size());
    Timer t;
    for (int r = 0; r < reps + 3; ++r) {
      // Rotate the order of the paths each rep so neither always runs first.
      const int n_paths = 1 + static_cast<int>(blocks.size());
      for (int k = 0; k < n_paths; ++k) {
        const int path = (k + r) % n_paths;
        make_plan(m);
        CHECK_CUDA(cudaMemcpyAsync(d_count, h_count, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
        CHECK_CUDA(cudaMemcpyAsync(d_plan, h_plan, sizeof(MissPlanEntry) * m,
                                   cudaMemcpyHostToDevice, stream));
        CHECK_CUDA(cudaEventRecord(t.a, stream));
        if (path == 0) {
          CHECK_OK(CopyMissingMemcpy(*desc, h_plan, m, stream));
        } else {
          CHECK_OK(LaunchCopyMissing(*desc, d_count, d_plan,
                                     {blocks[path - 1], absl::GetFlag(FLAGS_threads)}, stream));
        }
        CHECK_CUDA(cudaEventRecord(t.b, stream));
        const double ms = t.Ms();
        if (r < 3) continue;
        (path == 0 ? memcpy_ms : kernel_ms[path - 1]).push_back(ms);
      }
    }
    const double mc = bytes / (Median(memcpy_ms) * 1e6);
    std::printf("%6d %12s %8s %10.1f %8.3f %8.0f\n", m, "memcpy", "-", mc, 1.0,
                Median(memcpy_ms) * 1e3);
    if (json) {
      std::fprintf(json,
                   "{\"misses\": %d, \"path\": \"memcpy\", \"gbps\": %.3f, \"us\": %.1f}\n", m, mc,
                   Median(memcpy_ms) * 1e3);
    }
    int smallest = -1;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const double g = bytes / (Median(kernel_ms[i]) * 1e6);
      if (smallest < 0 && g >= target * mc) smallest = blocks[i];
      std::printf("%6d %12s %8d %10.1f %8.3f %8.0f\n", m, "gather", blocks[i], g, g / mc,
                  Median(kernel_ms[i]) * 1e3);
      if (json) {
        std::fprintf(json,
                     "{\"misses\": %d, \"path\": \"gather\", \"blocks\": %d, \"gbps\": %.3f, "
                     "\"fraction_of_memcpy\": %.4f, \"us\": %.1f}\n",
                     m, blocks[i], g, g / mc, Median(kernel_ms[i]) * 1e3);
      }
    }
    std::printf("%6d smallest grid reaching %.0f%% of memcpy: %s\n", m, target * 100,
                smallest < 0 ? "none" : std::to_string(smallest).c_str());
  }

  // ensure_experts + copy_missing, one layer, batch 1, 8 misses, cache of 10% of 48 x 128.
  {
    constexpr int kLayers = 2, kExperts = 128, kTopK = 8;
    const int slots = 614;
    auto state = DeviceCacheState::Create(kLayers, kExperts, slots, DefaultPolicyParams(kPolicyScored));
    CHECK_OK(state.status());
    int32_t *d_ids, *d_slots;
    CHECK_CUDA(cudaMalloc(&d_ids, sizeof(int32_t) * kTopK));
    CHECK_CUDA(cudaMalloc(&d_slots, sizeof(int32_t) * kTopK));
    auto big_pool = SlotPool::Create(slots, *layout);
    CHECK_OK(big_pool.status());
    auto store2 = ExpertStore::Create({kLayers, kExperts, true}, *layout);
    CHECK_OK(store2.status());
    auto desc2 = MakeGatherDescriptor(**store2, **big_pool);
    CHECK_OK(desc2.status());
    std::vector<double> ensure_us, copy_us, both_us;
    Timer t1, t2;
    int32_t ids[kTopK];
    for (int r = 0; r < 40; ++r) {
      // Fresh experts each call so all 8 miss (slots fill, then victims are chosen).
      for (int i = 0; i < kTopK; ++i) ids[i] = (r * kTopK + i) % kExperts;
      const int layer = (r * kTopK / kExperts) % kLayers;
      CHECK_CUDA(cudaMemcpyAsync(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice, stream));
      CHECK_CUDA(cudaEventRecord(t1.a, stream));
      CHECK_OK(LaunchEnsureExperts((*state)->view(), layer, d_ids, kTopK, d_slots, d_count, d_plan,
                                   stream));
      CHECK_CUDA(cudaEventRecord(t1.b, stream));
      CHECK_CUDA(cudaEventRecord(t2.a, stream));
      CHECK_OK(LaunchCopyMissing(*desc2, d_count, d_plan, {16, 512}, stream));
      CHECK_CUDA(cudaEventRecord(t2.b, stream));
      const double e = t1.Ms() * 1e3, c = t2.Ms() * 1e3;
      float both = 0;
      CHECK_CUDA(cudaEventElapsedTime(&both, t1.a, t2.b));
      if (r >= 5) {
        ensure_us.push_back(e);
        copy_us.push_back(c);
        both_us.push_back(both * 1e3);
      }
    }
    std::printf("\nensure_experts + copy_missing, one layer, batch 1, 8 misses, %d slots: "
                "ensure %.1f us, copy %.1f us (%.1f GB/s), both %.1f us; copy share %.1f%%\n",
                slots, Median(ensure_us), Median(copy_us),
                8 * layout->padded_bytes_per_expert() / (Median(copy_us) * 1e3), Median(both_us),
                100.0 * Median(copy_us) / Median(both_us));
    if (json) {
      std::fprintf(json,
                   "{\"case\": \"ensure_plus_copy\", \"misses\": 8, \"ensure_us\": %.2f, "
                   "\"copy_us\": %.2f, \"total_us\": %.2f}\n",
                   Median(ensure_us), Median(copy_us), Median(both_us));
    }
  }
  if (json) std::fclose(json);
  return 0;
}
#else
int Main() {
  std::fprintf(stderr, "gather_bench: built without CUDA\n");
  return 1;
}
#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::moe_cache

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::moe_cache::Main();
}
