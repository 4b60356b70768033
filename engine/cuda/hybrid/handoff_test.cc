// The hybrid handoff on the GPU: captured steps that hand routes to a CPU worker and add its
// answer, checked row by row; the same without the wait (a negative control that must see
// mismatches); a CPU worker that does not answer in time; a compute error reaching the host.
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/gpu_test_util.h"
#include "engine/cuda/hybrid/handoff_kernels.h"
#include "engine/cuda/hybrid/handoff_test_kernels.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::engine::hybrid {
namespace {

#if MOE_HAVE_CUDA

constexpr int kRows = 4, kTopK = 4, kHidden = 256;

// The CPU side of SyntheticStep: sum over the CPU routes of weight * (x + expert id), after
// spinning `delay_us` (to make a missing wait observable).
HandoffCompute SyntheticCompute(int delay_us) {
  return [delay_us](int, int tokens, const int32_t* ids, const float* w, const float* x,
                    float* y) {
    if (delay_us > 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(delay_us);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    for (int t = 0; t < tokens; ++t) {
      for (int c = 0; c < kHidden; ++c) {
        float s = 0.0f;
        for (int j = 0; j < kTopK; ++j) {
          const int e = ids[t * kTopK + j];
          if (e >= 0) s += w[t * kTopK + j] * (x[t * kHidden + c] + static_cast<float>(e));
        }
        y[t * kHidden + c] = s;
      }
    }
    return absl::OkStatus();
  };
}

struct Buffers {
  Buffers() {
    s.rows = kRows;
    s.top_k = kTopK;
    s.hidden = kHidden;
    EXPECT_EQ(cudaMalloc(&s.ids, sizeof(int32_t) * kRows * kTopK), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&s.slot_ids, sizeof(int32_t) * kRows * kTopK), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&s.weights, sizeof(float) * kRows * kTopK), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&s.x, sizeof(float) * kRows * kHidden), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&s.y, sizeof(float) * kRows * kHidden), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&s.step, 8), cudaSuccess);
    s.mismatches = s.step + 1;
    EXPECT_EQ(cudaMemset(s.step, 0, 8), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Buffers() {
    cudaFree(s.ids);
    cudaFree(s.slot_ids);
    cudaFree(s.weights);
    cudaFree(s.x);
    cudaFree(s.y);
    cudaFree(s.step);
    cudaStreamDestroy(stream);
  }
  uint32_t Mismatches() {
    uint32_t m = 0;
    EXPECT_EQ(cudaMemcpy(&m, s.mismatches, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return m;
  }
  SyntheticStep s;
  cudaStream_t stream = nullptr;
};

// Captures produce -> post -> (wait and) add -> check, `layers` times per step, into a graph.
cudaGraphExec_t CaptureStep(Buffers& b, GpuHandoff& h, int layers, bool wait) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (int l = 0; l < layers; ++l) {
    EXPECT_TRUE(LaunchProduce(b.s, b.stream).ok());
    EXPECT_TRUE(h.Post(l, kRows, b.s.ids, b.s.slot_ids, b.s.weights, b.s.x, b.stream).ok());
    EXPECT_TRUE(h.WaitAndAdd(kRows, b.s.y, b.stream, wait).ok());
    EXPECT_TRUE(LaunchCheck(b.s, b.stream).ok());
  }
  EXPECT_EQ(cudaStreamEndCapture(b.stream, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  return exec;
}

TEST(HandoffTest, TenThousandCapturedStepsAddTheCpuRowsExactly) {
  MOE_SKIP_WITHOUT_GPU();
  Buffers b;
  auto h = GpuHandoff::Create({kRows, kTopK, kHidden}, SyntheticCompute(0));
  ASSERT_TRUE(h.ok()) << h.status();
  cudaGraphExec_t exec = CaptureStep(b, **h, 1, true);
  (*h)->Arm();
  const int kSteps = 10000;
  for (int i = 0; i < kSteps; ++i) ASSERT_EQ(cudaGraphLaunch(exec, b.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  (*h)->Disarm();
  EXPECT_TRUE((*h)->TakeError().ok());
  EXPECT_EQ(b.Mismatches(), 0u) << "rows whose CPU result was missing or wrong";
  // Every step had CPU routes (16 routes, every third one), so every step was a request.
  EXPECT_EQ((*h)->worker().requests(), kSteps);
  cudaGraphExecDestroy(exec);
}

TEST(HandoffTest, WithoutTheWaitRowsAreWrong) {
  MOE_SKIP_WITHOUT_GPU();
  Buffers b;
  auto h = GpuHandoff::Create({kRows, kTopK, kHidden}, SyntheticCompute(50));
  ASSERT_TRUE(h.ok()) << h.status();
  cudaGraphExec_t exec = CaptureStep(b, **h, 1, /*wait=*/false);
  (*h)->Arm();
  for (int i = 0; i < 500; ++i) ASSERT_EQ(cudaGraphLaunch(exec, b.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  (*h)->Disarm();
  const uint32_t bad = b.Mismatches();
  std::printf("without the wait: %u of %d rows wrong\n", bad, 500 * kRows);
  EXPECT_GT(bad, 0u) << "the wait is load-bearing: without it the GPU must read stale rows";
  cudaGraphExecDestroy(exec);
}

TEST(HandoffTest, AWorkerThatDoesNotAnswerFailsTheStepInsteadOfHanging) {
  MOE_SKIP_WITHOUT_GPU();
  Buffers b;
  auto h = GpuHandoff::Create({kRows, kTopK, kHidden}, SyntheticCompute(300000));  // 300 ms
  ASSERT_TRUE(h.ok()) << h.status();
  (*h)->set_timeout_ns(20'000'000);  // 20 ms
  cudaGraphExec_t exec = CaptureStep(b, **h, 4, true);
  (*h)->Arm();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(cudaGraphLaunch(exec, b.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  (*h)->Disarm();
  const absl::Status st = (*h)->TakeError();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  // One timeout, then the step's later layers skip waiting.
  EXPECT_LT(s, 0.25) << "the step took " << s << " s";
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // let the worker finish
  cudaGraphExecDestroy(exec);
}

TEST(HandoffTest, AComputeErrorReachesTheHost) {
  MOE_SKIP_WITHOUT_GPU();
  Buffers b;
  auto h = GpuHandoff::Create({kRows, kTopK, kHidden},
                              [](int layer, int, const int32_t*, const float*, const float*,
                                 float*) {
                                return layer == 1 ? absl::ResourceExhaustedError("layer 1")
                                                  : absl::OkStatus();
                              });
  ASSERT_TRUE(h.ok()) << h.status();
  cudaGraphExec_t exec = CaptureStep(b, **h, 3, true);
  (*h)->Arm();
  ASSERT_EQ(cudaGraphLaunch(exec, b.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  (*h)->Disarm();
  EXPECT_EQ((*h)->TakeError().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*h)->TakeError().ok());
  cudaGraphExecDestroy(exec);
}

#else
TEST(HandoffTest, BuiltWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }
#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::engine::hybrid
