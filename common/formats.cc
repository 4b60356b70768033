#include "common/formats.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::common {
namespace formats_internal {
namespace {

constexpr float Pow2(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

// Decoded value of a small IEEE-style code: sign | exponent (kExp bits, bias 2^(kExp-1) - 1) |
// mantissa (kMan bits). `ieee_specials` says whether the all-ones exponent means inf/NaN (e5m2) or
// is an ordinary binade (e4m3fn, e2m1). e4m3fn's single NaN pattern is handled by the caller.
template <int kExp, int kMan>
constexpr float DecodeSmall(uint32_t code, bool ieee_specials) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  const bool neg = (code >> (kExp + kMan)) & 1;
  const int e = static_cast<int>((code >> kMan) & ((1u << kExp) - 1));
  const int m = static_cast<int>(code & ((1u << kMan) - 1));
  float mag = 0.0f;
  if (ieee_specials && e == (1 << kExp) - 1) {
    mag = m == 0 ? std::numeric_limits<float>::infinity()
                 : std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    mag = static_cast<float>(m) * Pow2(1 - kBias - kMan);
  } else {
    mag = static_cast<float>((1 << kMan) + m) * Pow2(e - kBias - kMan);
  }
  return neg ? -mag : mag;
}

template <std::size_t kN, int kExp, int kMan>
constexpr std::array<float, kN> MakeTable(bool ieee_specials, bool e4m3fn_nan) {
  std::array<float, kN> t{};
  for (uint32_t c = 0; c < kN; ++c) {
    t[c] = DecodeSmall<kExp, kMan>(c, ieee_specials);
    if (e4m3fn_nan && (c & 0x7F) == 0x7F) t[c] = std::numeric_limits<float>::quiet_NaN();
  }
  return t;
}

constexpr auto kE4M3 = MakeTable<256, 4, 3>(false, true);
constexpr auto kE5M2 = MakeTable<256, 5, 2>(true, false);
constexpr auto kE2M1 = MakeTable<16, 2, 1>(false, false);

}  // namespace

// Plain arrays (not std::array) so the header can declare them without <array>.
#define MOE_TABLE_ELEMS_16(t, i)                                                          \
  t[i + 0], t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6], t[i + 7], t[i + 8], \
      t[i + 9], t[i + 10], t[i + 11], t[i + 12], t[i + 13], t[i + 14], t[i + 15]
#define MOE_TABLE_ELEMS_256(t)                                                             \
  MOE_TABLE_ELEMS_16(t, 0), MOE_TABLE_ELEMS_16(t, 16), MOE_TABLE_ELEMS_16(t, 32),            \
      MOE_TABLE_ELEMS_16(t, 48), MOE_TABLE_ELEMS_16(t, 64), MOE_TABLE_ELEMS_16(t, 80),       \
      MOE_TABLE_ELEMS_16(t, 96), MOE_TABLE_ELEMS_16(t, 112), MOE_TABLE_ELEMS_16(t, 128),     \
      MOE_TABLE_ELEMS_16(t, 144), MOE_TABLE_ELEMS_16(t, 160), MOE_TABLE_ELEMS_16(t, 176),    \
      MOE_TABLE_ELEMS_16(t, 192), MOE_TABLE_ELEMS_16(t, 208), MOE_TABLE_ELEMS_16(t, 224),    \
      MOE_TABLE_ELEMS_16(t, 240)
constexpr float kFp8E4M3ToFloat[256] = {MOE_TABLE_ELEMS_256(kE4M3)};
constexpr float kFp8E5M2ToFloat[256] = {MOE_TABLE_ELEMS_256(kE5M2)};
constexpr float kFp4E2M1ToFloat[16] = {MOE_TABLE_ELEMS_16(kE2M1, 0)};
#undef MOE_TABLE_ELEMS_256
#undef MOE_TABLE_ELEMS_16

namespace {

// Rounds a finite, non-negative float (given by its bits) to the unsigned code of an IEEE-style
// format with kExp exponent bits (bias 2^(kExp-1) - 1) and kMan mantissa bits, to nearest even.
// The result may exceed the format's largest code; callers clamp (saturate or make inf).
template <int kExp, int kMan>
uint32_t RoundMagnitude(uint32_t abs_bits) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  constexpr int kShift = 23 - kMan;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 - kBias + 1) << 23;
  if (abs_bits < kMinNormalBits) {
    // Target subnormal (or zero): adding 2^(1 - bias + 23 - man) makes the FPU round the value to
    // a multiple of the target's subnormal step 2^(1 - bias - man) with round-to-nearest-even; the
    // low bits of the sum are then the code (2^man when it rounds up to the smallest normal).
    constexpr uint32_t kMagicBits = static_cast<uint32_t>((127 - kBias) + kShift + 1) << 23;
    const float sum = BitsToFloat(abs_bits) + BitsToFloat(kMagicBits);
    return FloatBits(sum) - kMagicBits;
  }
  // Normal: round the 23-bit mantissa to kMan bits in the integer domain; a carry out of the
  // mantissa correctly bumps the exponent. Then rebias the exponent.
  const uint32_t rounded = abs_bits + ((1u << (kShift - 1)) - 1u) + ((abs_bits >> kShift) & 1u);
  return (rounded >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMan);
}

}  // namespace
}  // namespace formats_internal

