// Test and benchmark helper: a model of any qwen3_moe / qwen2_moe shape with random weights,
// built in memory (no files). Dense weights in f32 or bf16; routed experts as cpu_moe banks in
// bf16 or q4_0 (panels), plus their values as floats (exactly what the bank holds, dequantized)
// for float64 references.
//
// `fast_fill`: only a few distinct random experts are drawn and copied over the rest (for
// full-size benchmark models, where drawing 48 x 128 experts would take minutes).
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

struct RandomModel {
  std::unique_ptr<ModelWeights> weights;
  // Per MoE layer: the bank the CPU backend reads and the memory behind it.
  std::vector<cpu_moe::ExpertBank> banks;
  std::vector<common::AlignedBuffer<uint16_t>> gate_up_bf16, down_bf16;
  std::vector<common::AlignedBuffer<common::BlockQ4_0>> gate_up_q4, down_q4;
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
// multiples of 32) or formats other than bf16 and q4_0.
absl::StatusOr<RandomModel> MakeRandomModel(const ModelConfig& config,
                                            const RandomModelOptions& options);

}  // namespace moe::engine

#endif  // MOE_ENGINE_RANDOM_MODEL_H_
