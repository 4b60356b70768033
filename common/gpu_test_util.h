// Test helpers for GPU tests: skip (not fail) where no GPU is usable, so the same test binaries
// pass in CPU-only CI and run for real on a GPU machine.
#ifndef MOE_COMMON_GPU_TEST_UTIL_H_
#define MOE_COMMON_GPU_TEST_UTIL_H_

#include "common/cuda_status.h"
#include "gtest/gtest.h"

// Use first in a GPU test body: GTEST_SKIPs with CudaAvailable()'s reason ("built without CUDA"
// or "no CUDA device visible: ...").
#define MOE_SKIP_WITHOUT_GPU()                                                   \
  do {                                                                           \
    const ::absl::Status moe_gpu_status_ = ::moe::common::CudaAvailable();       \
    if (!moe_gpu_status_.ok()) GTEST_SKIP() << moe_gpu_status_.message();        \
  } while (0)

#endif  // MOE_COMMON_GPU_TEST_UTIL_H_
