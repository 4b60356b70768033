// CpuExpertBackend: ExpertBackend over //cpu_moe. Each MoE layer's experts are a
// cpu_moe::ExpertBank (views into memory the caller owns: ModelWeights' ExpertStore, or a test's
// buffers); Forward runs cpu_moe::Forward with accumulation, expert reads deduplicated across the
// batch.
//
// In the deterministic mode the cpu_moe options are fixed so that a token's output does not
// depend on the rest of the batch: no AMX and no oneDNN (both switch on by routes per expert).
//
// Owns nothing but its options; the banks' memory and the pool must outlive it. Forward is
// called by one thread at a time.
#ifndef MOE_ENGINE_CPU_EXPERT_BACKEND_H_
#define MOE_ENGINE_CPU_EXPERT_BACKEND_H_

#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/expert_backend.h"

namespace moe::engine {

class CpuExpertBackend final : public ExpertBackend {
 public:
  CpuExpertBackend(std::vector<cpu_moe::ExpertBank> banks, const cpu_moe::Options& options,
                   common::ThreadPool* pool);

  // The options the engine uses: cpu_moe's defaults (from the environment), with AMX and oneDNN
  // off when deterministic; with `f32_activations` (reference comparisons) bf16_dot_product and
  // oneDNN (which rounds activations to bf16) off.
  static cpu_moe::Options DefaultOptions(bool deterministic, bool f32_activations);

  absl::Status Forward(int moe_layer, int num_tokens, int top_k, absl::Span<const int32_t> ids,
                       absl::Span<const float> weights, const float* x, float* y) override;
  std::string name() const override { return "cpu"; }

  // Routes and distinct experts over every call so far (for benchmarks).
  uint64_t total_routes() const { return total_routes_; }
  uint64_t total_unique_experts() const { return total_unique_; }

 private:
  std::vector<cpu_moe::ExpertBank> banks_;
  cpu_moe::Options options_;
  common::ThreadPool* pool_;
  uint64_t total_routes_ = 0, total_unique_ = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_CPU_EXPERT_BACKEND_H_
