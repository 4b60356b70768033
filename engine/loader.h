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
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/formats.h"
#include "engine/model_weights.h"
#include "moe_cache/gpu/bank_layout.h"

namespace moe::engine {

struct LoadOptions {
  // The routed experts' format in the store. nullopt ("auto"): the checkpoint's own (see
  // CheckpointExpertFormat below), which ModelWeights::expert_format then reports.
  std::optional<common::WeightFormat> expert_format = common::WeightFormat::kBf16;
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

// The expert format "auto" resolves to: the format the checkpoint's routed experts are stored
// in, so that a quantized checkpoint is served as it is and never widened. NVFP4 experts of a
// ModelOpt NVFP4 checkpoint: kNvfp4; F8_E4M3 experts with block scales: kFp8Block; BF16, F16
// or F32 experts (and a model without routed experts): kBf16. Where a checkpoint mixes them
// (layers left out of the quantization), the format most routed experts are in; a tie goes
// to the narrower format.
struct ExpertFormatCounts {
  int64_t nvfp4 = 0, fp8 = 0, other = 0;  // routed experts (gate_proj) by source dtype
};
common::WeightFormat CheckpointExpertFormat(const ExpertFormatCounts& counts);

// The value of an expert-format option: "auto" gives nullopt (the checkpoint's own format,
// resolved by LoadModel), a name WeightFormatName spells gives that format; anything else is
// InvalidArgument listing the valid values.
inline constexpr char kAutoExpertFormat[] = "auto";
absl::StatusOr<std::optional<common::WeightFormat>> ParseExpertFormat(std::string_view name);

// The bank layout of one routed expert in `format` for hidden size `hidden` and
// moe_intermediate_size `moe_intermediate`: exactly what LoadModel's ExpertStore holds per expert,
// and what one GPU cache slot takes (padded_bytes_per_expert()).
absl::StatusOr<moe_cache::BankLayout> ExpertBankLayout(common::WeightFormat format, int64_t hidden,
                                                       int64_t moe_intermediate);

}  // namespace moe::engine

#endif  // MOE_ENGINE_LOADER_H_
