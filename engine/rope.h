// Rotary position embedding tables, computed as transformers' modeling_rope_utils computes
// inv_freq and attention_factor (default, linear, dynamic within max_position_embeddings, yarn),
// in float32 as it does, and applied in its rotate_half form (pairs i and i + rotary_dim / 2)
// over the first rotary_dim = int(head_dim * partial_rotary_factor) dimensions of each head,
// the rest passed through (all of them when the factor is 1).
// Immutable after construction; thread-safe to read.
#ifndef MOE_ENGINE_ROPE_H_
#define MOE_ENGINE_ROPE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"

namespace moe::engine {

struct RopeParams {
  std::vector<float> inv_freq;    // [rotary_dim / 2]
  float attention_factor = 1.0f;  // multiplies cos and sin
};

// InvalidArgument for an unsupported rope type or bad parameters.
absl::StatusOr<RopeParams> ComputeRopeParams(const ModelConfig& config);

class RopeTable {
 public:
  // cos and sin for positions [0, max_positions); rotary_dim = 2 * inv_freq.size() <= head_dim.
  RopeTable(const RopeParams& params, int head_dim, int max_positions);
  int max_positions() const { return max_positions_; }
  // Rotates `num_heads` heads of `x` ([num_heads, head_dim]) in place for `position`
  // (< max_positions()).
  void Apply(float* x, int num_heads, int position) const;

 private:
  int head_dim_;
  int rotary_dim_;
  int max_positions_;
  std::vector<float> cos_, sin_;  // [max_positions, rotary_dim / 2], attention_factor applied
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_ROPE_H_
