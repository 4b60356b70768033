#include "engine/cpu_expert_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::engine {

CpuExpertBackend::CpuExpertBackend(std::vector<cpu_moe::ExpertBank> banks,
                                   const Options& options, common::ThreadPool* pool)
    : banks_(std::move(banks)), options_(options), pool_(pool) {
  options_.moe.accumulate = true;
}

CpuExpertBackend::Options CpuExpertBackend::DefaultOptions(bool deterministic,
                                                           bool f32_activations) {
  Options o{cpu_moe::Options::FromEnv(), cpu_moe::internal::Tuning::FromEnv()};
  if (deterministic) {
    o.tuning.amx = false;
    o.moe.onednn_min_tokens_per_expert = 0;
  }
  if (f32_activations) {
    // cpu_moe's oneDNN path (experts with many routes) always rounds activations to bf16.
    o.moe.bf16_dot_product = false;
    o.moe.onednn_min_tokens_per_expert = 0;
  }
  return o;
}

absl::Status CpuExpertBackend::Forward(int moe_layer, int num_tokens, int top_k,
                                       absl::Span<const int32_t> ids,
                                       absl::Span<const float> weights, const float* x, float* y) {
  if (moe_layer < 0 || moe_layer >= static_cast<int>(banks_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("MoE layer ", moe_layer, " of ", banks_.size()));
  }
  const cpu_moe::ExpertBank& bank = banks_[moe_layer];
  cpu_moe::ForwardStats stats;
  const size_t n = static_cast<size_t>(num_tokens) * bank.hidden;
  absl::Status s =
      cpu_moe::internal::Forward(bank, num_tokens, top_k, ids, weights, absl::MakeConstSpan(x, n),
                                 absl::MakeSpan(y, n), options_.moe, options_.tuning, *pool_,
                                 &stats, &onednn_);
  total_routes_ += stats.routes;
  total_unique_ += stats.unique_experts;
  return s;
}

}  // namespace moe::engine
