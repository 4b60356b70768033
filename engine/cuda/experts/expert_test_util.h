// Test and benchmark support for the GPU routed experts: random experts in exactly the bytes the
// loader writes into each bank of the ExpertStore (bf16 [gate; up] and down; q4_0 and nvfp4
// through the project's quantizers and cpu_moe::PackPanels; fp8_block through
// common::QuantizeFp8Block with its f32 block scales in their own banks; nvfp4 with gate, up
// and down global scales of their own), a SlotPool holding them in chosen slots, and a float64
// reference of y += sum_j w * down(silu(gate x) * up x) on the dequantized weights with a bound
// on the f32 kernels' rounding error. testonly; thread-compatible.
#ifndef MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_
#define MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/formats.h"
#include "moe_cache/gpu/slot_pool.h"

namespace moe::engine::gpu {

// One bank of the experts, as a store row holds it.
struct TestBank {
  std::string name;           // the store's bank name ("gate_up", "down_scales", ...)
  uint64_t bytes = 0;         // payload per expert
  std::vector<uint8_t> data;  // [E, bytes]
};

// The experts' bytes, and the values the reference computes with: weight (r, c) of expert e's
// gate_up is gate_up_values[e, r, c] * block scale * global scale (the factors 1 where the format
// has none), each factor exact in f32 and multiplied in float64; likewise down.
struct TestExperts {
  common::WeightFormat format = common::WeightFormat::kBf16;
  int hidden = 0, intermediate = 0, num_experts = 0;
  std::vector<TestBank> banks;  // ExpertBankSizes' banks, in its order
  // The codes decoded: bf16 and q4_0 the weights; fp8_block the e4m3 values; nvfp4 e2m1 times
  // its e4m3 block scale.
  std::vector<float> gate_up_values;  // [E, 2I, H]
  std::vector<float> down_values;     // [E, H, I]
  // fp8_block: the 128x128 block scales, [E, ceil(rows/128), ceil(cols/128)]; else empty.
  std::vector<float> gate_up_block_scales, down_block_scales;
  // nvfp4: the per-tensor global scales of the gate rows, the up rows and down, [E]; else empty.
  std::vector<float> gate_global, up_global, down_global;

  // The bank named `name`, or nullptr.
  const TestBank* Bank(std::string_view name) const;
  // Payload bytes of one expert over every bank.
  uint64_t BytesPerExpert() const;
};

// Weights uniform in +-2/sqrt(columns) (so activations stay O(1); nvfp4's up rows a quarter of
// that, so their global scale is about a quarter of the gate's), rounded to bf16 or quantized to
// the format (whose dequantized values become the reference's weights).
absl::StatusOr<TestExperts> MakeTestExperts(common::WeightFormat format, int num_experts,
                                            int hidden, int intermediate, uint32_t seed);

// A SlotPool with the experts' banks (the loader's names, sizes and 16-byte pitches); slot s
// holds expert expert_of_slot[s], or 0xFF bytes where that is -1 (NaN in bf16, q4_0's fp16
// scales, e4m3 and f32; e2m1 has no NaN, but nvfp4's e4m3 block scales and global scales do).
// The bytes between a bank's payload and its pitch are 0xFF too.
absl::StatusOr<std::unique_ptr<moe_cache::SlotPool>> MakeSlotPool(
    const TestExperts& experts, const std::vector<int>& expert_of_slot);

struct Reference {
  std::vector<double> y;      // [T, H]: y0 + the routed experts
  std::vector<double> bound;  // [T, H]: what f32 rounding in the kernels can add, at most
};

// Routes whose slot is < 0 or >= expert_of_slot.size() are padding. The bound: every f32 dot
// of n terms (summed by a lane over n/32 terms, then a tree) errs by at most
// 2 (n/32 + 16) 2^-24 times the sum of |terms|; SwiGLU, the route weight and global scales add
// 16 2^-24 |h|; the propagated error of h through down, and (k + 1) 2^-24 of |y0| + sum
// |contributions| for the final adds.
Reference ReferenceExperts(const TestExperts& experts, const std::vector<int>& expert_of_slot,
                           int num_tokens, int top_k, const std::vector<float>& x,
                           const std::vector<int32_t>& slot_ids,
                           const std::vector<float>& route_weights, const std::vector<float>& y0);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_EXPERTS_EXPERT_TEST_UTIL_H_
