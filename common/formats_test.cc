// Scalar format conversions checked against an independent float64 reference written from the
// format definitions (sign, exponent, mantissa, bias): every code is decoded exhaustively, and
// encoders are compared with a brute-force "nearest code, ties to even" search over millions of
// random floats plus every midpoint between adjacent codes and its float neighbours.
#include "common/formats.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace moe::common {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A small binary floating-point format as its definition states it.
struct Spec {
  const char* name;
  int exp_bits;
  int man_bits;
  // The all-ones exponent encodes inf (mantissa 0) and NaN (otherwise), as in IEEE 754.
  bool ieee_specials;
  // Only the all-ones code (per sign) is NaN and there is no inf (OCP e4m3fn).
  bool fn_nan;
  // Finite values beyond the largest finite one: true = clamp to it, false = IEEE overflow to inf.
  bool saturates;
  std::function<double(uint32_t)> decode;  // the implementation under test, widened
  std::function<uint32_t(float)> encode;   // the implementation under test
};

int Bias(const Spec& s) { return (1 << (s.exp_bits - 1)) - 1; }
int Bits(const Spec& s) { return 1 + s.exp_bits + s.man_bits; }

double RefDecode(const Spec& s, uint32_t code) {
  const bool neg = (code >> (s.exp_bits + s.man_bits)) & 1;
  const int e = (code >> s.man_bits) & ((1 << s.exp_bits) - 1);
  const int m = code & ((1 << s.man_bits) - 1);
  const int emax = (1 << s.exp_bits) - 1;
  double v;
  if (s.ieee_specials && e == emax) {
    v = m == 0 ? kInf : std::numeric_limits<double>::quiet_NaN();
  } else if (s.fn_nan && e == emax && m == (1 << s.man_bits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - Bias(s) - s.man_bits);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -s.man_bits), e - Bias(s));
  }
  return neg ? -v : v;
}

// Brute-force reference encoder over the list of non-negative finite codes.
class RefEncoder {
 public:
  explicit RefEncoder(const Spec& s) : s_(s) {
    for (uint32_t c = 0; c < (1u << (Bits(s) - 1)); ++c) {
      const double v = RefDecode(s, c);
      if (std::isfinite(v)) grid_.push_back({v, c});
    }
    std::sort(grid_.begin(), grid_.end());
    for (size_t i = 1; i < grid_.size(); ++i) {
      // Strictly increasing: a duplicate would make "nearest" ambiguous.
      EXPECT_LT(grid_[i - 1].first, grid_[i].first) << s.name;
    }
  }

  // x is not NaN.
  uint32_t Encode(double x) const {
    const uint32_t sign = std::signbit(x) ? 1u << (Bits(s_) - 1) : 0u;
    const double a = std::fabs(x);
    const double max = grid_.back().first;
    if (s_.saturates) {
      if (a >= max) return sign | grid_.back().second;
    } else {
      // IEEE: round as if the exponent range were unbounded; what rounds past max is inf. The
      // next "value" above max would be max + ulp, so the boundary is max + ulp / 2, and a tie
      // there goes to the even one (inf), since max has an all-ones (odd) mantissa.
      const double ulp = max - grid_[grid_.size() - 2].first;
      const uint32_t inf_code = ((1u << s_.exp_bits) - 1) << s_.man_bits;
      if (a >= max + ulp / 2) return sign | inf_code;
    }
    auto it = std::upper_bound(grid_.begin(), grid_.end(), std::make_pair(a, ~0u));
    const auto& lo = *(it - 1);  // grid_[0] is +0 <= a
    if (it == grid_.end()) return sign | lo.second;
    const auto& hi = *it;
    const double dlo = a - lo.first;
    const double dhi = hi.first - a;
    if (dlo < dhi) return sign | lo.second;
    if (dhi < dlo) return sign | hi.second;
    return sign | ((lo.second & 1) == 0 ? lo.second : hi.second);  // tie: even mantissa
  }

  const std::vector<std::pair<double, uint32_t>>& grid() const { return grid_; }

 private:
  const Spec& s_;
  std::vector<std::pair<double, uint32_t>> grid_;
};

std::vector<Spec> AllSpecs() {
  return {
      {"bf16", 8, 7, true, false, false, [](uint32_t c) { return double{Bf16ToFloat(c)}; },
       [](float f) -> uint32_t { return FloatToBf16(f); }},
      {"fp16", 5, 10, true, false, false, [](uint32_t c) { return double{Fp16ToFloat(c)}; },
       [](float f) -> uint32_t { return FloatToFp16(f); }},
      {"fp8_e4m3", 4, 3, false, true, true,
       [](uint32_t c) { return double{Fp8E4M3ToFloat(c)}; },
       [](float f) -> uint32_t { return FloatToFp8E4M3(f); }},
      {"fp8_e5m2", 5, 2, true, false, false,
       [](uint32_t c) { return double{Fp8E5M2ToFloat(c)}; },
       [](float f) -> uint32_t { return FloatToFp8E5M2(f); }},
      {"fp4_e2m1", 2, 1, false, false, true,
       [](uint32_t c) { return double{Fp4E2M1ToFloat(c)}; },
       [](float f) -> uint32_t { return FloatToFp4E2M1(f); }},
  };
}

