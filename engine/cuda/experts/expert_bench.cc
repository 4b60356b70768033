// Benchmark of the GPU routed experts of one MoE layer on a GPU machine, held against the
// device-to-device copy bandwidth measured in the same run.
//
// The pool holds `slot_sets` layers' worth of experts (E slots each); each call's routes (random
// top-k of E per token) go to the next set, so consecutive calls read different memory and the
// L2 (60 MB on an H200) cannot hold the weights. Per case: median time of single calls on a
// stream (CUDA events around each, after warm-ups), and the time per call of a captured graph of
// one call per route set (median over replays), which is how decode runs. Bandwidth counts the
// distinct experts' bytes a call must read (each slot once, every bank of the format: codes,
// fp8_block's block scales, nvfp4's global scales), against D2D bandwidth as
// (bytes read + bytes written) / time of one large cudaMemcpyAsync, and against the HBM's peak
// (2 x memory clock x bus width, from the device's attributes).
//
//   expert_bench --formats=bf16,q4_0,fp8_block,nvfp4 --tokens=1,8,32 --json=/tmp/experts.json
//
// Shape defaults to Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "engine/cuda/experts/expert_test_util.h"
#include "engine/cuda/experts/routed_experts.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, formats, "bf16,q4_0,fp8_block,nvfp4",
          "weight formats (bf16, q4_0, fp8_block, nvfp4)");
ABSL_FLAG(std::string, tokens, "1,8,32", "tokens per call (T)");
ABSL_FLAG(std::string, grouping, "auto", "auto, per_route, by_slot, or all");
ABSL_FLAG(int, hidden, 2048, "H");
ABSL_FLAG(int, intermediate, 768, "I");
ABSL_FLAG(int, experts, 128, "routed experts per layer (E)");
ABSL_FLAG(int, top_k, 8, "k");
ABSL_FLAG(int, slot_sets, 8, "layers' worth of slots (E each) rotated through");
ABSL_FLAG(int, route_sets, 16, "distinct route sets per case (one per graph call)");
ABSL_FLAG(int, reps, 200, "timed single calls per case (after 10 warm-ups)");
ABSL_FLAG(int, graph_reps, 30, "timed graph replays per case");
ABSL_FLAG(std::string, json, "", "also write one JSON object per case to this file");

namespace moe::engine::gpu {
namespace {

#if MOE_HAVE_CUDA
#define CHECK_CUDA(x)                                                      \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

#define CHECK_OK(x)                                                           \
  do {                                                                        \
    absl::Status s_ = (x);                                                    \
    if (!s_.ok()) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #x, s_.ToString().c_str());     \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// D2D copy bandwidth, (read + written) bytes / time, median of 10 copies of 1 GiB.
double MeasureD2D(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 13; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms * 1e-3);
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / Median(t);
}

const char* Name(RouteGrouping g) {
  return g == RouteGrouping::kAuto ? "auto" : g == RouteGrouping::kPerRoute ? "per_route"
                                                                           : "by_slot";
}

struct Result {
  double eager_s = 0, graph_s = 0, bytes = 0;
};

int Main() {
  const int H = absl::GetFlag(FLAGS_hidden), I = absl::GetFlag(FLAGS_intermediate);
  const int E = absl::GetFlag(FLAGS_experts), k = absl::GetFlag(FLAGS_top_k);
  const int sets = absl::GetFlag(FLAGS_slot_sets), R = absl::GetFlag(FLAGS_route_sets);
  const int reps = absl::GetFlag(FLAGS_reps), graph_reps = absl::GetFlag(FLAGS_graph_reps);
  if (E < k || sets < 1 || R < 1 || reps < 1 || graph_reps < 1) {
    std::fprintf(stderr, "bad flags: need experts >= top_k and positive counts\n");
    return 1;
  }
  std::vector<int> token_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty())) {
    token_counts.push_back(std::stoi(std::string(s)));
  }
  std::vector<RouteGrouping> groupings;
  const std::string gflag = absl::GetFlag(FLAGS_grouping);
  if (gflag == "auto" || gflag == "all") groupings.push_back(RouteGrouping::kAuto);
  if (gflag == "per_route" || gflag == "all") groupings.push_back(RouteGrouping::kPerRoute);
  if (gflag == "by_slot" || gflag == "all") groupings.push_back(RouteGrouping::kBySlot);
  if (groupings.empty()) {
    std::fprintf(stderr, "--grouping: auto, per_route, by_slot or all\n");
    return 1;
  }
  int max_t = 1;
  for (int T : token_counts) max_t = std::max(max_t, T);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double d2d = MeasureD2D(stream);
  int mem_khz = 0, bus_bits = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
  const double peak = 2.0 * mem_khz * 1e3 * bus_bits / 8;
  std::printf(
      "device %s, %d SMs, L2 %.0f MB; D2D copy (read + write) %.0f GB/s; HBM peak %.0f GB/s\n",
      prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, d2d / 1e9, peak / 1e9);
  std::printf("H=%d I=%d E=%d k=%d, %d slot sets, %d route sets\n\n", H, I, E, k, sets, R);
  std::printf("%-9s %4s %-9s %10s %10s %10s %10s %8s %8s\n", "format", "T", "grouping", "eager_us",
              "graph_us", "MB/call", "GB/s", "of_D2D", "of_peak");
  FILE* json = nullptr;
  if (!absl::GetFlag(FLAGS_json).empty()) {
    json = std::fopen(absl::GetFlag(FLAGS_json).c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", absl::GetFlag(FLAGS_json).c_str());
      return 1;
    }
  }

