// Random experts, slot placement and the float64 reference: see expert_test_util.h.
#include "engine/cuda/experts/expert_test_util.h"

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

double Silu(double g) { return g / (1.0 + std::exp(-g)); }

}  // namespace

absl::StatusOr<TestExperts> MakeTestExperts(WeightFormat format, int num_experts, int hidden,
                                            int intermediate, uint32_t seed) {
  TestExperts t;
  t.format = format;
  t.hidden = hidden;
  t.intermediate = intermediate;
  t.num_experts = num_experts;
  ASSIGN_OR_RETURN(t.gate_up_bytes, GateUpBankBytes(format, hidden, intermediate));
  ASSIGN_OR_RETURN(t.down_bytes, DownBankBytes(format, hidden, intermediate));
  const int64_t H = hidden, I = intermediate, E = num_experts;
  t.gate_up.resize(E * t.gate_up_bytes);
  t.down.resize(E * t.down_bytes);
  t.gate_up_values.resize(E * 2 * I * H);
  t.down_values.resize(E * H * I);
  std::mt19937 rng(seed);
  std::vector<float> gu(2 * I * H), dn(H * I);
  for (int64_t e = 0; e < E; ++e) {
    RandomMatrix(rng, 2 * I, H, gu.data());
    RandomMatrix(rng, H, I, dn.data());
    float* gu_values = t.gate_up_values.data() + e * 2 * I * H;
    float* dn_values = t.down_values.data() + e * H * I;
    if (format == WeightFormat::kBf16) {
      ToBf16(gu.data(), 2 * I * H, t.gate_up.data() + e * t.gate_up_bytes, gu_values);
      ToBf16(dn.data(), H * I, t.down.data() + e * t.down_bytes, dn_values);
      continue;
    }
    // q4_0: the loader's path, a one-expert row-major bank packed into panels.
    std::vector<uint8_t> gu_blocks = ToQ4(gu.data(), 2 * I, H, gu_values);
    std::vector<uint8_t> dn_blocks = ToQ4(dn.data(), H, I, dn_values);
    cpu_moe::ExpertBank one;
    one.format = format;
    one.num_experts = 1;
    one.hidden = hidden;
    one.intermediate = intermediate;
    one.gate_up_weights = gu_blocks.data();
    one.down_weights = dn_blocks.data();
    ASSIGN_OR_RETURN(std::unique_ptr<cpu_moe::PanelBank> panels, cpu_moe::PackPanels(one));
    if (panels->gate_up.bytes() != t.gate_up_bytes || panels->down.bytes() != t.down_bytes) {
      return absl::InternalError("PackPanels gave a different number of bytes than the banks");
    }
    std::memcpy(t.gate_up.data() + e * t.gate_up_bytes, panels->gate_up.data(), t.gate_up_bytes);
    std::memcpy(t.down.data() + e * t.down_bytes, panels->down.data(), t.down_bytes);
  }
  return t;
}

absl::StatusOr<std::unique_ptr<moe_cache::SlotPool>> MakeSlotPool(
    const TestExperts& experts, const std::vector<int>& expert_of_slot) {
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout,
                   moe_cache::BankLayout::Create(
                       {{"gate_up", experts.gate_up_bytes, 0}, {"down", experts.down_bytes, 0}}));
  ASSIGN_OR_RETURN(std::unique_ptr<moe_cache::SlotPool> pool,
                   moe_cache::SlotPool::Create(static_cast<int>(expert_of_slot.size()), layout));
#if MOE_HAVE_CUDA
  const uint8_t* host[2] = {experts.gate_up.data(), experts.down.data()};
  const uint64_t bytes[2] = {experts.gate_up_bytes, experts.down_bytes};
  for (int b = 0; b < 2; ++b) {
    const uint64_t pitch = layout.bank(b).pitch;
    // Whole bank first with the NaN pattern (padding and empty slots), then the experts.
    CUDA_RETURN_IF_ERROR(cudaMemset(pool->bank(b), 0xff, expert_of_slot.size() * pitch));
    for (size_t s = 0; s < expert_of_slot.size(); ++s) {
      const int e = expert_of_slot[s];
      if (e < 0) continue;
      if (e >= experts.num_experts) return absl::InvalidArgumentError("expert out of range");
      CUDA_RETURN_IF_ERROR(cudaMemcpy(pool->bank(b) + s * pitch, host[b] + e * bytes[b],
                                      bytes[b], cudaMemcpyHostToDevice));
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
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, up = 0, g_abs = 0, up_abs = 0;
        const float* gr = gu + i * H;
        const float* ur = gu + (I + i) * H;
        for (int64_t c = 0; c < H; ++c) {
          g += static_cast<double>(gr[c]) * xt[c];
          up += static_cast<double>(ur[c]) * xt[c];
          g_abs += std::fabs(static_cast<double>(gr[c]) * xt[c]);
          up_abs += std::fabs(static_cast<double>(ur[c]) * xt[c]);
        }
        h[i] = w * Silu(g) * up;
        // |d silu / dg| <= 1.1.
        h_err[i] = std::fabs(w) * (1.1 * std::fabs(up) * e_gu * g_abs +
                                   std::fabs(Silu(g)) * e_gu * up_abs) +
                   16 * u * std::fabs(h[i]);
      }
      for (int64_t r = 0; r < H; ++r) {
        const float* dr = dn + r * I;
        double acc = 0, abs_terms = 0, propagated = 0;
        for (int64_t i = 0; i < I; ++i) {
          acc += static_cast<double>(dr[i]) * h[i];
          abs_terms += std::fabs(static_cast<double>(dr[i]) * h[i]);
          propagated += std::fabs(static_cast<double>(dr[i])) * h_err[i];
        }
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