class FormatTest : public ::testing::TestWithParam<int> {
 protected:
  const Spec& spec() const { return specs_[GetParam()]; }
  std::vector<Spec> specs_ = AllSpecs();
};

TEST_P(FormatTest, DecodesEveryCodeExactly) {
  const Spec& s = spec();
  for (uint32_t c = 0; c < (1u << Bits(s)); ++c) {
    const double ref = RefDecode(s, c);
    const double got = s.decode(c);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << s.name << absl::StrFormat(" code 0x%x", c);
    } else {
      ASSERT_EQ(got, ref) << s.name << absl::StrFormat(" code 0x%x", c);
      ASSERT_EQ(std::signbit(got), std::signbit(ref)) << s.name << absl::StrFormat(" 0x%x", c);
    }
  }
}

::testing::AssertionResult EncodesLikeReference(const Spec& s, const RefEncoder& ref, float f) {
  const uint32_t want = ref.Encode(f);
  const uint32_t got = s.encode(f);
  if (got == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << s.name << absl::StrFormat(" x=%.9g (bits 0x%08x): got 0x%x want 0x%x", f,
                                      absl::bit_cast<uint32_t>(f), got, want);
}

TEST_P(FormatTest, EncodesEveryCodeValueMidpointAndNeighbour) {
  const Spec& s = spec();
  const RefEncoder ref(s);
  const auto& grid = ref.grid();
  std::vector<float> xs;
  for (size_t i = 0; i < grid.size(); ++i) {
    const float v = static_cast<float>(grid[i].first);
    ASSERT_EQ(double{v}, grid[i].first);
    xs.push_back(v);
    // The midpoint to the next code (or, past the largest, to where the next binade's first
    // value would be): the tie cases, which must go to the even mantissa (or to inf / saturate).
    const double next = i + 1 < grid.size() ? grid[i + 1].first
                                            : 2 * grid[i].first - grid[i - 1].first;
    const double mid = (grid[i].first + next) / 2;
    const float fmid = static_cast<float>(mid);
    ASSERT_EQ(double{fmid}, mid) << "midpoint not representable in float";
    const float up = std::numeric_limits<float>::infinity();
    for (float x : {fmid, std::nextafter(fmid, 0.0f), std::nextafter(fmid, up),
                    std::nextafter(v, 0.0f), std::nextafter(v, up)}) {
      xs.push_back(x);
    }
  }
  xs.push_back(std::numeric_limits<float>::infinity());
  xs.push_back(std::numeric_limits<float>::max());
  xs.push_back(std::numeric_limits<float>::denorm_min());
  xs.push_back(std::numeric_limits<float>::min());
  for (float x : xs) {
    ASSERT_TRUE(EncodesLikeReference(s, ref, x));
    ASSERT_TRUE(EncodesLikeReference(s, ref, -x));
  }
}

TEST_P(FormatTest, EncodesRandomFloatsLikeReference) {
  const Spec& s = spec();
  const RefEncoder ref(s);
  const double max = ref.grid().back().first;
  const double min_sub = ref.grid()[1].first;
  std::mt19937_64 rng(0x5eed + GetParam());
  std::uniform_real_distribution<double> uni(-1.5 * max, 1.5 * max);
  std::uniform_real_distribution<double> log2mag(std::log2(min_sub) - 3, std::log2(max) + 2);
  constexpr int kPerKind = 1 << 20;
  for (int i = 0; i < kPerKind; ++i) {
    // Any float bit pattern (most are far outside the format's range: overflow / underflow).
    const uint32_t bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    if (!std::isnan(f)) {
      ASSERT_TRUE(EncodesLikeReference(s, ref, f));
    }
    // Uniform over the format's range: mostly the largest binades.
    ASSERT_TRUE(EncodesLikeReference(s, ref, static_cast<float>(uni(rng))));
    // Log-uniform magnitude: every binade, subnormals included.
    const float g = static_cast<float>(std::exp2(log2mag(rng)));
    ASSERT_TRUE(EncodesLikeReference(s, ref, (rng() & 1) ? -g : g));
  }
}

std::string SpecName(const ::testing::TestParamInfo<int>& info) {
  return AllSpecs()[info.param].name;
}
INSTANTIATE_TEST_SUITE_P(AllFormats, FormatTest, ::testing::Range(0, 5), SpecName);

float BitsToFloat(uint32_t u) { return absl::bit_cast<float>(u); }

TEST(NanTest, EachFormatKeepsOrMapsNanAsDocumented) {
  for (uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    const float nan = BitsToFloat(bits);
    const bool neg = bits >> 31;
    SCOPED_TRACE(absl::StrFormat("NaN bits 0x%08x", bits));
    // bf16: still NaN (quiet: a signalling payload truncated to zero would read as inf), sign kept.
    const uint16_t b = FloatToBf16(nan);
    EXPECT_TRUE(std::isnan(Bf16ToFloat(b)));
    EXPECT_TRUE(b & 0x0040);
    EXPECT_EQ(b >> 15, neg ? 1 : 0);
    const uint16_t h = FloatToFp16(nan);
    EXPECT_TRUE(std::isnan(Fp16ToFloat(h)));
    EXPECT_TRUE(h & 0x0200);
    EXPECT_EQ(h >> 15, neg ? 1 : 0);
    EXPECT_EQ(FloatToFp8E4M3(nan), 0x7F);
    EXPECT_EQ(FloatToFp8E5M2(nan), neg ? 0xFE : 0x7E);
    EXPECT_TRUE(std::isnan(Fp8E5M2ToFloat(FloatToFp8E5M2(nan))));
    EXPECT_EQ(FloatToFp4E2M1(nan), 0x7);
  }
}

TEST(SaturationTest, DocumentedOverflowBehaviour) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToFp8E4M3(inf), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-inf), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(1e30f), 0x7E);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(FloatToFp8E5M2(61439.0f), 0x7B);  // below max + ulp/2: stays at 57344
  EXPECT_EQ(FloatToFp8E5M2(61440.0f), 0x7C);  // the tie: inf
  EXPECT_EQ(FloatToFp8E5M2(-1e30f), 0xFC);
  EXPECT_EQ(FloatToFp4E2M1(7.0f), 0x7);
  EXPECT_EQ(FloatToFp4E2M1(-inf), 0xF);
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7C00);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
}

