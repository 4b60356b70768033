// Random experts, slot placement and the float64 reference: see expert_test_util.h.
#include "engine/cuda/experts/expert_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/cuda/experts/routed_experts.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::engine::gpu {
namespace {

using common::WeightFormat;

void RandomMatrix(std::mt19937& rng, int64_t rows, int64_t cols, float* out) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float scale = 2.0f / std::sqrt(static_cast<float>(cols));
  for (int64_t i = 0; i < rows * cols; ++i) out[i] = scale * u(rng);
}

// Rounds to bf16: the bytes, and the values they hold.
void ToBf16(const float* in, int64_t n, uint8_t* bytes, float* values) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = common::FloatToBf16(in[i]);
    std::memcpy(bytes + 2 * i, &b, 2);
    values[i] = common::Bf16ToFloat(b);
  }
}

// Quantizes rows to q4_0 blocks (row-major) and returns their dequantized values.
std::vector<uint8_t> ToQ4(const float* in, int64_t rows, int64_t cols, float* values) {
  const int64_t row_bytes = cols / common::kQ4_0Block * sizeof(common::BlockQ4_0);
  std::vector<uint8_t> blocks(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    auto* b = reinterpret_cast<common::BlockQ4_0*>(blocks.data() + r * row_bytes);
    common::QuantizeRowQ4_0(in + r * cols, cols, b);
    common::DequantizeRowQ4_0(b, cols, values + r * cols);
  }
  return blocks;
}

// Quantizes rows to nvfp4 (row-major codes and e4m3 scales, cpu_moe's row-major layout) with
// one global scale, and returns the values without it (e2m1 * e4m3: exact in f32).
void ToNvfp4(const float* in, int64_t rows, int64_t cols, float global, uint8_t* codes,
             uint8_t* scales, float* values) {
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* c = codes + r * cols / 2;
    uint8_t* sc = scales + r * cols / common::kNvfp4Block;
    common::QuantizeRowNvfp4(in + r * cols, cols, global, c, sc);
    common::DequantizeRowNvfp4(c, sc, 1.0f, cols, values + r * cols);
  }
}

// Quantizes a [rows, cols] matrix to fp8 with 128x128 block scales; values get the e4m3 codes
// decoded, scales the block scales.
std::vector<uint8_t> ToFp8(const float* in, int64_t rows, int64_t cols, float* values,
                           float* scales) {
  std::vector<uint8_t> q(rows * cols);
  common::QuantizeFp8Block(in, rows, cols, q.data(), scales);
  for (int64_t i = 0; i < rows * cols; ++i) values[i] = common::Fp8E4M3ToFloat(q[i]);
  return q;
}

int64_t ScaleBlocks(int64_t rows, int64_t cols) {
  constexpr int64_t b = common::kFp8BlockSize;
  return (rows + b - 1) / b * ((cols + b - 1) / b);
}

double Silu(double g) { return g / (1.0 + std::exp(-g)); }

// Row `r` of a [rows, n] matrix of values (block scales [ceil(rows/128), ceil(n/128)], or null)
// dotted with v in float64: the dot and the sum of |terms|.
template <class V>
void RowDot(const float* values, const float* block_scales, int64_t r, int64_t n, const V* v,
            double* dot, double* abs_terms) {
  constexpr int64_t kB = common::kFp8BlockSize;
  const float* row = values + r * n;
  const float* srow =
      block_scales == nullptr ? nullptr : block_scales + (r / kB) * ((n + kB - 1) / kB);
  double d = 0, a = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kB) {
    const int64_t c1 = std::min(n, c0 + kB);
    const double s = srow == nullptr ? 1.0 : srow[c0 / kB];
    double bd = 0, ba = 0;
    for (int64_t c = c0; c < c1; ++c) {
      const double t = static_cast<double>(row[c]) * v[c];
      bd += t;
      ba += std::fabs(t);
    }
    d += s * bd;
    a += std::fabs(s) * ba;
  }
  *dot = d;
  *abs_terms = a;
}

}  // namespace

