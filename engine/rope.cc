#include "engine/rope.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::engine {
namespace {

double YarnGetMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

absl::StatusOr<RopeParams> ComputeRopeParams(const ModelConfig& config) {
  // transformers: dim = int(head_dim * partial_rotary_factor) in every rope type.
  const int dim = config.rotary_dim();
  if (dim <= 0 || dim % 2 != 0 || dim > config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotary dimensions ", dim, " (head_dim ", config.head_dim, " x partial_rotary_factor ",
        config.partial_rotary_factor, ") must be even, > 0 and at most head_dim"));
  }
  const double base = config.rope_theta;
  if (!(base > 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_theta ", base, " must be > 1"));
  }
  const RopeScaling& rs = config.rope_scaling;
  RopeParams p;
  p.inv_freq.resize(dim / 2);
  // transformers: base ** (arange(0, dim, 2).float() / dim), all in float32.
  std::vector<float> pos_freqs(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    pos_freqs[i] = std::pow(static_cast<float>(base), exponent);
  }
  const std::string& type = rs.type;
  if (type.empty() || type == "default" || type == "dynamic") {
    // "dynamic" changes the base only past max_position_embeddings, which the engine never
    // reaches (max_context is capped by it).
    for (int i = 0; i < dim / 2; ++i) p.inv_freq[i] = 1.0f / pos_freqs[i];
    return p;
  }
  if (type == "linear") {
    if (!(rs.factor > 0)) return absl::InvalidArgumentError("rope_scaling.factor must be > 0");
    for (int i = 0; i < dim / 2; ++i) {
      p.inv_freq[i] = (1.0f / pos_freqs[i]) / static_cast<float>(rs.factor);
    }
    return p;
  }
  if (type != "yarn") {
    return absl::InvalidArgumentError(absl::StrCat("rope_scaling type '", type,
                                                   "' is not supported (default, linear, "
                                                   "dynamic, yarn)"));
  }
  double factor = rs.factor;
  int original_max = config.max_position_embeddings;
  if (rs.original_max_position_embeddings > 0) {
    // As transformers: a checkpoint that names its pretraining length scales by the ratio.
    original_max = rs.original_max_position_embeddings;
    factor = static_cast<double>(config.max_position_embeddings) / original_max;
  }
  if (!(factor > 0) || original_max <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("yarn rope_scaling: factor ", factor,
                                                   " and original max positions ", original_max,
                                                   " must be > 0"));
  }
  double attention_factor = rs.attention_factor;
  if (attention_factor <= 0) {
    if (rs.mscale != 0 && rs.mscale_all_dim != 0) {
      attention_factor =
          YarnGetMscale(factor, rs.mscale) / YarnGetMscale(factor, rs.mscale_all_dim);
    } else {
      attention_factor = YarnGetMscale(factor, 1.0);
    }
  }
  const double beta_fast = rs.beta_fast != 0 ? rs.beta_fast : 32.0;
  const double beta_slow = rs.beta_slow != 0 ? rs.beta_slow : 1.0;
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(original_max / (rotations * 2 * M_PI))) / (2 * std::log(base));
  };
  double low = std::floor(correction_dim(beta_fast));
  double high = std::ceil(correction_dim(beta_slow));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  float lo = static_cast<float>(low), hi = static_cast<float>(high);
  if (lo == hi) hi += 0.001f;
  for (int i = 0; i < dim / 2; ++i) {
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freqs[i]);
    const float ramp = std::clamp((static_cast<float>(i) - lo) / (hi - lo), 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    p.inv_freq[i] =
        interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  p.attention_factor = static_cast<float>(attention_factor);
  return p;
}

RopeTable::RopeTable(const RopeParams& params, int head_dim, int max_positions)
    : head_dim_(head_dim),
      rotary_dim_(2 * static_cast<int>(params.inv_freq.size())),
      max_positions_(max_positions) {
  const int half = rotary_dim_ / 2;
  cos_.resize(static_cast<size_t>(max_positions) * half);
  sin_.resize(cos_.size());
  for (int pos = 0; pos < max_positions; ++pos) {
    for (int i = 0; i < half; ++i) {
      // transformers: freqs = position (float32) * inv_freq (float32); cos/sin in float32,
      // then times attention_scaling.
      const float f = static_cast<float>(pos) * params.inv_freq[i];
      cos_[static_cast<size_t>(pos) * half + i] = std::cos(f) * params.attention_factor;
      sin_[static_cast<size_t>(pos) * half + i] = std::sin(f) * params.attention_factor;
    }
  }
}

void RopeTable::Apply(float* x, int num_heads, int position) const {
  const int half = rotary_dim_ / 2;
  const float* c = cos_.data() + static_cast<size_t>(position) * half;
  const float* s = sin_.data() + static_cast<size_t>(position) * half;
  for (int h = 0; h < num_heads; ++h) {
    float* v = x + static_cast<size_t>(h) * head_dim_;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
      v[i] = a * c[i] - b * s[i];
      v[i + half] = b * c[i] + a * s[i];
    }
  }
}

}  // namespace moe::engine
