// ExpertBackend: the one seam between the model and whatever computes routed experts. The MoE
// layer routes (router, softmax, top-k) and hands the backend a batch of routes and hidden
// states; the backend adds the routed output into y and owns nothing of the model beyond its
// experts. The CPU backend (cpu_expert_backend.h) wraps //cpu_moe; a GPU backend (cache, overlap,
// hybrid CPU misses) goes behind the same interface.
//
// Forward is called by one thread at a time (the engine's Step thread).
#ifndef MOE_ENGINE_EXPERT_BACKEND_H_
#define MOE_ENGINE_EXPERT_BACKEND_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moe::engine {

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // y[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for MoE layer `moe_layer`.
  //   ids, weights [num_tokens, top_k]; ids < 0 are padding (skipped everywhere).
  //   x, y [num_tokens, hidden] f32.
  // InvalidArgument for ids out of range; Internal for the backend's own failures.
  virtual absl::Status Forward(int moe_layer, int num_tokens, int top_k,
                               absl::Span<const int32_t> ids, absl::Span<const float> weights,
                               const float* x, float* y) = 0;

  // "cpu", "gpu".
  virtual std::string name() const = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_EXPERT_BACKEND_H_
