// Test and benchmark helper: a model of any qwen3_moe / qwen2_moe / qwen3_5_moe shape with random
// weights, built in memory (no files). Dense weights in f32 or bf16; routed experts as cpu_moe
// banks in bf16, fp8_block (row-major codes with 128x128 block scales), q4_0, mxfp4 or nvfp4
// (panels; nvfp4's gate, up and down each with its own per-tensor scale) as LoadModel lays them
// out, plus their values as floats (exactly what the bank holds, dequantized) for float64
// references.
//
// qwen3_5_moe configs (ModelConfig::layer_types with linear-attention layers) get the Gated
// DeltaNet's weights (in_proj_qkv / z / b / a, the tap-major conv, dt_bias, A_log, the gated
// norm, out_proj), a q_proj twice as wide for the attention output gate, and the sigmoid-gated
// shared expert, drawn so that a forward stays in a sane range: projections U(+-1/sqrt(fan_in)),
// RMSNorm multipliers 1 +- 0.2, A_log = log U(1, 16), dt_bias U(+-0.5), conv taps
// U(+-1/sqrt(kernel)).
//
// `fast_fill`: only a few distinct random experts are drawn and copied over the rest, and dense
// tensors repeat a tile of random values (for full-size benchmark models, where drawing 48 x 128
// experts would take minutes).
#ifndef MOE_ENGINE_RANDOM_MODEL_H_
#define MOE_ENGINE_RANDOM_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/model_weights.h"

namespace moe::engine {

// Owns every byte its banks point at; movable, not copyable.
struct RandomModel {
  std::unique_ptr<ModelWeights> weights;
  // Per MoE layer: the bank the CPU backend reads and the memory behind it (bf16 and fp8_block:
  // row-major; q4_0 and nvfp4: panels).
  std::vector<cpu_moe::ExpertBank> banks;
  std::vector<common::AlignedBuffer<uint16_t>> gate_up_bf16, down_bf16;
  std::vector<common::AlignedBuffer<uint8_t>> gate_up_fp8, down_fp8;
  std::vector<common::AlignedBuffer<float>> gate_up_fp8_scales, down_fp8_scales;
  std::vector<std::unique_ptr<cpu_moe::PanelBank>> panels;
  // Per MoE layer, float values of the bank ([E, 2I, H] and [E, H, I]); empty with fast_fill.
  std::vector<std::vector<float>> gate_up, down;
};

struct RandomModelOptions {
  DType dense_dtype = DType::kF32;
  common::WeightFormat expert_format = common::WeightFormat::kBf16;
  uint64_t seed = 1;
  bool fast_fill = false;              // see above
  int distinct_experts = 4;            // with fast_fill
  common::ThreadPool* pool = nullptr;  // optional, for fast_fill copies and panel packing
};

// InvalidArgument for shapes cpu_moe cannot hold (hidden and moe_intermediate_size must be
// multiples of 32) or inconsistent linear-attention sizes.
absl::StatusOr<RandomModel> MakeRandomModel(const ModelConfig& config,
                                            const RandomModelOptions& options);

}  // namespace moe::engine

#endif  // MOE_ENGINE_RANDOM_MODEL_H_
