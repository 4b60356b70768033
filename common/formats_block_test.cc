// Block weight formats: exact layouts against hand-computed blocks, and round trips whose error is
// bounded by what the format allows (the scale times half the grid step at each magnitude).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/formats.h"
#include "gtest/gtest.h"

namespace moe::common {
namespace {

// Half the spacing of the fp4 e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} around |v| <= 6.
double HalfStepE2M1(double a) {
  if (a < 2) return 0.25;
  if (a < 4) return 0.5;
  return 1.0;
}

// Half the spacing of the fp8 e4m3 grid around |v| <= 448: subnormal step 2^-9 below 2^-6,
// else 2^(floor(log2 v) - 3).
double HalfStepE4M3(double a) {
  if (a < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 4);
}

// Values of mixed magnitude: each block gets its own scale, with occasional outliers and zeros.
std::vector<float> RandomRows(int64_t n, int block, uint64_t seed, float log2_range = 20.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-log2_range, log2_range);
  std::vector<float> x(n);
  for (int64_t b = 0; b < n / block; ++b) {
    const float s = std::exp2(log_scale(rng));
    for (int j = 0; j < block; ++j) {
      float v = normal(rng) * s;
      if (rng() % 97 == 0) v *= 50;  // outlier
      if (rng() % 53 == 0) v = 0;
      x[b * block + j] = v;
    }
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// q4_0

TEST(Q4_0Test, HandComputedBlockLayout) {
  // x[j] = j - 8 and x[16 + j] = 7 - j: the largest magnitude is x[0] = -8, so d = -8 / -8 = 1 and
  // element j -> q = j (low nibble of qs[j]), element 16 + j -> q = 15 - j (high nibble).
  float x[32];
  for (int j = 0; j < 16; ++j) {
    x[j] = static_cast<float>(j - 8);
    x[16 + j] = static_cast<float>(7 - j);
  }
  BlockQ4_0 b;
  QuantizeRowQ4_0(x, 32, &b);
  EXPECT_EQ(b.d, 0x3C00);  // fp16 1.0
  for (int j = 0; j < 16; ++j) EXPECT_EQ(b.qs[j], j | ((15 - j) << 4)) << j;
  float y[32];
  DequantizeRowQ4_0(&b, 32, y);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], x[j]) << j;
}

TEST(Q4_0Test, PositiveMaxGivesNegativeScaleAndClampsItsNegation) {
  // max = +16 -> d = -2: 16 -> q 0; -16 would be q 16, clamped to 15 -> -14 (llama.cpp does this).
  float x[32] = {};
  x[0] = 16;
  x[1] = -16;
  x[2] = 3;   // 3 / -2 + 8.5 = 7.0 -> q 7 -> -1 * -2 = 2
  x[17] = 5;  // 5 / -2 + 8.5 = 6.0 -> q 6 -> 4
  BlockQ4_0 b;
  QuantizeRowQ4_0(x, 32, &b);
  EXPECT_EQ(b.d, 0xC000);  // fp16 -2.0
  EXPECT_EQ(b.qs[0], 0 | (8 << 4));
  EXPECT_EQ(b.qs[1], 15 | (6 << 4));
  EXPECT_EQ(b.qs[2], 7 | (8 << 4));
  float y[32];
  DequantizeRowQ4_0(&b, 32, y);
  EXPECT_EQ(y[0], 16);
  EXPECT_EQ(y[1], -14);
  EXPECT_EQ(y[2], 2);
  EXPECT_EQ(y[17], 4);
  EXPECT_EQ(y[3], 0);
}

TEST(Q4_0Test, RoundTripWithinHalfStep) {
  const int64_t n = 32 * 4096;
  // fp16 d = amax / 8 must stay finite (amax < 2^19); tiny blocks exercise subnormal d.
  const std::vector<float> x = RandomRows(n, 32, 1, 10.0f);
  std::vector<BlockQ4_0> q(n / 32);
  QuantizeRowQ4_0(x.data(), n, q.data());
  std::vector<float> y(n);
  DequantizeRowQ4_0(q.data(), n, y.data());
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(x[b * 32 + j]) > amax) amax = std::fabs(x[b * 32 + j]), max = x[b * 32 + j];
    }
    const float d = max / -8;
    ASSERT_EQ(q[b].d, FloatToFp16(d)) << b;
    const double dq = Fp16ToFloat(q[b].d);
    for (int j = 0; j < 32; ++j) {
      const double v = x[b * 32 + j];
      // In units of d the value is t = v / d in [-8, 8]; the grid is the integers -8..7, so the
      // error is at most half a step, plus the clamp of +8 to 7, plus fp16's rounding of d.
      const double t = d != 0 ? v / d : 0;
      const double clamp_excess = std::max(0.0, t - 7.0);
      const double bound = std::fabs(d) * (0.5 + clamp_excess) + 8 * std::fabs(d - dq) +
                           1e-6 * std::fabs(v);
      ASSERT_LE(std::fabs(v - y[b * 32 + j]), bound) << "block " << b << " j " << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// mxfp4

TEST(Mxfp4Test, HandComputedBlocks) {
  std::vector<float> x(4 * 32, 0.0f);
  // Block 0: amax 6 -> floor(log2 6) - 2 = 0 -> scale 2^0, code 127.
  x[0] = 0.5f;  // fp4 0x1, low nibble of packed[0]
  x[1] = -6;    // fp4 0xF, high nibble of packed[0]
  x[2] = 1.5f;  // 0x3
  x[3] = 3;     // 0x5
  // Block 1: amax 1 -> scale 2^(0 - 2) = 0.25 (code 125): 1 -> 4 (0x6), 0.75 -> 3 (0x5),
  // 0.0625 -> 0.25, a tie between 0 and 0.5 -> even -> 0.
  x[32] = 1;
  x[33] = 0.75f;
  x[34] = 0.0625f;
  // Block 2: amax 7 -> scale 2^(2 - 2) = 1, and 7 > 6 clamps to 6 (the MX rule).
  x[64] = 7;
  x[65] = -2.5f;  // tie between 2 and 3 -> even mantissa -> 2 (0xC)
  // Block 3: all zero -> scale code 0.
  std::vector<uint8_t> packed(4 * 16, 0xAA);
  std::vector<uint8_t> scales(4, 0xAA);
  QuantizeRowMxfp4(x.data(), 4 * 32, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ(scales[1], 125);
  EXPECT_EQ(scales[2], 127);
  EXPECT_EQ(scales[3], 0);
  EXPECT_EQ(packed[0], 0xF1);
  EXPECT_EQ(packed[1], 0x53);
  EXPECT_EQ(packed[16], 0x56);
  EXPECT_EQ(packed[17], 0x00);
  EXPECT_EQ(packed[32], 0xC7);
  for (int i = 2; i < 16; ++i) EXPECT_EQ(packed[i], 0) << i;
  for (int i = 48; i < 64; ++i) EXPECT_EQ(packed[i], 0) << i;
  std::vector<float> y(4 * 32);
  DequantizeRowMxfp4(packed.data(), scales.data(), 4 * 32, y.data());
  EXPECT_EQ(y[1], -6);
  EXPECT_EQ(y[33], 0.75f);
  EXPECT_EQ(y[34], 0);
  EXPECT_EQ(y[64], 6);
  EXPECT_EQ(y[65], -2);
}

TEST(Mxfp4Test, RoundTripWithinHalfStepOfTheSharedScale) {
  const int64_t n = 32 * 4096;
  const std::vector<float> x = RandomRows(n, 32, 2);
  std::vector<uint8_t> packed(n / 2), scales(n / 32);
  QuantizeRowMxfp4(x.data(), n, packed.data(), scales.data());
  std::vector<float> y(n);
  DequantizeRowMxfp4(packed.data(), scales.data(), n, y.data());
  for (int64_t b = 0; b < n / 32; ++b) {
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(double{x[b * 32 + j]}));
    const double s = std::ldexp(1.0, scales[b] - 127);
    if (amax > 0) {
      // The MX scale puts the block maximum in [4, 8) grid units.
      ASSERT_GE(amax / s, 4.0) << b;
      ASSERT_LT(amax / s, 8.0) << b;
    }
    for (int j = 0; j < 32; ++j) {
      const double v = std::fabs(double{x[b * 32 + j]}) / s;
      const double bound = s * (v > 6 ? v - 6 : HalfStepE2M1(v));
      ASSERT_LE(std::fabs(x[b * 32 + j] - y[b * 32 + j]), bound) << "block " << b << " j " << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// nvfp4

TEST(Nvfp4Test, HandComputedTwoLevelScale) {
  std::vector<float> x(32, 0.0f);
  // global 0.5; block 0 amax 12 -> block scale 12 / (6 * 0.5) = 4 = e4m3 0x48; step = 4 * 0.5 = 2.
  x[0] = 12;    // 6 -> 0x7
  x[1] = -1;    // -0.5 -> 0x9
  x[2] = 3;     // 1.5 -> 0x3
  x[3] = 0.5f;  // 0.25: tie between 0 and 0.5 -> 0
  // Block 1: amax 0.9 -> 0.9 / 3 = 0.3 -> e4m3 rounds to 0.3125 (0x2A); step 0.15625;
  // 0.9 / 0.15625 = 5.76 -> 6 (0x7).
  x[16] = 0.9f;
  x[17] = -0.3f;  // -1.92 -> -2 (0xC)
  std::vector<uint8_t> packed(16), scales(2);
  QuantizeRowNvfp4(x.data(), 32, 0.5f, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0x48);
  EXPECT_EQ(scales[1], 0x2A);
  EXPECT_EQ(Fp8E4M3ToFloat(0x2A), 0.3125f);
  EXPECT_EQ(packed[0], 0x97);
  EXPECT_EQ(packed[1], 0x03);
  EXPECT_EQ(packed[8], 0xC7);
  std::vector<float> y(32);
  DequantizeRowNvfp4(packed.data(), scales.data(), 0.5f, 32, y.data());
  EXPECT_EQ(y[0], 12);
  EXPECT_EQ(y[1], -1);
  EXPECT_EQ(y[3], 0);
  EXPECT_EQ(y[16], 6 * 0.15625f);
  EXPECT_EQ(y[17], -2 * 0.15625f);
}

TEST(Nvfp4Test, GlobalScale) {
  std::vector<float> x(64, 0.0f);
  EXPECT_EQ(Nvfp4GlobalScale(x.data(), 64), 1.0f);
  x[40] = -2688;  // 448 * 6
  EXPECT_EQ(Nvfp4GlobalScale(x.data(), 64), 1.0f);
  x[3] = 5376;
  EXPECT_EQ(Nvfp4GlobalScale(x.data(), 64), 2.0f);
}

TEST(Nvfp4Test, RoundTripWithinHalfStepOfTheBlockScale) {
  const int64_t n = 16 * 8192;
  // Block magnitudes spread over 2^+-6: within what e4m3 block scales (2^-9 .. 448) under one
  // per-tensor scale can express, so no block degenerates to zeros.
  const std::vector<float> x = RandomRows(n, 16, 3, 6.0f);
  const float g = Nvfp4GlobalScale(x.data(), n);
  std::vector<uint8_t> packed(n / 2), scales(n / 16);
  QuantizeRowNvfp4(x.data(), n, g, packed.data(), scales.data());
  std::vector<float> y(n);
  DequantizeRowNvfp4(packed.data(), scales.data(), g, n, y.data());
  for (int64_t b = 0; b < n / 16; ++b) {
    float amax = 0;
    for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(x[b * 16 + j]));
    ASSERT_EQ(scales[b], FloatToFp8E4M3(amax / (6 * g))) << b;
    const double s = double{Fp8E4M3ToFloat(scales[b])} * g;
    for (int j = 0; j < 16; ++j) {
      const double xv = x[b * 16 + j];
      double bound;
      if (s == 0) {
        bound = std::fabs(xv);  // a block below the smallest e4m3 scale is stored as zeros
      } else {
        const double v = std::fabs(xv) / s;
        bound = s * (v > 6 ? v - 6 : HalfStepE2M1(v)) + 1e-6 * std::fabs(xv);
      }
      ASSERT_LE(std::fabs(xv - y[b * 16 + j]), bound) << "block " << b << " j " << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fp8 with 128x128 block scales

TEST(Fp8BlockTest, PartialEdgeBlockScaleAndLayout) {
  constexpr int64_t kRows = 130, kCols = 200;  // 2 x 2 blocks, the last row and column partial
  std::vector<float> x(kRows * kCols, 0.0f);
  x[0 * kCols + 130] = 7;          // block (0, 1): scale 7 / 448 = 1/64
  x[129 * kCols + 199] = -896;     // block (1, 1): scale 2, -896 / 2 = -448 -> 0xFE
  x[128 * kCols + 128] = 3;        // block (1, 1): 1.5 -> 0x3C
  x[128 * kCols + 5] = 0.001953125f;  // block (1, 0): alone, 2^-9 -> scale 2^-9 / 448
  std::vector<uint8_t> q(kRows * kCols, 0xAA);
  std::vector<float> scales(4, -1);
  QuantizeFp8Block(x.data(), kRows, kCols, q.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f);  // all-zero block
  EXPECT_EQ(scales[1], 7.0f / 448.0f);
  EXPECT_EQ(scales[2], 0.001953125f / 448.0f);
  EXPECT_EQ(scales[3], 2.0f);
  EXPECT_EQ(q[129 * kCols + 199], 0xFE);
  EXPECT_EQ(q[128 * kCols + 128], 0x3C);
  EXPECT_EQ(q[0 * kCols + 130], 0x7E);
  EXPECT_EQ(q[128 * kCols + 5], 0x7E);
  EXPECT_EQ(q[5], 0x00);
  std::vector<float> y(kRows * kCols);
  DequantizeFp8Block(q.data(), scales.data(), kRows, kCols, y.data());
  EXPECT_EQ(y[129 * kCols + 199], -896);
  EXPECT_EQ(y[128 * kCols + 128], 3);
  EXPECT_EQ(y[0 * kCols + 130], 7);
}

TEST(Fp8BlockTest, RoundTripWithinHalfStep) {
  constexpr int64_t kRows = 300, kCols = 260;
  std::vector<float> x = RandomRows(kRows * kCols, 1 << 12, 4);
  std::vector<uint8_t> q(kRows * kCols);
  const int64_t brows = 3, bcols = 3;
  std::vector<float> scales(brows * bcols);
  QuantizeFp8Block(x.data(), kRows, kCols, q.data(), scales.data());
  std::vector<float> y(kRows * kCols);
  DequantizeFp8Block(q.data(), scales.data(), kRows, kCols, y.data());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const double s = scales[(r / 128) * bcols + c / 128];
      const double xv = x[r * kCols + c];
      const double v = std::fabs(xv) / s;
      ASSERT_LE(v, 448 * (1 + 1e-6));
      const double bound = s * HalfStepE4M3(v) + 1e-6 * std::fabs(xv);
      ASSERT_LE(std::fabs(xv - y[r * kCols + c]), bound) << r << "," << c;
    }
  }
}

}  // namespace
}  // namespace moe::common