  for (absl::string_view fname : absl::StrSplit(absl::GetFlag(FLAGS_formats), ',',
                                                absl::SkipEmpty())) {
    absl::StatusOr<common::WeightFormat> format = common::ParseWeightFormat(std::string_view(fname.data(), fname.size()));
    CHECK_OK(format.status());
    // A few distinct experts, copied into every slot of every set.
    constexpr int kDistinct = 4;
    absl::StatusOr<TestExperts> experts = MakeTestExperts(*format, kDistinct, H, I, 7);
    CHECK_OK(experts.status());
    std::vector<int> placement(sets * E);
    for (int s = 0; s < sets * E; ++s) placement[s] = s < kDistinct ? s : -1;
    absl::StatusOr<std::unique_ptr<moe_cache::SlotPool>> pool = MakeSlotPool(*experts, placement);
    CHECK_OK(pool.status());
    absl::StatusOr<SlotBanks> banks = SlotBanksFromPool(**pool, *format, H, I);
    CHECK_OK(banks.status());
    // Every bank of the format (MakeSlotPool's bank b is experts->banks[b]).
    const moe_cache::BankLayout& layout = (*pool)->layout();
    for (int s = kDistinct; s < sets * E; ++s) {
      for (int b = 0; b < layout.num_banks(); ++b) {
        const uint64_t pitch = layout.bank(b).pitch;
        CHECK_CUDA(cudaMemcpy((*pool)->bank(b) + s * pitch,
                              (*pool)->bank(b) + (s % kDistinct) * pitch, layout.bank(b).bytes,
                              cudaMemcpyDeviceToDevice));
      }
    }
    const double expert_bytes = static_cast<double>(experts->BytesPerExpert());
    std::printf("%s: %.0f bytes per expert (", std::string(fname).c_str(), expert_bytes);
    for (size_t b = 0; b < experts->banks.size(); ++b) {
      std::printf("%s%s %llu", b ? ", " : "", experts->banks[b].name.c_str(),
                  static_cast<unsigned long long>(experts->banks[b].bytes));
    }
    std::printf(")\n");
    absl::StatusOr<std::unique_ptr<ExpertWorkspace>> ws =
        ExpertWorkspace::Create({max_t, k, H, I, E});
    CHECK_OK(ws.status());

    for (int T : token_counts) {
      // R route sets: per token k distinct experts of E, in slot set r % sets.
      std::mt19937 rng(1000 + T);
      std::vector<int32_t*> slot_dev(R);
      float *x = nullptr, *w = nullptr, *y = nullptr;
      CHECK_CUDA(cudaMalloc(&x, sizeof(float) * T * H));
      CHECK_CUDA(cudaMalloc(&y, sizeof(float) * T * H));
      CHECK_CUDA(cudaMalloc(&w, sizeof(float) * T * k));
      std::vector<float> host(T * H);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (float& v : host) v = u(rng);
      CHECK_CUDA(cudaMemcpy(x, host.data(), sizeof(float) * T * H, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemset(y, 0, sizeof(float) * T * H));
      std::vector<float> wh(T * k, 1.0f / k);
      CHECK_CUDA(cudaMemcpy(w, wh.data(), sizeof(float) * T * k, cudaMemcpyHostToDevice));
      double distinct_bytes = 0;
      for (int r = 0; r < R; ++r) {
        std::vector<int32_t> ids(T * k);
        std::set<int32_t> distinct;
        std::vector<int> perm(E);
        for (int t = 0; t < T; ++t) {
          for (int e = 0; e < E; ++e) perm[e] = e;
          for (int j = 0; j < k; ++j) {
            std::swap(perm[j], perm[j + rng() % (E - j)]);
            ids[t * k + j] = (r % sets) * E + perm[j];
            distinct.insert(ids[t * k + j]);
          }
        }
        distinct_bytes += distinct.size() * expert_bytes / R;
        CHECK_CUDA(cudaMalloc(&slot_dev[r], sizeof(int32_t) * T * k));
        CHECK_CUDA(cudaMemcpy(slot_dev[r], ids.data(), sizeof(int32_t) * T * k,
                              cudaMemcpyHostToDevice));
      }

      for (RouteGrouping g : groupings) {
        Result res;
        res.bytes = distinct_bytes;
        // Single calls.
        for (int i = 0; i < 10; ++i) {
          CHECK_OK(LaunchRoutedExperts(*banks, **ws, T, x, slot_dev[i % R], w, y, stream, g));
        }
        std::vector<cudaEvent_t> ev(2 * reps);
        for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreate(&e));
        for (int i = 0; i < reps; ++i) {
          CHECK_CUDA(cudaEventRecord(ev[2 * i], stream));
          CHECK_OK(LaunchRoutedExperts(*banks, **ws, T, x, slot_dev[i % R], w, y, stream, g));
          CHECK_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
        std::vector<double> t;
        for (int i = 0; i < reps; ++i) {
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
          t.push_back(ms * 1e-3);
        }
        res.eager_s = Median(t);
        // One graph of R calls, one per route set.
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < R; ++r) {
          CHECK_OK(LaunchRoutedExperts(*banks, **ws, T, x, slot_dev[r], w, y, stream, g));
        }
        CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
        CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
        t.clear();
        for (int i = 0; i < graph_reps; ++i) {
          CHECK_CUDA(cudaEventRecord(ev[0], stream));
          CHECK_CUDA(cudaGraphLaunch(exec, stream));
          CHECK_CUDA(cudaEventRecord(ev[1], stream));
          CHECK_CUDA(cudaEventSynchronize(ev[1]));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, ev[0], ev[1]));
          t.push_back(ms * 1e-3 / R);
        }
        res.graph_s = Median(t);
        CHECK_CUDA(cudaGraphExecDestroy(exec));
        CHECK_CUDA(cudaGraphDestroy(graph));
        for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventDestroy(e));

