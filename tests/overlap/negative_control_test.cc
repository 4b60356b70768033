// The negative control: this binary links the fork/join scope WITHOUT the join
// (//moe_overlap:fork_join_without_join). With the overlap on, the consumer that stands in for the
// routed GEMM then reads slots while copy_missing is still filling them, and its checksums differ
// from the store's; the test asserts that they do, which proves the join is what makes the
// overlap correct. The race is made certain, not likely: every layer copies megabytes over PCIe
// (about 8 misses of 1.7 MiB) while the compute branch is a shared expert of 16 columns
// (microseconds). With the overlap off there is no fork, so the same binary must see no mismatch.
// GPU test: skips without a GPU.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/gpu_test_util.h"
#include "gtest/gtest.h"
#include "tests/overlap/synthetic_stack.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::overlap_test {
namespace {

StackConfig RaceConfig(bool overlap) {
  StackConfig c;
  c.layers = 4;
  c.experts = 64;
  c.top_k = 8;
  c.hidden = 1024;
  c.inter = 1024;  // 1.7 MiB per routed expert, 4-bit
  c.shared_inter = 16;
  c.slots = 64;  // of 256 experts: most routes miss
  c.max_batch = 1;
  c.seed = 9;
  c.overlap.overlap = overlap;
  return c;
}

TEST(NegativeControlTest, WithoutCudaTheStackIsUnavailable) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a GPU is visible";
  EXPECT_EQ(SyntheticMoeStack::Create(RaceConfig(true)).status().code(),
            absl::StatusCode::kUnavailable);
}

#if MOE_HAVE_CUDA

// Mismatching routes over `steps` eager steps of batch 1.
int RunAndCountMismatches(SyntheticMoeStack& stack, int steps, int* misses) {
  std::mt19937 rng(21);
  int bad = 0;
  *misses = 0;
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(stack.SetTokens({static_cast<int32_t>(rng() % 100000)}).ok());
    EXPECT_TRUE(stack.EnqueueStep(1).ok());
    // Without the join the side stream may still be copying: wait for everything.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto r = stack.ReadStep(1);
    EXPECT_TRUE(r.ok());
    if (!r.ok()) return -1;
    bad += stack.CountMismatches(*r, 1);
    for (int c : r->plan_counts) *misses += c;
  }
  return bad;
}

TEST(NegativeControlTest, WithoutTheJoinTheConsumerReadsSlotsBeforeTheyAreFilled) {
  MOE_SKIP_WITHOUT_GPU();
  constexpr int kSteps = 20;
  auto serial = SyntheticMoeStack::Create(RaceConfig(false));
  ASSERT_TRUE(serial.ok()) << serial.status();
  int serial_misses = 0;
  EXPECT_EQ(RunAndCountMismatches(**serial, kSteps, &serial_misses), 0);
  auto racing = SyntheticMoeStack::Create(RaceConfig(true));
  ASSERT_TRUE(racing.ok()) << racing.status();
  int misses = 0;
  const int bad = RunAndCountMismatches(**racing, kSteps, &misses);
  ASSERT_GT(misses, kSteps * 4) << "the control needs misses to race against";
  // The assertion of the control: mismatches, and plenty of them.
  EXPECT_GT(bad, 0) << "no checksum mismatch without the join: the control is not racing";
  std::printf("negative control: %d checksum mismatches over %d steps (%d misses)\n", bad,
              kSteps, misses);
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::overlap_test
