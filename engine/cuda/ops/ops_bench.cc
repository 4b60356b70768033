// DenseGemm at Qwen3-30B-A3B's dense shapes (q/k/v/o, router, LM head) at T = 1 and 8 on the GPU
// machine: median time per call (CUDA events), weight bytes / time, and that as a fraction of the
// device-to-device copy bandwidth (read + write bytes / time) measured in the same run. Weights
// rotate through enough copies to exceed the L2 cache, so every call reads them from HBM.
//
//   ops_bench --tokens=1,8 --reps=50 --json=/tmp/ops_bench.json
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "engine/cuda/ops/gemm.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/ops/ops_test_util.h"
#endif

ABSL_FLAG(std::string, tokens, "1,8", "token counts T to measure");
ABSL_FLAG(int, reps, 50, "timed calls per case (after 5 warm-ups)");
ABSL_FLAG(uint64_t, rotate_bytes, 512ull << 20, "weight bytes to rotate through (>> L2)");
ABSL_FLAG(std::string, json, "", "also write the results to this file as a JSON array");

namespace moe::engine::gpu {
namespace {

#if MOE_HAVE_CUDA
using testing::CheckCuda;

struct Shape {
  const char* name;
  int n, k;
};

// Qwen3-30B-A3B: hidden 2048, 32 q heads and 4 kv heads of 128, 128 experts, vocab 151936.
constexpr Shape kShapes[] = {
    {"q_proj", 4096, 2048}, {"k_proj", 512, 2048}, {"v_proj", 512, 2048},
    {"o_proj", 2048, 4096}, {"router", 128, 2048}, {"lm_head", 151936, 2048},
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device-to-device copy of 1 GiB: (read + write) bytes / median time, in GB/s.
double CopyBandwidth(cudaStream_t s, int reps) {
  const size_t bytes = 1ull << 30;
  void *a = nullptr, *b = nullptr;
  CheckCuda(cudaMalloc(&a, bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&b, bytes), "cudaMalloc");
  CheckCuda(cudaMemset(a, 1, bytes), "memset");
  cudaEvent_t e0, e1;
  CheckCuda(cudaEventCreate(&e0), "event");
  CheckCuda(cudaEventCreate(&e1), "event");
  std::vector<double> ms;
  for (int r = 0; r < reps + 2; ++r) {
    CheckCuda(cudaEventRecord(e0, s), "record");
    CheckCuda(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
    CheckCuda(cudaEventRecord(e1, s), "record");
    CheckCuda(cudaEventSynchronize(e1), "sync");
    float t = 0;
    CheckCuda(cudaEventElapsedTime(&t, e0, e1), "elapsed");
    if (r >= 2) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (Median(ms) * 1e-3) / 1e9;
}

int Run() {
  std::vector<int> tokens;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty())) {
    tokens.push_back(std::stoi(std::string(p)));
  }
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  cudaStream_t s = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  auto gemm_or = DenseGemm::Create(s);
  if (!gemm_or.ok()) {
    std::fprintf(stderr, "%s\n", gemm_or.status().ToString().c_str());
    return 1;
  }
  DenseGemm& gemm = **gemm_or;
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "properties");
  const double copy_gbs = CopyBandwidth(s, reps);
  std::printf("device %s, %d SMs, L2 %d MB; D2D copy (read + write) %.0f GB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_gbs);
  std::printf("%-8s %6s %6s %3s %10s %10s %8s\n", "op", "N", "K", "T", "median_us", "GB/s",
              "of_copy");

  FILE* json = nullptr;
  if (!absl::GetFlag(FLAGS_json).empty()) {
    json = std::fopen(absl::GetFlag(FLAGS_json).c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", absl::GetFlag(FLAGS_json).c_str());
      return 1;
    }
    std::fprintf(json, "[\n");
  }
  bool first = true;
  testing::Rng rng(1);
  cudaEvent_t e0, e1;
  CheckCuda(cudaEventCreate(&e0), "event");
  CheckCuda(cudaEventCreate(&e1), "event");
  for (const Shape& sh : kShapes) {
    const size_t wbytes = static_cast<size_t>(sh.n) * sh.k * 2;
    const size_t copies =
        std::max<size_t>(1, (absl::GetFlag(FLAGS_rotate_bytes) + wbytes - 1) / wbytes);
    // Random weights (the values do not change the time, but keep them finite).
    testing::DeviceArray<uint16_t> w(copies * wbytes / 2);
    {
      const std::vector<uint16_t> one = testing::RandomBf16(rng, wbytes / 2, -0.05f, 0.05f);
      for (size_t c = 0; c < copies; ++c) {
        CheckCuda(
            cudaMemcpy(w.get() + c * (wbytes / 2), one.data(), wbytes, cudaMemcpyHostToDevice),
            "upload");
      }
    }
    for (int T : tokens) {
      testing::DeviceArray<uint16_t> x(
          testing::RandomBf16(rng, static_cast<size_t>(T) * sh.k, -1, 1));
      testing::DeviceArray<float> y(static_cast<size_t>(T) * sh.n);
      GemmArgs a;
      a.x = x.get();
      a.y = y.get();
      a.rows = T;
      a.n = sh.n;
      a.k = sh.k;
      std::vector<double> us;
      for (int r = 0; r < reps + 5; ++r) {
        a.w = w.get() + (r % copies) * (wbytes / 2);
        CheckCuda(cudaEventRecord(e0, s), "record");
        const absl::Status st = gemm.Run(a);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
        CheckCuda(cudaEventRecord(e1, s), "record");
        CheckCuda(cudaEventSynchronize(e1), "sync");
        float ms = 0;
        CheckCuda(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
        if (r >= 5) us.push_back(ms * 1e3);
      }
      const double med = Median(us);
      const double gbs = wbytes / (med * 1e-6) / 1e9;
      std::printf("%-8s %6d %6d %3d %10.2f %10.0f %7.1f%%\n", sh.name, sh.n, sh.k, T, med, gbs,
                  100.0 * gbs / copy_gbs);
      if (json != nullptr) {
        std::fprintf(json,
                     "%s  {\"op\": \"%s\", \"n\": %d, \"k\": %d, \"tokens\": %d, \"median_us\": "
                     "%.3f, \"weight_gbs\": %.1f, \"copy_gbs\": %.1f, \"fraction_of_copy\": "
                     "%.4f, \"device\": \"%s\"}",
                     first ? "" : ",\n", sh.name, sh.n, sh.k, T, med, gbs, copy_gbs, gbs / copy_gbs,
                     prop.name);
        first = false;
      }
    }
  }
  if (json != nullptr) {
    std::fprintf(json, "\n]\n");
    std::fclose(json);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  gemm_or->reset();
  cudaStreamDestroy(s);
  return 0;
}
#else
int Run() {
  std::fprintf(stderr, "ops_bench: built without CUDA\n");
  return 1;
}
#endif

}  // namespace
}  // namespace moe::engine::gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::engine::gpu::Run();
}
