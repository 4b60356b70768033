// Numeric formats of MoE weights and activations, converted exactly on the CPU:
//   - scalar codes: bf16, fp16, fp8 e4m3 (OCP "e4m3fn") and e5m2, fp4 e2m1, ue8m0 scales;
//   - the weight formats of MoE checkpoints and their block layouts: q4_0 (llama.cpp), mxfp4 (OCP
//     MX), nvfp4 (NVIDIA), fp8 with 128x128 block scales (DeepSeek / Qwen FP8), plus bf16.
// Decoders are inline (shifts or table lookups) because CPU MoE kernels call them on hot paths;
// encoders live in formats.cc. Every encoder rounds to nearest, ties to even, as the formats'
// specifications (and CUDA's __float2bfloat16_rn / __nv_cvt_float_to_fp8) do.
#ifndef MOE_COMMON_FORMATS_H_
#define MOE_COMMON_FORMATS_H_

#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace moe::common {

namespace formats_internal {
// Decode tables (constant-initialized in formats.cc, so usable from static initializers).
extern const float kFp8E4M3ToFloat[256];
extern const float kFp8E5M2ToFloat[256];
extern const float kFp4E2M1ToFloat[16];

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
}  // namespace formats_internal

// ---------------------------------------------------------------------------------------------
// Scalar conversions.

