// LoadModel: a Hugging Face model folder (config.json plus model.safetensors or a sharded
// model.safetensors.index.json) into ModelWeights, read through mmap and written straight into
// the final layout: dense weights into their tensors (bf16, or f32 where asked; norms and biases
// always f32), routed experts into a moe_cache::ExpertStore in the chosen expert format
// (quantized and packed into cpu_moe panels per expert on a thread pool where the format needs
// it). Source dtypes F32, BF16, F16 and block-quantized FP8 (F8_E4M3 with weight_scale_inv);
// both expert layouts of transformers (one tensor per expert, and fused gate_up_proj /
// down_proj). Families: see ModelConfig::SupportedModelTypes().
//
// Model files are never trusted: every problem (missing file or tensor, wrong shape or dtype,
// truncated file, a header whose offsets lie, bad JSON, an unknown model_type) is a Status that
// names the file and the tensor.
#ifndef MOE_ENGINE_LOADER_H_
#define MOE_ENGINE_LOADER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/formats.h"
#include "engine/model_weights.h"
#include "moe_cache/gpu/bank_layout.h"

namespace moe::engine {

struct LoadOptions {
  common::WeightFormat expert_format = common::WeightFormat::kBf16;
  DType dense_dtype = DType::kBf16;  // kF32 for reference tests
  int threads = 0;                   // 0: physical cores
  // A progress line on stderr (bytes, rate, time left) about once a second, for loads that take
  // longer than a second.
  bool progress = true;
  // Fail (Unavailable) unless the expert store can be pinned, mapped host memory.
  bool require_pinned = false;
};

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadModel(const std::string& dir,
                                                        const LoadOptions& options);

// The bank layout of one routed expert in `format` for hidden size `hidden` and
// moe_intermediate_size `moe_intermediate`: exactly what LoadModel's ExpertStore holds per expert,
// and what one GPU cache slot takes (padded_bytes_per_expert()).
absl::StatusOr<moe_cache::BankLayout> ExpertBankLayout(common::WeightFormat format, int64_t hidden,
                                                       int64_t moe_intermediate);

}  // namespace moe::engine

#endif  // MOE_ENGINE_LOADER_H_
