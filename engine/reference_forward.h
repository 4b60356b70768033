// Test-only float64 reference of the qwen3_moe / qwen2_moe forward pass, written as plain loops
// straight from the transformers modeling code (no KV cache, no batching, no shared code with
// model.cc): embeddings, RMSNorm, GQA attention with RoPE (default, linear or YaRN inv_freq
// computed here in double), q/k norm, qkv bias, router softmax + top-k (+ renormalisation),
// routed experts from float copies of the banks, the shared expert with its sigmoid gate, dense
// MLP layers, final norm, LM head (tied or not).
#ifndef MOE_ENGINE_REFERENCE_FORWARD_H_
#define MOE_ENGINE_REFERENCE_FORWARD_H_

#include <cstdint>
#include <vector>

#include "engine/random_model.h"

namespace moe::engine {

// Teacher-forced logits [tokens.size(), vocab] of one sequence starting at position 0.
std::vector<double> ReferenceForward(const RandomModel& model, const std::vector<int32_t>& tokens);

}  // namespace moe::engine

#endif  // MOE_ENGINE_REFERENCE_FORWARD_H_