using formats_internal::FloatBits;
using formats_internal::RoundMagnitude;

uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65536 (and inf)
  return static_cast<uint16_t>(sign | std::min(RoundMagnitude<5, 10>(a), 0x7C00u));
}

uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  const uint32_t sign = (u >> 24) & 0x80u;
  if (a >= 0x44000000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 512 (and inf)
  return static_cast<uint8_t>(sign | std::min(RoundMagnitude<4, 3>(a), 0x7Eu));
}

uint8_t FloatToFp8E5M2(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Eu);
  if (a >= 0x47800000u) return static_cast<uint8_t>(sign | 0x7Cu);  // >= 65536 (and inf)
  return static_cast<uint8_t>(sign | std::min(RoundMagnitude<5, 2>(a), 0x7Cu));
}

uint8_t FloatToFp4E2M1(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7;
  const uint32_t sign = (u >> 28) & 0x8u;
  if (a >= 0x41000000u) return static_cast<uint8_t>(sign | 0x7u);  // >= 8 (and inf)
  return static_cast<uint8_t>(sign | std::min(RoundMagnitude<2, 1>(a), 0x7u));
}

uint8_t FloatToUe8m0(float scale) {
  const uint32_t u = FloatBits(scale);
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) {
    return (u & 0x80000000u) && (u & 0x7FFFFFFFu) == 0x7F800000u ? 0 : 0xFF;  // -inf -> 0
  }
  if (scale <= 0.0f) return 0;
  const uint32_t e = u >> 23;  // sign is 0 here
  if (e == 0) return 0;        // float subnormal: below 2^-126, clamps to 2^-127
  return static_cast<uint8_t>(std::min<uint32_t>(e, 254u));
}

std::string_view WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kFp8Block:
      return "fp8_block";
    case WeightFormat::kQ4_0:
      return "q4_0";
    case WeightFormat::kNvfp4:
      return "nvfp4";
    case WeightFormat::kMxfp4:
      return "mxfp4";
  }
  return "unknown";
}

absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name) {
  constexpr WeightFormat kAll[] = {WeightFormat::kBf16, WeightFormat::kFp8Block,
                                   WeightFormat::kQ4_0, WeightFormat::kNvfp4,
                                   WeightFormat::kMxfp4};
  std::string valid;
  for (WeightFormat f : kAll) {
    if (name == WeightFormatName(f)) return f;
    const std::string_view n = WeightFormatName(f);
    absl::StrAppend(&valid, valid.empty() ? "" : ", ", absl::string_view(n.data(), n.size()));
  }
  return absl::InvalidArgumentError(
      // Debian's Abseil is built with its own absl::string_view, distinct from std::string_view.
      absl::StrCat("unknown weight format '", absl::string_view(name.data(), name.size()),
                   "'; valid formats: ", valid));
}

// ---------------------------------------------------------------------------------------------
// q4_0

