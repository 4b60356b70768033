// The A/B switch (MOE_DECODE_SHARED_OVERLAP) and the stream pair: distinct streams and events made
// up front, an aliased side stream refused, caller streams left to the caller, the priority
// setting. The switch checks run everywhere; the rest skips without a GPU.
#include "moe_overlap/stream_pair.h"

#include <cstdlib>

#include "common/gpu_test_util.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::moe_overlap {
namespace {

TEST(OverlapOptionsTest, SwitchSetsOverlapAndRejectsAnythingElse) {
  OverlapOptions on;
  OverlapOptions off;
  off.overlap = false;
  EXPECT_TRUE(ApplyOverlapSwitch(on, nullptr)->overlap);
  EXPECT_FALSE(ApplyOverlapSwitch(off, "")->overlap);
  EXPECT_FALSE(ApplyOverlapSwitch(on, "0")->overlap);
  EXPECT_TRUE(ApplyOverlapSwitch(off, "1")->overlap);
  for (const char* bad : {"yes", "2", " 1", "true", "00"}) {
    auto r = ApplyOverlapSwitch(on, bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(kOverlapEnvVar), absl::string_view::npos);
  }
  // The switch leaves the other settings alone.
  OverlapOptions prio;
  prio.side_high_priority = true;
  EXPECT_TRUE(ApplyOverlapSwitch(prio, "0")->side_high_priority);
  EXPECT_FALSE(OverlapOptions().side_high_priority);  // off by default
  EXPECT_TRUE(OverlapOptions().overlap);
}

TEST(OverlapOptionsTest, EnvironmentIsReadWhenOptionsAreBuilt) {
  ASSERT_EQ(setenv(kOverlapEnvVar, "0", 1), 0);
  auto off = OverlapOptionsFromEnv();
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->overlap);
  ASSERT_EQ(setenv(kOverlapEnvVar, "on", 1), 0);
  EXPECT_EQ(OverlapOptionsFromEnv().status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(unsetenv(kOverlapEnvVar), 0);
  EXPECT_TRUE(OverlapOptionsFromEnv()->overlap);
}

TEST(StreamPairTest, WithoutCudaCreateIsUnavailable) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a GPU is visible";
  EXPECT_EQ(StreamPair::Create({}).status().code(), absl::StatusCode::kUnavailable);
}

#if MOE_HAVE_CUDA

TEST(StreamPairTest, CreatesDistinctStreamsAndEventsUpFront) {
  MOE_SKIP_WITHOUT_GPU();
  auto pair = StreamPair::Create({});
  ASSERT_TRUE(pair.ok()) << pair.status();
  ASSERT_NE((*pair)->compute(), nullptr);
  ASSERT_NE((*pair)->side(), nullptr);
  EXPECT_NE((*pair)->compute(), (*pair)->side());
  ASSERT_NE((*pair)->ready(), nullptr);
  ASSERT_NE((*pair)->done(), nullptr);
  EXPECT_NE((*pair)->ready(), (*pair)->done());
  unsigned int flags = 0;
  ASSERT_EQ(cudaStreamGetFlags((*pair)->side(), &flags), cudaSuccess);
  EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);
  // Timing disabled: cudaEventElapsedTime must refuse the pair's events.
  ASSERT_EQ(cudaEventRecord((*pair)->ready(), (*pair)->compute()), cudaSuccess);
  ASSERT_EQ(cudaEventRecord((*pair)->done(), (*pair)->compute()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize((*pair)->compute()), cudaSuccess);
  float ms = 0;
  EXPECT_NE(cudaEventElapsedTime(&ms, (*pair)->ready(), (*pair)->done()), cudaSuccess);
  cudaGetLastError();
}

TEST(StreamPairTest, AliasedSideStreamIsRefused) {
  MOE_SKIP_WITHOUT_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto aliased = StreamPair::CreateWithStreams({}, s, s);
  ASSERT_FALSE(aliased.ok());
  EXPECT_EQ(aliased.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(aliased.status().message().find("aliases"), absl::string_view::npos);
  // Refused even with the overlap switched off: the configuration is wrong either way.
  OverlapOptions off;
  off.overlap = false;
  EXPECT_EQ(StreamPair::CreateWithStreams(off, s, s).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The legacy default stream cannot be the compute stream.
  EXPECT_EQ(StreamPair::CreateWithStreams({}, nullptr, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST(StreamPairTest, CallerStreamsStayTheCallers) {
  MOE_SKIP_WITHOUT_GPU();
  cudaStream_t compute, side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  {
    auto pair = StreamPair::CreateWithStreams({}, compute, side);
    ASSERT_TRUE(pair.ok()) << pair.status();
    EXPECT_EQ((*pair)->compute(), compute);
    EXPECT_EQ((*pair)->side(), side);
  }
  {
    auto pair = StreamPair::CreateWithStreams({}, compute, nullptr);
    ASSERT_TRUE(pair.ok()) << pair.status();
    EXPECT_EQ((*pair)->compute(), compute);
    EXPECT_NE((*pair)->side(), compute);
  }
  // Still usable after the pairs are gone.
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(side), cudaSuccess);
}

TEST(StreamPairTest, SidePriorityIsASetting) {
  MOE_SKIP_WITHOUT_GPU();
  int least = 0, greatest = 0;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  auto normal = StreamPair::Create({});
  ASSERT_TRUE(normal.ok());
  int p = 1;
  ASSERT_EQ(cudaStreamGetPriority((*normal)->side(), &p), cudaSuccess);
  EXPECT_EQ(p, 0);
  OverlapOptions high;
  high.side_high_priority = true;
  auto prio = StreamPair::Create(high);
  ASSERT_TRUE(prio.ok());
  ASSERT_EQ(cudaStreamGetPriority((*prio)->side(), &p), cudaSuccess);
  EXPECT_EQ(p, greatest);
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::moe_overlap
