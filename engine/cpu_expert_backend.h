// CpuExpertBackend: ExpertBackend over //cpu_moe. Each MoE layer's experts are a
// cpu_moe::ExpertBank (views into memory the caller owns: ModelWeights' ExpertStore, or a test's
// buffers); Forward runs cpu_moe::Forward with accumulation, expert reads deduplicated across the
// batch.
//
// In the deterministic mode the cpu_moe options are fixed so that a token's output does not
// depend on the rest of the batch: no AMX and no oneDNN (both switch on by routes per expert).
// AMX is a cpu_moe tuning knob (cpu_moe/internal/tuning.h), not a public option, so the backend
// carries cpu_moe's internal tuning beside its options.
//
// Owns its options and the oneDNN engine of cpu_moe's prefill path (cpu_moe::OnednnExperts,
// passed to every cpu_moe::Forward like the pool); the banks' memory and the pool must outlive
// it. Forward is called by one thread at a time.
#ifndef MOE_ENGINE_CPU_EXPERT_BACKEND_H_
#define MOE_ENGINE_CPU_EXPERT_BACKEND_H_

#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/onednn_experts.h"
#include "engine/expert_backend.h"

namespace moe::engine {

class CpuExpertBackend final : public ExpertBackend {
 public:
  // cpu_moe's public options and its internal tuning, as one call of cpu_moe::Forward takes them.
  struct Options {
    cpu_moe::Options moe;
    cpu_moe::internal::Tuning tuning;
  };

  CpuExpertBackend(std::vector<cpu_moe::ExpertBank> banks, const Options& options,
                   common::ThreadPool* pool);

  // The options the engine uses: cpu_moe's defaults and tuning (from the environment, for
  // sweeps), with AMX and oneDNN off when deterministic; with `f32_activations` (reference
  // comparisons) bf16_dot_product and oneDNN (which rounds activations to bf16) off.
  static Options DefaultOptions(bool deterministic, bool f32_activations);

  absl::Status Forward(int moe_layer, int num_tokens, int top_k, absl::Span<const int32_t> ids,
                       absl::Span<const float> weights, const float* x, float* y) override;
  std::string name() const override { return "cpu"; }

  // Routes and distinct experts over every call so far (for benchmarks).
  uint64_t total_routes() const { return total_routes_; }
  uint64_t total_unique_experts() const { return total_unique_; }

 private:
  std::vector<cpu_moe::ExpertBank> banks_;
  Options options_;
  common::ThreadPool* pool_;
  cpu_moe::OnednnExperts onednn_;
  uint64_t total_routes_ = 0, total_unique_ = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_CPU_EXPERT_BACKEND_H_
