// formats.h checked against NVIDIA's conversions on the GPU (format_kernels.h): every code of
// bf16, fp16, fp8 e4m3 / e5m2 and fp4 e2m1 decoded, and a few million floats encoded (random bit
// patterns, values across each format's range and subnormals, every tie between adjacent codes
// and its float neighbours, values far beyond the range), byte for byte. NaN is compared as NaN:
// the one documented difference (format_kernels.h).
#include "common/format_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/formats.h"
#include "common/gpu_test_util.h"
#include "gtest/gtest.h"

namespace moe::common {
namespace {

struct Format {
  const char* name;
  GpuCodeFormat gpu;
  int bits;
  float (*decode)(uint16_t);
  uint16_t (*encode)(float);
};

const Format kFormats[] = {
    {"bf16", GpuCodeFormat::kBf16, 16, [](uint16_t c) { return Bf16ToFloat(c); },
     [](float f) -> uint16_t { return FloatToBf16(f); }},
    {"fp16", GpuCodeFormat::kFp16, 16, [](uint16_t c) { return Fp16ToFloat(c); },
     [](float f) -> uint16_t { return FloatToFp16(f); }},
    {"fp8_e4m3", GpuCodeFormat::kFp8E4M3, 8,
     [](uint16_t c) { return Fp8E4M3ToFloat(static_cast<uint8_t>(c)); },
     [](float f) -> uint16_t { return FloatToFp8E4M3(f); }},
    {"fp8_e5m2", GpuCodeFormat::kFp8E5M2, 8,
     [](uint16_t c) { return Fp8E5M2ToFloat(static_cast<uint8_t>(c)); },
     [](float f) -> uint16_t { return FloatToFp8E5M2(f); }},
    {"fp4_e2m1", GpuCodeFormat::kFp4E2M1, 4,
     [](uint16_t c) { return Fp4E2M1ToFloat(static_cast<uint8_t>(c)); },
     [](float f) -> uint16_t { return FloatToFp4E2M1(f); }},
};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

class FormatKernelsTest : public ::testing::TestWithParam<int> {
 protected:
  const Format& format() const { return kFormats[GetParam()]; }
};

TEST_P(FormatKernelsTest, DecodesEveryCodeLikeTheCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const Format& f = format();
  std::vector<uint16_t> codes(size_t{1} << f.bits);
  for (size_t c = 0; c < codes.size(); ++c) codes[c] = static_cast<uint16_t>(c);
  std::vector<float> gpu(codes.size());
  ASSERT_TRUE(GpuDecodeToFloat(f.gpu, codes, absl::MakeSpan(gpu), nullptr).ok());
  int mismatches = 0;
  for (size_t c = 0; c < codes.size(); ++c) {
    const float cpu = f.decode(codes[c]);
    const bool same = std::isnan(cpu) ? std::isnan(gpu[c]) : Bits(cpu) == Bits(gpu[c]);
    if (!same && ++mismatches <= 10) {
      ADD_FAILURE() << f.name << absl::StrFormat(" code 0x%x: cpu %.9g gpu %.9g", c, cpu, gpu[c]);
    }
  }
  EXPECT_EQ(mismatches, 0) << f.name;
}

// Inputs that probe every rounding decision of the format, plus random ones.
std::vector<float> EncodeInputs(const Format& f, uint64_t seed) {
  std::vector<float> xs;
  // Every finite non-negative code value, the midpoint to the next one (the ties) and the float
  // neighbours of both, with both signs.
  std::vector<float> values;
  for (uint32_t c = 0; c < (1u << (f.bits - 1)); ++c) {
    const float v = f.decode(static_cast<uint16_t>(c));
    if (std::isfinite(v)) values.push_back(v);
  }
  std::sort(values.begin(), values.end());
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < values.size(); ++i) {
    const double next = i + 1 < values.size() ? values[i + 1]
                                              : 2.0 * values[i] - values[i - 1];  // past max
    const float mid = static_cast<float>((double{values[i]} + next) / 2);
    for (float x : {values[i], mid, std::nextafter(mid, 0.0f), std::nextafter(mid, inf),
                    std::nextafter(values[i], 0.0f), std::nextafter(values[i], inf)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (float x : {inf, std::numeric_limits<float>::max(), 1e30f, 1e10f, 65536.0f, 1000.0f,
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    xs.push_back(x);
    xs.push_back(-x);
  }
  const double max = values.back();
  const double min_sub = values[1];
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(-1.5 * max, 1.5 * max);
  std::uniform_real_distribution<double> log2mag(std::log2(min_sub) - 3, std::log2(max) + 2);
  for (int i = 0; i < (1 << 20); ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());  // any float, NaNs and subnormals too
    float r;
    std::memcpy(&r, &bits, sizeof(r));
    xs.push_back(r);
    xs.push_back(static_cast<float>(uni(rng)));
    const float g = static_cast<float>(std::exp2(log2mag(rng)));
    xs.push_back((rng() & 1) ? -g : g);
  }
  return xs;
}

TEST_P(FormatKernelsTest, EncodesMillionsOfFloatsLikeTheCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const Format& f = format();
  const std::vector<float> xs = EncodeInputs(f, 0xC0DE + GetParam());
  std::vector<uint16_t> gpu(xs.size());
  ASSERT_TRUE(GpuEncodeFromFloat(f.gpu, xs, absl::MakeSpan(gpu), nullptr).ok());
  int mismatches = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const uint16_t cpu = f.encode(xs[i]);
    bool same = cpu == gpu[i];
    if (std::isnan(xs[i]) && f.gpu != GpuCodeFormat::kFp4E2M1) {
      // The documented difference: both must be a NaN, payload and sign may differ.
      same = std::isnan(f.decode(cpu)) && std::isnan(f.decode(gpu[i]));
    }
    if (!same && ++mismatches <= 10) {
      ADD_FAILURE() << f.name
                    << absl::StrFormat(" x=%.9g (bits 0x%08x): cpu 0x%x gpu 0x%x", xs[i],
                                       Bits(xs[i]), cpu, gpu[i]);
    }
  }
  EXPECT_EQ(mismatches, 0) << f.name << " over " << xs.size() << " inputs";
}

std::string FormatName(const ::testing::TestParamInfo<int>& info) {
  return kFormats[info.param].name;
}
INSTANTIATE_TEST_SUITE_P(AllFormats, FormatKernelsTest, ::testing::Range(0, 5), FormatName);

TEST(FormatKernelsApiTest, SizeMismatchIsInvalidArgument) {
  MOE_SKIP_WITHOUT_GPU();
  std::vector<uint16_t> codes(4);
  std::vector<float> out(3);
  EXPECT_EQ(GpuDecodeToFloat(GpuCodeFormat::kBf16, codes, absl::MakeSpan(out), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FormatKernelsApiTest, WithoutCudaEveryCallIsUnavailable) {
#if MOE_HAVE_CUDA
  GTEST_SKIP() << "built with CUDA";
#else
  std::vector<uint16_t> codes(4);
  std::vector<float> out(4);
  const absl::Status s = GpuDecodeToFloat(GpuCodeFormat::kBf16, codes, absl::MakeSpan(out), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "built without CUDA");
  EXPECT_EQ(GpuEncodeFromFloat(GpuCodeFormat::kFp16, out, absl::MakeSpan(codes), nullptr).code(),
            absl::StatusCode::kUnavailable);
#endif
}

}  // namespace
}  // namespace moe::common
