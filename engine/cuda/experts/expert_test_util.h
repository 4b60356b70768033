// Test and benchmark support for the GPU routed experts: random experts in exactly the bytes the
// loader writes (bf16 [gate; up] and down; q4_0 through common::QuantizeRowQ4_0 and
// cpu_moe::PackPanels), a SlotPool holding them in chosen slots, and a float64 reference of
// y += sum_j w * down(silu(gate x) * up x) with a bound on the f32 kernels' rounding error.
// testonly; thread-compatible.
#ifndef MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_
#define MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/formats.h"
#include "moe_cache/gpu/slot_pool.h"

namespace moe::engine::gpu {

struct TestExperts {
  common::WeightFormat format = common::WeightFormat::kBf16;
  int hidden = 0, intermediate = 0, num_experts = 0;
  uint64_t gate_up_bytes = 0, down_bytes = 0;  // per expert
  std::vector<uint8_t> gate_up, down;          // [E, bytes]: what a slot holds
  std::vector<float> gate_up_values;           // [E, 2I, H]: what those bytes decode to
  std::vector<float> down_values;              // [E, H, I]
};

// Weights uniform in +-2/sqrt(columns) (so activations stay O(1)), rounded to bf16 or
// quantized to q4_0 (whose dequantized values become the reference's weights).
absl::StatusOr<TestExperts> MakeTestExperts(common::WeightFormat format, int num_experts,
                                            int hidden, int intermediate, uint32_t seed);

// A SlotPool with the loader's banks ("gate_up", "down"); slot s holds expert
// expert_of_slot[s], or 0xFF bytes (NaN in both formats) where that is -1.
absl::StatusOr<std::unique_ptr<moe_cache::SlotPool>> MakeSlotPool(
    const TestExperts& experts, const std::vector<int>& expert_of_slot);

struct Reference {
  std::vector<double> y;      // [T, H]: y0 + the routed experts
  std::vector<double> bound;  // [T, H]: what f32 rounding in the kernels can add, at most
};

// Routes whose slot is < 0 or >= expert_of_slot.size() are padding. The bound: every f32 dot
// of n terms (summed by a lane over n/32 terms, then a tree) errs by at most
// 2 (n/32 + 16) 2^-24 times the sum of |terms|; SwiGLU and the route weight add 16 2^-24 |h|;
// the propagated error of h through down, and (k + 1) 2^-24 of |y0| + sum |contributions| for
// the final adds.
Reference ReferenceExperts(const TestExperts& experts, const std::vector<int>& expert_of_slot,
                           int num_tokens, int top_k, const std::vector<float>& x,
                           const std::vector<int32_t>& slot_ids,
                           const std::vector<float>& route_weights, const std::vector<float>& y0);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_