// bf16: the upper half of an IEEE float. Round to nearest even; overflow gives +-inf (IEEE
// rounding: values >= max + half an ULP); NaN stays NaN with its sign and is made quiet (the
// truncated payload could otherwise read as inf).
inline uint16_t FloatToBf16(float f) {
  const uint32_t u = formats_internal::FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float Bf16ToFloat(uint16_t h) {
  return formats_internal::BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// fp16 (IEEE binary16). Round to nearest even, subnormals exact, overflow -> +-inf, NaN -> quiet
// NaN keeping the sign and the top payload bits.
uint16_t FloatToFp16(float f);
inline float Fp16ToFloat(uint16_t h) {
  // Rebias exponent and mantissa in one shift; subnormals are fixed up by one float subtraction
  // (exact), inf/NaN by a second exponent adjustment. Branch-light, no table (fp16 would need 256 KiB).
  using formats_internal::BitsToFloat;
  using formats_internal::FloatBits;
  constexpr uint32_t kShiftedExp = 0x7C00u << 13;
  uint32_t o = (static_cast<uint32_t>(h) & 0x7FFFu) << 13;
  const uint32_t exp = o & kShiftedExp;
  o += (127u - 15u) << 23;
  if (exp == kShiftedExp) {
    o += (128u - 16u) << 23;  // inf / NaN
  } else if (exp == 0) {
    o += 1u << 23;  // subnormal: renormalize
    o = FloatBits(BitsToFloat(o) - BitsToFloat(113u << 23));
  }
  o |= (static_cast<uint32_t>(h) & 0x8000u) << 16;
  return BitsToFloat(o);
}

// fp8 e4m3, OCP "e4m3fn": bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448.
// Round to nearest even; finite values beyond 448 and +-inf saturate to +-448 (as CUDA's
// __NV_SATFINITE and the usual fp8 checkpoint quantizers); NaN -> 0x7F (any sign).
uint8_t FloatToFp8E4M3(float f);
inline float Fp8E4M3ToFloat(uint8_t v) { return formats_internal::kFp8E4M3ToFloat[v]; }

// fp8 e5m2: IEEE-like, bias 15, has +-inf and NaN, max finite 57344. Round to nearest even;
// overflow gives +-inf (NOT saturating: IEEE rounding, as torch.float8_e5m2 and CUDA's
// __NV_NOSAT); NaN -> quiet NaN 0x7E with the input's sign.
uint8_t FloatToFp8E5M2(float f);
inline float Fp8E5M2ToFloat(uint8_t v) { return formats_internal::kFp8E5M2ToFloat[v]; }

// fp4 e2m1 (OCP MX): a nibble 0..15 = sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
// Values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Round to nearest even; saturates to +-6 (inf too). The
// format has no NaN: NaN maps to +6 (0x7), as CUDA's __nv_cvt_float_to_fp4 does.
uint8_t FloatToFp4E2M1(float f);
inline float Fp4E2M1ToFloat(uint8_t nibble) {
  return formats_internal::kFp4E2M1ToFloat[nibble & 0xF];
}

// ue8m0 (OCP MX scale): an 8-bit biased exponent, value 2^(e - 127); 0xFF is NaN.
// FloatToUe8m0 rounds DOWN to a power of two: it returns floor(log2(scale)) + 127, clamped to
// [0, 254]. That is the MX rule: the shared scale of a block is 2^(floor(log2(amax)) - emax_elem)
// (OCP MX v1.0, section 6.3), so QuantizeRowMxfp4 calls FloatToUe8m0(amax) - 2 (emax of e2m1 is 2).
// scale <= 0 (and subnormals below 2^-127) give 0; +inf and NaN give 0xFF.
uint8_t FloatToUe8m0(float scale);
inline float Ue8m0ToFloat(uint8_t e) {
  if (e == 0xFF) return formats_internal::BitsToFloat(0x7FC00000u);
  if (e == 0) return formats_internal::BitsToFloat(0x00400000u);  // 2^-127, a float subnormal
  return formats_internal::BitsToFloat(static_cast<uint32_t>(e) << 23);
}

// ---------------------------------------------------------------------------------------------
// Weight formats.

enum class WeightFormat { kBf16, kFp8Block, kQ4_0, kNvfp4, kMxfp4 };

// "bf16", "fp8_block", "q4_0", "nvfp4", "mxfp4".
std::string_view WeightFormatName(WeightFormat f);
// The inverse of WeightFormatName (exact, case-sensitive); InvalidArgument naming the bad value
// and the valid names otherwise.
absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name);

constexpr int kQ4_0Block = 32;
constexpr int kMxfp4Block = 32;
constexpr int kNvfp4Block = 16;
constexpr int kFp8BlockSize = 128;

// All row functions below require n to be a multiple of their block size (kQ4_0Block,
// kMxfp4Block, kNvfp4Block); callers check it (these are hot-path primitives and do not return
// Status). Inputs must be finite unless a function says otherwise.

// q4_0, llama.cpp's layout (block_q4_0): 32 weights share one fp16 scale d; element j of the
// block is (qs[j] & 15) - 8 and element j + 16 is (qs[j] >> 4) - 8, each times fp16(d).
struct BlockQ4_0 {
  uint16_t d;  // fp16 bits
  uint8_t qs[kQ4_0Block / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "BlockQ4_0 must match llama.cpp's 18-byte block_q4_0");

// Bit-exact with llama.cpp's quantize_row_q4_0_reference: d = (the signed value of largest
// magnitude) / -8, q = min(15, (int8_t)(x / d + 8.5)). out has n / 32 blocks.
void QuantizeRowQ4_0(const float* x, int64_t n, BlockQ4_0* out);
void DequantizeRowQ4_0(const BlockQ4_0* in, int64_t n, float* out);

// mxfp4 (OCP MX): packed[n / 2] holds fp4 e2m1 codes, element 2i in the low nibble of packed[i]
// and element 2i + 1 in the high nibble; scales[n / 32] are ue8m0. value = fp4 * 2^(scale - 127).
// The scale is 2^(floor(log2(amax)) - 2) (the spec's rule, see FloatToUe8m0), so x / scale lies
// in [4, 8) for the largest element and values above 6 * scale clamp to 6 * scale, as the spec
// prescribes. An all-zero block gets scale code 0. A block whose amax is inf or NaN gets the NaN
// scale 0xFF (the whole block then decodes to NaN).
void QuantizeRowMxfp4(const float* x, int64_t n, uint8_t* packed, uint8_t* scales);
void DequantizeRowMxfp4(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out);

// nvfp4: packed[n / 2] fp4 e2m1 codes (nibble order as mxfp4), scales[n / 16] fp8 e4m3, and one
// fp32 global_scale per tensor: value = fp4 * e4m3(scale) * global_scale.
// Nvfp4GlobalScale = amax / (448 * 6) over the whole tensor (1 if it is all zero), which lets the
// block scale amax_block / 6 / global_scale use the whole e4m3 range.
float Nvfp4GlobalScale(const float* x, int64_t n);
// Block scale = e4m3(amax_block / (6 * global_scale)) (RNE); elements = fp4(x / (scale *
// global_scale)) (RNE, saturating: rounding the scale down can push x / scale slightly above 6).
// A block whose scale rounds to zero stores zero elements.
void QuantizeRowNvfp4(const float* x, int64_t n, float global_scale, uint8_t* packed,
                      uint8_t* scales);
void DequantizeRowNvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale,
                        int64_t n, float* out);

// fp8 with 128x128 block scales (DeepSeek-V3 / Qwen3 FP8 checkpoints, "weight_scale_inv"):
// q[rows, cols] fp8 e4m3 row-major, scales float [ceil(rows / 128), ceil(cols / 128)] row-major,
// value = fp8 * scale. Edge blocks may be partial. scale = amax_block / 448, or 1 for an all-zero
// block (never 0, so 1 / scale stays finite for callers that invert it).
void QuantizeFp8Block(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales);
void DequantizeFp8Block(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                        float* out);

}  // namespace moe::common

#endif  // MOE_COMMON_FORMATS_H_