void QuantizeRowQ4_0(const float* x, int64_t n, BlockQ4_0* out) {
  constexpr int kQk = kQ4_0Block;
  for (int64_t b = 0; b < n / kQk; ++b) {
    const float* xb = x + b * kQk;
    // Follows llama.cpp's quantize_row_q4_0_reference operation for operation, so the bytes match.
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < kQk; ++j) {
      const float v = xb[j];
      if (amax < std::fabs(v)) {
        amax = std::fabs(v);
        max = v;
      }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = FloatToFp16(d);
    for (int j = 0; j < kQk / 2; ++j) {
      const float x0 = xb[j] * id;
      const float x1 = xb[kQk / 2 + j] * id;
      const uint8_t xi0 = std::min<int8_t>(15, static_cast<int8_t>(x0 + 8.5f));
      const uint8_t xi1 = std::min<int8_t>(15, static_cast<int8_t>(x1 + 8.5f));
      out[b].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void DequantizeRowQ4_0(const BlockQ4_0* in, int64_t n, float* out) {
  constexpr int kQk = kQ4_0Block;
  for (int64_t b = 0; b < n / kQk; ++b) {
    const float d = Fp16ToFloat(in[b].d);
    float* ob = out + b * kQk;
    for (int j = 0; j < kQk / 2; ++j) {
      ob[j] = static_cast<float>((in[b].qs[j] & 0x0F) - 8) * d;
      ob[j + kQk / 2] = static_cast<float>((in[b].qs[j] >> 4) - 8) * d;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// mxfp4 / nvfp4

namespace {

float BlockAmax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    // NaN must propagate (std::max would drop it depending on argument order).
    const float a = std::fabs(x[j]);
    if (!(a <= amax)) amax = a;
  }
  return amax;
}

// 2^k for k in [-149, 127] as an exact float.
float ExactPow2(int k) { return std::ldexp(1.0f, k); }

}  // namespace

void QuantizeRowMxfp4(const float* x, int64_t n, uint8_t* packed, uint8_t* scales) {
  for (int64_t b = 0; b < n / kMxfp4Block; ++b) {
    const float* xb = x + b * kMxfp4Block;
    uint8_t* pb = packed + b * (kMxfp4Block / 2);
    const float amax = BlockAmax(xb, kMxfp4Block);
    uint8_t e;
    if (!std::isfinite(amax)) {
      e = 0xFF;
    } else if (amax == 0.0f) {
      e = 0;
    } else {
      // floor(log2(amax)) - emax(e2m1) with emax = 2, clamped to the ue8m0 range.
      e = static_cast<uint8_t>(std::max(0, static_cast<int>(FloatToUe8m0(amax)) - 2));
    }
    scales[b] = e;
    // Multiplying by 2^(127 - e) is exact (a power of two; products that would fall into the
    // float subnormal range are far below fp4's smallest step and round to zero either way), so
    // the only rounding is the fp4 one.
    const float inv = e == 0xFF ? 0.0f : ExactPow2(127 - static_cast<int>(e));
    for (int j = 0; j < kMxfp4Block / 2; ++j) {
      const uint8_t lo = FloatToFp4E2M1(xb[2 * j] * inv);
      const uint8_t hi = FloatToFp4E2M1(xb[2 * j + 1] * inv);
      pb[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void DequantizeRowMxfp4(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t b = 0; b < n / kMxfp4Block; ++b) {
    const float s = Ue8m0ToFloat(scales[b]);
    const uint8_t* pb = packed + b * (kMxfp4Block / 2);
    float* ob = out + b * kMxfp4Block;
    for (int j = 0; j < kMxfp4Block / 2; ++j) {
      ob[2 * j] = Fp4E2M1ToFloat(pb[j] & 0x0F) * s;
      ob[2 * j + 1] = Fp4E2M1ToFloat(pb[j] >> 4) * s;
    }
  }
}

float Nvfp4GlobalScale(const float* x, int64_t n) {
  const float amax = BlockAmax(x, n);
  if (amax == 0.0f) return 1.0f;
  return amax / (448.0f * 6.0f);
}

void QuantizeRowNvfp4(const float* x, int64_t n, float global_scale, uint8_t* packed,
                      uint8_t* scales) {
  for (int64_t b = 0; b < n / kNvfp4Block; ++b) {
    const float* xb = x + b * kNvfp4Block;
    uint8_t* pb = packed + b * (kNvfp4Block / 2);
    const float amax = BlockAmax(xb, kNvfp4Block);
    const uint8_t sc = FloatToFp8E4M3(amax / (6.0f * global_scale));
    scales[b] = sc;
    const float denom = Fp8E4M3ToFloat(sc) * global_scale;
    const float inv = denom != 0.0f ? 1.0f / denom : 0.0f;
    for (int j = 0; j < kNvfp4Block / 2; ++j) {
      // x * (1 / denom) rather than x / denom: one division per block, as the GPU quantizers do;
      // the fp4 rounding (steps of >= 1/8 relative) dwarfs the extra half-ULP.
      const uint8_t lo = FloatToFp4E2M1(xb[2 * j] * inv);
      const uint8_t hi = FloatToFp4E2M1(xb[2 * j + 1] * inv);
      pb[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void DequantizeRowNvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale,
                        int64_t n, float* out) {
  for (int64_t b = 0; b < n / kNvfp4Block; ++b) {
    const float s = Fp8E4M3ToFloat(scales[b]) * global_scale;
    const uint8_t* pb = packed + b * (kNvfp4Block / 2);
    float* ob = out + b * kNvfp4Block;
    for (int j = 0; j < kNvfp4Block / 2; ++j) {
      ob[2 * j] = Fp4E2M1ToFloat(pb[j] & 0x0F) * s;
      ob[2 * j + 1] = Fp4E2M1ToFloat(pb[j] >> 4) * s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fp8 with 128x128 block scales

void QuantizeFp8Block(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  const int64_t brows = (rows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t bcols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int64_t br = 0; br < brows; ++br) {
    const int64_t r0 = br * kFp8BlockSize;
    const int64_t r1 = std::min(rows, r0 + kFp8BlockSize);
    for (int64_t bc = 0; bc < bcols; ++bc) {
      const int64_t c0 = bc * kFp8BlockSize;
      const int64_t c1 = std::min(cols, c0 + kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, BlockAmax(x + r * cols + c0, c1 - c0));
      const float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
      scales[br * bcols + bc] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = FloatToFp8E4M3(x[r * cols + c] / scale);
      }
    }
  }
}

void DequantizeFp8Block(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                        float* out) {
  const int64_t bcols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales + (r / kFp8BlockSize) * bcols;
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = Fp8E4M3ToFloat(q[r * cols + c]) * srow[c / kFp8BlockSize];
    }
  }
}

}  // namespace moe::common