TEST(Ue8m0Test, DecodesEveryCode) {
  for (int e = 0; e < 255; ++e) {
    EXPECT_EQ(double{Ue8m0ToFloat(static_cast<uint8_t>(e))}, std::ldexp(1.0, e - 127)) << e;
  }
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(0xFF)));
}

// floor(log2(s)) + 127 clamped to [0, 254], computed in double by frexp (exact).
uint8_t RefUe8m0(float s) {
  if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) return 0xFF;
  if (!(s > 0)) return 0;
  int exp;
  std::frexp(double{s}, &exp);  // s = f * 2^exp, f in [0.5, 1): floor(log2 s) = exp - 1
  return static_cast<uint8_t>(std::clamp(exp - 1 + 127, 0, 254));
}

TEST(Ue8m0Test, EncodeRoundsDownToAPowerOfTwo) {
  for (int e = 0; e < 255; ++e) {
    const float p = std::ldexp(1.0f, e - 127);
    EXPECT_EQ(FloatToUe8m0(p), e);
    EXPECT_EQ(FloatToUe8m0(std::nextafter(2 * p, 0.0f)), e);  // just below the next power
    EXPECT_EQ(FloatToUe8m0(1.5f * p), e);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1 << 20; ++i) {
    const float f = BitsToFloat(static_cast<uint32_t>(rng()));
    ASSERT_EQ(FloatToUe8m0(f), RefUe8m0(f)) << f;
  }
  EXPECT_EQ(FloatToUe8m0(0.0f), 0);
  EXPECT_EQ(FloatToUe8m0(-1.0f), 0);
  EXPECT_EQ(FloatToUe8m0(std::numeric_limits<float>::infinity()), 0xFF);
  EXPECT_EQ(FloatToUe8m0(std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(FloatToUe8m0(std::numeric_limits<float>::max()), 254);
  EXPECT_EQ(FloatToUe8m0(std::numeric_limits<float>::denorm_min()), 0);
}

TEST(WeightFormatTest, NamesRoundTrip) {
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8Block, WeightFormat::kQ4_0,
                         WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    auto parsed = ParseWeightFormat(WeightFormatName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(WeightFormatName(WeightFormat::kFp8Block), "fp8_block");
  EXPECT_EQ(WeightFormatName(WeightFormat::kQ4_0), "q4_0");
}

TEST(WeightFormatTest, BadNameIsInvalidArgumentNamingValidOnes) {
  for (const char* bad : {"", "BF16", "fp4", "q4_1"}) {
    auto parsed = ParseWeightFormat(bad);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(parsed.status().message());
    EXPECT_NE(msg.find(absl::StrFormat("'%s'", bad)), std::string::npos) << msg;
    for (const char* valid : {"bf16", "fp8_block", "q4_0", "nvfp4", "mxfp4"}) {
      EXPECT_NE(msg.find(valid), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace moe::common