const TestBank* TestExperts::Bank(std::string_view name) const {
  for (const TestBank& b : banks) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

uint64_t TestExperts::BytesPerExpert() const {
  uint64_t n = 0;
  for (const TestBank& b : banks) n += b.bytes;
  return n;
}

absl::StatusOr<TestExperts> MakeTestExperts(WeightFormat format, int num_experts, int hidden,
                                            int intermediate, uint32_t seed) {
  TestExperts t;
  t.format = format;
  t.hidden = hidden;
  t.intermediate = intermediate;
  t.num_experts = num_experts;
  ASSIGN_OR_RETURN(std::vector<ExpertBankSize> sizes,
                   ExpertBankSizes(format, hidden, intermediate));
  for (const ExpertBankSize& b : sizes) {
    t.banks.push_back({std::string(b.name), b.bytes, std::vector<uint8_t>(num_experts * b.bytes)});
  }
  // Expert e's row of bank `name`.
  auto row = [&](const char* name, int64_t e) {
    for (TestBank& b : t.banks) {
      if (b.name == name) return b.data.data() + e * b.bytes;
    }
    return static_cast<uint8_t*>(nullptr);
  };
  auto put = [&](const char* name, int64_t e, const void* p, uint64_t n) -> absl::Status {
    uint8_t* dst = row(name, e);
    const TestBank* b = t.Bank(name);
    if (dst == nullptr || b->bytes != n) {
      return absl::InternalError(
          absl::StrCat("test experts: bank ", name, " is not ", n, " bytes per expert"));
    }
    std::memcpy(dst, p, n);
    return absl::OkStatus();
  };
  const int64_t H = hidden, I = intermediate, E = num_experts;
  t.gate_up_values.resize(E * 2 * I * H);
  t.down_values.resize(E * H * I);
  if (format == WeightFormat::kFp8Block) {
    t.gate_up_block_scales.resize(E * ScaleBlocks(2 * I, H));
    t.down_block_scales.resize(E * ScaleBlocks(H, I));
  }
  if (format == WeightFormat::kNvfp4) {
    t.gate_global.resize(E);
    t.up_global.resize(E);
    t.down_global.resize(E);
  }
  std::mt19937 rng(seed);
  std::vector<float> gu(2 * I * H), dn(H * I);
  for (int64_t e = 0; e < E; ++e) {
    RandomMatrix(rng, 2 * I, H, gu.data());
    RandomMatrix(rng, H, I, dn.data());
    float* gu_values = t.gate_up_values.data() + e * 2 * I * H;
    float* dn_values = t.down_values.data() + e * H * I;
    switch (format) {
      case WeightFormat::kBf16:
        ToBf16(gu.data(), 2 * I * H, row("gate_up", e), gu_values);
        ToBf16(dn.data(), H * I, row("down", e), dn_values);
        continue;
      case WeightFormat::kFp8Block: {
        // The loader's layout: [gate; up] quantized as one [2I, H] matrix.
        float* gs = t.gate_up_block_scales.data() + e * ScaleBlocks(2 * I, H);
        float* ds = t.down_block_scales.data() + e * ScaleBlocks(H, I);
        const std::vector<uint8_t> gq = ToFp8(gu.data(), 2 * I, H, gu_values, gs);
        const std::vector<uint8_t> dq = ToFp8(dn.data(), H, I, dn_values, ds);
        RETURN_IF_ERROR(put("gate_up", e, gq.data(), gq.size()));
        RETURN_IF_ERROR(put("gate_up_scales", e, gs, ScaleBlocks(2 * I, H) * 4));
        RETURN_IF_ERROR(put("down", e, dq.data(), dq.size()));
        RETURN_IF_ERROR(put("down_scales", e, ds, ScaleBlocks(H, I) * 4));
        continue;
      }
      default:
        break;
    }
    // q4_0 and nvfp4: the loader's path, a one-expert row-major bank packed into panels.
    cpu_moe::ExpertBank one;
    one.format = format;
    one.num_experts = 1;
    one.hidden = hidden;
    one.intermediate = intermediate;
    std::vector<uint8_t> gu_codes, dn_codes, gu_scales, dn_scales;
    float gate_g = 1, up_g = 1, down_g = 1;
    if (format == WeightFormat::kQ4_0) {
      gu_codes = ToQ4(gu.data(), 2 * I, H, gu_values);
      dn_codes = ToQ4(dn.data(), H, I, dn_values);
    } else {
      // Gate and up quantized as two tensors with their own global scales (as NVIDIA's NVFP4
      // checkpoints are), the up rows smaller so that the two scales differ.
      for (int64_t i = I * H; i < 2 * I * H; ++i) gu[i] *= 0.25f;
      gate_g = common::Nvfp4GlobalScale(gu.data(), I * H);
      up_g = common::Nvfp4GlobalScale(gu.data() + I * H, I * H);
      down_g = common::Nvfp4GlobalScale(dn.data(), H * I);
      gu_codes.resize(2 * I * H / 2);
      gu_scales.resize(2 * I * H / common::kNvfp4Block);
      dn_codes.resize(H * I / 2);
      dn_scales.resize(H * I / common::kNvfp4Block);
      ToNvfp4(gu.data(), I, H, gate_g, gu_codes.data(), gu_scales.data(), gu_values);
      ToNvfp4(gu.data() + I * H, I, H, up_g, gu_codes.data() + I * H / 2,
              gu_scales.data() + I * H / common::kNvfp4Block, gu_values + I * H);
      ToNvfp4(dn.data(), H, I, down_g, dn_codes.data(), dn_scales.data(), dn_values);
      t.gate_global[e] = gate_g;
      t.up_global[e] = up_g;
      t.down_global[e] = down_g;
      one.gate_up_scales = gu_scales.data();
      one.down_scales = dn_scales.data();
      one.gate_up_global_scales = &gate_g;
      one.up_global_scales = &up_g;
      one.down_global_scales = &down_g;
    }
    one.gate_up_weights = gu_codes.data();
    one.down_weights = dn_codes.data();
    ASSIGN_OR_RETURN(std::unique_ptr<cpu_moe::PanelBank> panels, cpu_moe::PackPanels(one));
    RETURN_IF_ERROR(put("gate_up", e, panels->gate_up.data(), panels->gate_up.bytes()));
    RETURN_IF_ERROR(put("down", e, panels->down.data(), panels->down.bytes()));
    if (format == WeightFormat::kNvfp4) {
      RETURN_IF_ERROR(put("gate_up_global_scale", e, &gate_g, 4));
      RETURN_IF_ERROR(put("up_global_scale", e, &up_g, 4));
      RETURN_IF_ERROR(put("down_global_scale", e, &down_g, 4));
    }
  }
  return t;
}

absl::StatusOr<std::unique_ptr<moe_cache::SlotPool>> MakeSlotPool(
    const TestExperts& experts, const std::vector<int>& expert_of_slot) {
  std::vector<moe_cache::BankSpec> specs;
  for (const TestBank& b : experts.banks) specs.push_back({b.name, b.bytes, 0});
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout, moe_cache::BankLayout::Create(specs));
  ASSIGN_OR_RETURN(std::unique_ptr<moe_cache::SlotPool> pool,
                   moe_cache::SlotPool::Create(static_cast<int>(expert_of_slot.size()), layout));
#if MOE_HAVE_CUDA
  for (int b = 0; b < layout.num_banks(); ++b) {
    const TestBank& tb = experts.banks[b];
    const uint64_t pitch = layout.bank(b).pitch;
    // Whole bank first with the NaN pattern (padding and empty slots), then the experts.
    CUDA_RETURN_IF_ERROR(cudaMemset(pool->bank(b), 0xff, expert_of_slot.size() * pitch));
    for (size_t s = 0; s < expert_of_slot.size(); ++s) {
      const int e = expert_of_slot[s];
      if (e < 0) continue;
      if (e >= experts.num_experts) return absl::InvalidArgumentError("expert out of range");
      CUDA_RETURN_IF_ERROR(cudaMemcpy(pool->bank(b) + s * pitch, tb.data.data() + e * tb.bytes,
                                      tb.bytes, cudaMemcpyHostToDevice));
    }
  }
  return pool;
#else
  return absl::UnavailableError("built without CUDA");
#endif
}

