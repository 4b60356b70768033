// ExpertLayerView: where one MoE layer's routed experts live in memory, as a plain view that the
// component holding the weights (moe_cache's ExpertStore) hands out and the component computing
// with them (cpu_moe) reads in place, so that neither depends on the other. Each array is one
// per-expert block of bytes, expert e at data + e * pitch (pitch >= the payload; the store pads
// its rows to 16 bytes). The bytes themselves are cpu_moe's (cpu_moe.h, ExpertBank): bf16 and
// fp8_block row-major; q4_0, mxfp4 and nvfp4 in 16-row panels with their scales inside, the
// layout the CPU kernels read fastest and the bytes the GPU cache copies unchanged.
// Views only: no ownership, no synchronization; valid while the holder's memory lives.
#ifndef MOE_COMMON_EXPERT_VIEW_H_
#define MOE_COMMON_EXPERT_VIEW_H_

#include <cstdint>

#include "common/formats.h"

namespace moe::common {

// One per-expert array: expert e's bytes start at data + e * pitch. data == nullptr: absent.
struct ExpertArray {
  const void* data = nullptr;
  uint64_t pitch = 0;

  const void* Expert(int e) const {
    return static_cast<const uint8_t*>(data) + static_cast<uint64_t>(e) * pitch;
  }
};

// Row-major matrices, or 16-row panels (the 4-bit formats; cpu_moe.h, Layout::kPanels).
enum class ExpertLayout { kRowMajor, kPanels };

struct ExpertLayerView {
  WeightFormat format = WeightFormat::kBf16;
  ExpertLayout layout = ExpertLayout::kRowMajor;
  int num_experts = 0;   // E
  int hidden = 0;        // H
  int intermediate = 0;  // I
  ExpertArray gate_up;   // [2I, H] per expert: gate rows, then up rows
  ExpertArray down;      // [H, I] per expert
  ExpertArray gate_up_scales, down_scales;              // fp8_block's block scales (float)
  ExpertArray gate_up_global_scale, down_global_scale;  // nvfp4: one float per expert
  // nvfp4, optional: the up rows' own global scale (gate_up_global_scale then covers the gate
  // rows only); absent: gate_up_global_scale covers all 2I rows.
  ExpertArray up_global_scale;
};

}  // namespace moe::common

#endif  // MOE_COMMON_EXPERT_VIEW_H_