        const double gbs = res.bytes / res.graph_s / 1e9;
        std::printf("%-9s %4d %-9s %10.1f %10.1f %10.1f %10.0f %7.1f%% %7.1f%%\n",
                    std::string(fname).c_str(), T, Name(g), res.eager_s * 1e6, res.graph_s * 1e6,
                    res.bytes / 1e6, gbs, 100.0 * gbs * 1e9 / d2d, 100.0 * gbs * 1e9 / peak);
        if (json) {
          std::fprintf(json,
                       "{\"format\":\"%s\",\"tokens\":%d,\"grouping\":\"%s\",\"hidden\":%d,"
                       "\"intermediate\":%d,\"experts\":%d,\"top_k\":%d,\"eager_us\":%.2f,"
                       "\"graph_us\":%.2f,\"bytes_per_expert\":%.0f,\"distinct_bytes\":%.0f,"
                       "\"gbps\":%.1f,\"d2d_gbps\":%.1f,\"fraction_of_d2d\":%.4f,"
                       "\"hbm_peak_gbps\":%.1f,\"fraction_of_peak\":%.4f,\"device\":\"%s\"}\n",
                       std::string(fname).c_str(), T, Name(g), H, I, E, k, res.eager_s * 1e6,
                       res.graph_s * 1e6, expert_bytes, res.bytes, gbs, d2d / 1e9, gbs * 1e9 / d2d,
                       peak / 1e9, gbs * 1e9 / peak, prop.name);
        }
      }
      for (int32_t* p : slot_dev) CHECK_CUDA(cudaFree(p));
      CHECK_CUDA(cudaFree(x));
      CHECK_CUDA(cudaFree(y));
      CHECK_CUDA(cudaFree(w));
    }
  }
  if (json) std::fclose(json);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
#else
int Main() {
  std::fprintf(stderr, "expert_bench: built without CUDA\n");
  return 1;
}
#endif

}  // namespace
}  // namespace moe::engine::gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::engine::gpu::Main();
}
