// RoPE cos/sin tables for the GPU's LaunchQkNormRope (token_ops.h): built on the host from
// engine/rope.h's inverse frequencies and attention factor, with the same float32 arithmetic as
// the CPU engine's RopeTable (so both engines rotate by identical values), and held in device
// memory.
#ifndef MOE_ENGINE_CUDA_OPS_ROPE_TABLE_H_
#define MOE_ENGINE_CUDA_OPS_ROPE_TABLE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/rope.h"

namespace moe::engine::gpu {

// cos[p * rotary_dim / 2 + i] = cos(p * inv_freq[i]) * attention_factor, sin likewise, for
// p < max_positions (RopeTable's values). rotary_dim = 2 * params.inv_freq.size(): head_dim, or
// its first part under a partial_rotary_factor (the rest of each head is not rotated).
struct RopeCosSin {
  int head_dim = 0;
  int rotary_dim = 0;
  int max_positions = 0;
  std::vector<float> cos;  // [max_positions, rotary_dim / 2]
  std::vector<float> sin;  // [max_positions, rotary_dim / 2]
};

// InvalidArgument when head_dim is odd, params give no frequencies or more than head_dim / 2,
// or max_positions <= 0.
absl::StatusOr<RopeCosSin> BuildRopeCosSin(const RopeParams& params, int head_dim,
                                           int max_positions);

// The tables in device memory. Owns it; immutable after Create, so any stream may read it.
class DeviceRopeTable {
 public:
  // Uploads `host` (synchronously, at setup). Unavailable without CUDA; ResourceExhausted when
  // cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<DeviceRopeTable>> Create(const RopeCosSin& host);
  ~DeviceRopeTable();
  DeviceRopeTable(const DeviceRopeTable&) = delete;
  DeviceRopeTable& operator=(const DeviceRopeTable&) = delete;

  int head_dim() const { return head_dim_; }
  int rotary_dim() const { return rotary_dim_; }
  int max_positions() const { return max_positions_; }
  const float* cos() const { return cos_; }  // device f32 [max_positions, rotary_dim / 2]
  const float* sin() const { return sin_; }  // device f32 [max_positions, rotary_dim / 2]

 private:
  DeviceRopeTable() = default;
  int head_dim_ = 0;
  int rotary_dim_ = 0;
  int max_positions_ = 0;
  float* cos_ = nullptr;
  float* sin_ = nullptr;
};

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_OPS_ROPE_TABLE_H_
