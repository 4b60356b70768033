// Test kernels for the handoff's GPU tests and benchmark: a synthetic step that produces routes
// (some of them for the CPU) and hidden rows from a step counter, and a check of the rows the
// CPU's answer was added into. Values are exact in float (small integers, halves and quarters),
// so the check does not depend on the order of the sums.
#ifndef MOE_ENGINE_CUDA_HYBRID_HANDOFF_TEST_KERNELS_H_
#define MOE_ENGINE_CUDA_HYBRID_HANDOFF_TEST_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;

namespace moe::engine::hybrid {

struct SyntheticStep {
  int rows = 0, top_k = 0, hidden = 0;
  int cpu_every = 3;  // route i of step s goes to the CPU when (s + i) % cpu_every == 0
  // Device buffers.
  int32_t* ids = nullptr;       // [rows, top_k]
  int32_t* slot_ids = nullptr;  // [rows, top_k]
  float* weights = nullptr;     // [rows, top_k]
  float* x = nullptr;           // [rows, hidden]
  float* y = nullptr;           // [rows, hidden]
  uint32_t* step = nullptr;     // [1] advanced by Produce
  uint32_t* mismatches = nullptr;  // [1] rows whose y differs from the expected sum
};

// The expected CPU result of one row: sum over the CPU routes of weight * (x + expert id).
// Host and device compute it the same way.
absl::Status LaunchProduce(const SyntheticStep& s, CUstream_st* stream);
absl::Status LaunchCheck(const SyntheticStep& s, CUstream_st* stream);

}  // namespace moe::engine::hybrid

#endif  // MOE_ENGINE_CUDA_HYBRID_HANDOFF_TEST_KERNELS_H_