Reference ReferenceExperts(const TestExperts& ex, const std::vector<int>& expert_of_slot,
                           int num_tokens, int top_k, const std::vector<float>& x,
                           const std::vector<int32_t>& slot_ids,
                           const std::vector<float>& route_weights,
                           const std::vector<float>& y0) {
  const int64_t H = ex.hidden, I = ex.intermediate;
  constexpr double u = 1.0 / (1 << 24);
  const double e_gu = 2.0 * (H / 32 + 16) * u, e_dn = 2.0 * (I / 32 + 16) * u;
  const bool fp8 = !ex.gate_up_block_scales.empty(), global = !ex.gate_global.empty();
  Reference ref;
  ref.y.assign(y0.begin(), y0.end());
  ref.bound.assign(num_tokens * H, 0.0);
  std::vector<double> mag(num_tokens * H, 0.0);  // |y0| + sum of |contributions|
  for (int64_t i = 0; i < num_tokens * H; ++i) mag[i] = std::fabs(y0[i]);
  std::vector<double> h(I), h_err(I);
  for (int t = 0; t < num_tokens; ++t) {
    const float* xt = x.data() + t * H;
    for (int j = 0; j < top_k; ++j) {
      const int32_t s = slot_ids[t * top_k + j];
      if (s < 0 || s >= static_cast<int32_t>(expert_of_slot.size())) continue;
      const int e = expert_of_slot[s];
      const double w = route_weights[t * top_k + j];
      const float* gu = ex.gate_up_values.data() + e * 2 * I * H;
      const float* dn = ex.down_values.data() + e * H * I;
      const float* gu_s =
          fp8 ? ex.gate_up_block_scales.data() + e * ScaleBlocks(2 * I, H) : nullptr;
      const float* dn_s = fp8 ? ex.down_block_scales.data() + e * ScaleBlocks(H, I) : nullptr;
      const double gg = global ? ex.gate_global[e] : 1.0, ug = global ? ex.up_global[e] : 1.0;
      const double dg = global ? ex.down_global[e] : 1.0;
      for (int64_t i = 0; i < I; ++i) {
        double g, up, g_abs, up_abs;
        RowDot(gu, gu_s, i, H, xt, &g, &g_abs);
        RowDot(gu, gu_s, I + i, H, xt, &up, &up_abs);
        g *= gg;
        g_abs *= std::fabs(gg);
        up *= ug;
        up_abs *= std::fabs(ug);
        h[i] = w * Silu(g) * up;
        // |d silu / dg| <= 1.1.
        h_err[i] = std::fabs(w) * (1.1 * std::fabs(up) * e_gu * g_abs +
                                   std::fabs(Silu(g)) * e_gu * up_abs) +
                   16 * u * std::fabs(h[i]);
      }
      for (int64_t r = 0; r < H; ++r) {
        double acc, abs_terms;
        RowDot(dn, dn_s, r, I, h.data(), &acc, &abs_terms);
        acc *= dg;
        abs_terms *= std::fabs(dg);
        // sum_i |down[r, i]| h_err[i] (h_err >= 0: the sum of |terms| of that dot).
        double unused, propagated;
        RowDot(dn, dn_s, r, I, h_err.data(), &unused, &propagated);
        propagated *= std::fabs(dg);
        ref.y[t * H + r] += acc;
        ref.bound[t * H + r] += e_dn * abs_terms + propagated;
        mag[t * H + r] += abs_terms;
      }
    }
  }
  for (int64_t i = 0; i < num_tokens * H; ++i) ref.bound[i] += (top_k + 1) * u * mag[i];
  return ref;
}

}  // namespace moe::engine::gpu
