// handoff_bench: what the hybrid handoff costs per MoE layer inside a captured decode step, on the
// GPU machine. A graph of 48 layers, each posting one token's routes and waiting for the answer
// (batch 1, hidden 2048, top-8), replayed many times in three variants:
//   empty:   the same graph without the handoff kernels (the floor: graph launch alone);
//   no-cpu:  the kernels run but no route goes to the CPU (post and wait return at once);
//   one-cpu: one route per layer goes to the CPU, whose compute returns at once: the full round
//            trip (GPU writes, CPU sees the request, answers, GPU sees the answer and adds).
// Prints the median per layer of each over the empty graph.
//
//   handoff_bench [--replays 300]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "engine/cuda/hybrid/handoff_kernels.h"
#include "moe_cache/policy_core.h"

ABSL_FLAG(int, replays, 300, "graph replays per variant");

namespace moe::engine::hybrid {
namespace {

constexpr int kLayers = 48, kTopK = 8, kHidden = 2048;

int Main() {
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  int32_t *ids, *slots_cpu, *slots_gpu;
  float *w, *x, *y;
  cudaMalloc(&ids, kTopK * 4);
  cudaMalloc(&slots_cpu, kTopK * 4);
  cudaMalloc(&slots_gpu, kTopK * 4);
  cudaMalloc(&w, kTopK * 4);
  cudaMalloc(&x, kHidden * 4);
  cudaMalloc(&y, kHidden * 4);
  std::vector<int32_t> h_ids(kTopK), h_cpu(kTopK), h_gpu(kTopK);
  for (int j = 0; j < kTopK; ++j) {
    h_ids[j] = j;
    h_gpu[j] = j;
    h_cpu[j] = j == 0 ? moe_cache::kCpuSlot : j;
  }
  cudaMemcpy(ids, h_ids.data(), kTopK * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(slots_cpu, h_cpu.data(), kTopK * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(slots_gpu, h_gpu.data(), kTopK * 4, cudaMemcpyHostToDevice);
  cudaMemset(w, 0, kTopK * 4);
  cudaMemset(x, 0, kHidden * 4);
  cudaMemset(y, 0, kHidden * 4);
  auto h = GpuHandoff::Create({1, kTopK, kHidden},
                              [](int, int, const int32_t*, const float*, const float*, float*) {
                                return absl::OkStatus();
                              });
  if (!h.ok()) {
    std::fprintf(stderr, "%s\n", h.status().ToString().c_str());
    return 1;
  }
  // A small kernel per layer in every variant stands for the layer's own work.
  auto capture = [&](int variant) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int l = 0; l < kLayers; ++l) {
      cudaMemsetAsync(y, 0, 4, s);
      if (variant > 0) {
        (void)(*h)->Post(l, 1, ids, variant == 2 ? slots_cpu : slots_gpu, w, x, s);
        (void)(*h)->WaitAndAdd(1, y, s);
      }
    }
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&e, g, 0);
    cudaGraphDestroy(g);
    return e;
  };
  const char* names[] = {"empty", "no-cpu", "one-cpu"};
  cudaGraphExec_t execs[3] = {capture(0), capture(1), capture(2)};
  const int replays = absl::GetFlag(FLAGS_replays);
  std::vector<double> ms[3];
  (*h)->Arm();
  for (int r = 0; r < replays + 10; ++r) {
    for (int v = 0; v < 3; ++v) {  // rotated order, warm-up first
      const int vv = (v + r) % 3;
      const auto t0 = std::chrono::steady_clock::now();
      cudaGraphLaunch(execs[vv], s);
      cudaStreamSynchronize(s);
      const double t = std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - t0)
                           .count();
      if (r >= 10) ms[vv].push_back(t);
    }
  }
  (*h)->Disarm();
  const absl::Status err = (*h)->TakeError();
  if (!err.ok()) {
    std::fprintf(stderr, "%s\n", err.ToString().c_str());
    return 1;
  }
  double med[3];
  for (int v = 0; v < 3; ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    med[v] = ms[v][ms[v].size() / 2];
    std::printf("%-8s %8.3f ms per %d-layer step (median of %d)\n", names[v], med[v], kLayers,
                replays);
  }
  std::printf("handoff kernels without CPU work: %.2f us per layer; full round trip to the CPU "
              "worker: %.2f us per layer (requests answered: %lld)\n",
              (med[1] - med[0]) * 1e3 / kLayers, (med[2] - med[0]) * 1e3 / kLayers,
              static_cast<long long>((*h)->worker().requests()));
  return 0;
}

}  // namespace
}  // namespace moe::engine::hybrid

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moe::engine::hybrid::Main();
}
