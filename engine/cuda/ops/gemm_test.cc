// DenseGemm against a float64 reference over the same bf16 operands, on fresh random inputs
// (the seed is printed): T in {1, 8, 200}, Qwen3-30B-A3B's projection shapes, odd shapes, bf16
// output, bias and accumulation, and the LM head (151936 x 2048). Outputs poisoned with NaN
// first. GPU test: skips without a GPU.
#include "engine/cuda/ops/gemm.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/formats.h"
#include "common/gpu_test_util.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/ops/ops_test_util.h"

namespace moe::engine::gpu {
namespace {

using testing::DeviceArray;
using testing::RandomBf16;
using testing::RandomF32;
using testing::Rng;

struct Case {
  int rows, n, k;
  bool y_bf16 = false;
  bool bias = false;
  bool accumulate = false;
};

void CheckGemm(DenseGemm& gemm, Rng& rng, const Case& c) {
  SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " n " << c.n << " k " << c.k << " bf16 "
                                    << c.y_bf16 << " bias " << c.bias << " acc " << c.accumulate);
  const float wscale = 1.0f / std::sqrt(static_cast<float>(c.k));
  const std::vector<uint16_t> x = RandomBf16(rng, static_cast<size_t>(c.rows) * c.k, -2, 2);
  const std::vector<uint16_t> w = RandomBf16(rng, static_cast<size_t>(c.n) * c.k, -wscale, wscale);
  const std::vector<float> bias = RandomF32(rng, c.n, -1, 1);
  const std::vector<float> y0 = RandomF32(rng, static_cast<size_t>(c.rows) * c.n, -1, 1);
  DeviceArray<uint16_t> d_x(x), d_w(w);
  DeviceArray<float> d_bias(bias);
  DeviceArray<float> d_y(static_cast<size_t>(c.rows) * c.n);
  DeviceArray<uint16_t> d_ybf(static_cast<size_t>(c.rows) * c.n);
  if (c.accumulate) {
    d_y.Upload(y0);
  } else {
    d_y.Poison();
  }
  d_ybf.Poison();
  GemmArgs a;
  a.x = d_x.get();
  a.w = d_w.get();
  a.bias = c.bias ? d_bias.get() : nullptr;
  a.y = c.y_bf16 ? static_cast<void*>(d_ybf.get()) : static_cast<void*>(d_y.get());
  a.y_bf16 = c.y_bf16;
  a.accumulate = c.accumulate;
  a.rows = c.rows;
  a.n = c.n;
  a.k = c.k;
  ASSERT_TRUE(gemm.Run(a).ok());
  const std::vector<float> y = c.y_bf16 ? std::vector<float>() : d_y.Download();
  const std::vector<uint16_t> ybf = c.y_bf16 ? d_ybf.Download() : std::vector<uint16_t>();

  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = common::Bf16ToFloat(x[i]);
  int64_t bad = 0;
  for (int r = 0; r < c.rows; ++r) {
    const float* xr = xf.data() + static_cast<size_t>(r) * c.k;
    for (int j = 0; j < c.n; ++j) {
      const uint16_t* wr = w.data() + static_cast<size_t>(j) * c.k;
      double ref = 0, mag = 0;
      for (int i = 0; i < c.k; ++i) {
        const double p = static_cast<double>(xr[i]) * common::Bf16ToFloat(wr[i]);
        ref += p;
        mag += std::fabs(p);
      }
      const size_t at = static_cast<size_t>(r) * c.n + j;
      if (c.bias) ref += bias[j];
      if (c.accumulate) ref += y0[at];
      // The operands are exact in f32; f32 accumulation of k products in any order (tensor-core
      // tiles, split-k) errs by at most ~k * 2^-24 of sum |x w|, typically sqrt(k) * 2^-24.
      // Allow 2e-5 of the magnitude (k <= 4096: 5x the typical sqrt(k) * 2^-24), plus the rounding
      // of the bias/accumulator add, plus 2^-8 of the value (twice bf16's half ulp) for bf16 out.
      const double extra =
          (c.bias ? std::fabs(bias[j]) : 0.0) + (c.accumulate ? std::fabs(y0[at]) : 0.0);
      double tol = 2e-5 * mag + 1.2e-7 * (extra + std::fabs(ref));
      const double got = c.y_bf16 ? common::Bf16ToFloat(ybf[at]) : y[at];
      if (c.y_bf16) tol += std::ldexp(std::fabs(ref), -8);
      if (!(std::fabs(got - ref) <= tol)) {
        if (++bad <= 5) {
          ADD_FAILURE() << "y[" << r << "," << j << "] = " << got << ", want " << ref << " +- "
                        << tol;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class GemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MOE_SKIP_WITHOUT_GPU();
    testing::CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    auto g = DenseGemm::Create(stream_);
    ASSERT_TRUE(g.ok()) << g.status();
    gemm_ = std::move(*g);
    seed_ = testing::FreshSeed();
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed_));
  }
  void TearDown() override {
    gemm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DenseGemm> gemm_;
  uint64_t seed_ = 0;
};

TEST_F(GemmTest, ProjectionShapes) {
  Rng rng(seed_);
  for (int rows : {1, 8, 200}) {
    CheckGemm(*gemm_, rng, {rows, 4096, 2048});  // q
    CheckGemm(*gemm_, rng, {rows, 512, 2048});   // k, v
    CheckGemm(*gemm_, rng, {rows, 2048, 4096});  // o
    CheckGemm(*gemm_, rng, {rows, 128, 2048});   // router
    CheckGemm(*gemm_, rng, {rows, 1, 2048});     // shared expert gate
    CheckGemm(*gemm_, rng, {rows, 130, 72});     // odd
    CheckGemm(*gemm_, rng, {rows, 33, 1000});
  }
}

TEST_F(GemmTest, Bf16OutputBiasAndAccumulate) {
  Rng rng(seed_);
  for (int rows : {1, 3, 8, 200}) {
    CheckGemm(*gemm_, rng, {rows, 1536, 2048, /*y_bf16=*/true});  // shared expert gate_up
    CheckGemm(*gemm_, rng, {rows, 517, 96, true});
    CheckGemm(*gemm_, rng, {rows, 1024, 2048, false, /*bias=*/true});
    CheckGemm(*gemm_, rng, {rows, 512, 4096, false, false, /*accumulate=*/true});
    CheckGemm(*gemm_, rng, {rows, 130, 72, false, true, true});
  }
}

TEST_F(GemmTest, LmHead) {
  Rng rng(seed_);
  CheckGemm(*gemm_, rng, {1, 151936, 2048});
  CheckGemm(*gemm_, rng, {2, 151936, 2048});
}

TEST_F(GemmTest, RejectsBadArguments) {
  GemmArgs a;
  a.rows = 1;
  a.n = 0;
  a.k = 8;
  EXPECT_EQ(gemm_->Run(a).code(), absl::StatusCode::kInvalidArgument);
  a.n = 8;
  a.y_bf16 = true;
  a.accumulate = true;
  EXPECT_EQ(gemm_->Run(a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::engine::gpu

#else  // !MOE_HAVE_CUDA

TEST(GemmTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MOE_HAVE_CUDA
