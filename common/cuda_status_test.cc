#include "common/cuda_status.h"

#include <string>

#include "gtest/gtest.h"

namespace moe::common {
namespace {

absl::Status Returns(int error) {
  CUDA_RETURN_IF_ERROR(error);
  return absl::OkStatus();
}

TEST(CudaStatusTest, ZeroIsOk) {
  EXPECT_TRUE(CudaErrorToStatus(0, "x", "f.cc", 1).ok());
  EXPECT_TRUE(Returns(0).ok());
}

TEST(CudaStatusTest, OutOfMemoryIsResourceExhaustedWithExpressionAndLocation) {
  // 2 is cudaErrorMemoryAllocation.
  const absl::Status s = CudaErrorToStatus(2, "cudaMalloc(&p, n)", "foo.cc", 42);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(s.message());
  EXPECT_NE(msg.find("cudaMalloc(&p, n)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("foo.cc:42"), std::string::npos) << msg;
#if MOE_HAVE_CUDA
  EXPECT_NE(msg.find("cudaErrorMemoryAllocation"), std::string::npos) << msg;
#endif
}

TEST(CudaStatusTest, OtherErrorsAreInternal) {
  // 1 is cudaErrorInvalidValue.
  EXPECT_EQ(CudaErrorToStatus(1, "x", "f.cc", 1).code(), absl::StatusCode::kInternal);
}

TEST(CudaStatusTest, MacroReturnsTheErrorWithTheExpressionText) {
  const absl::Status s = Returns(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("error"), std::string::npos) << s;
}

TEST(CudaStatusTest, AvailabilityIsConsistentWithDeviceCount) {
  const int count = CudaDeviceCount();
  EXPECT_GE(count, 0);
  const absl::Status s = CudaAvailable();
  if (count > 0) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
#if MOE_HAVE_CUDA
    EXPECT_NE(std::string(s.message()).find("no CUDA device visible"), std::string::npos) << s;
#else
    EXPECT_EQ(s.message(), "built without CUDA");
#endif
  }
  // Probing twice is harmless (the sticky error was cleared).
  EXPECT_EQ(CudaDeviceCount(), count);
}

}  // namespace
}  // namespace moe::common
