// FailingForwardModel: a ForwardModel (engine/forward_model.h) decorator for tests that makes
// Forward fail on demand, so that the engine loop and the server can be tested against a
// failure in the middle of a run (device memory running out, a CUDA error) on any machine.
// Every other call passes through to the wrapped model unchanged.
//
// Plugged into an engine through ModelEngineOptions::wrap_model (engine/model_engine.h).
// Ownership: owns the wrapped model. Thread safety: FailNext and the counters may be called from
// any thread (a test arming a failure while the server's step thread runs); the ForwardModel
// methods keep the interface's single-caller rule.
#ifndef MOE_ENGINE_FAILING_FORWARD_MODEL_H_
#define MOE_ENGINE_FAILING_FORWARD_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/forward_model.h"

namespace moe::engine {

class FailingForwardModel final : public ForwardModel {
 public:
  // `model` must not be null.
  explicit FailingForwardModel(std::unique_ptr<ForwardModel> model);

  // The next `count` Forward calls return `status` (not OK) without running the model, so
  // nothing is written to the KV cache and no logits are appended.
  void FailNext(absl::Status status, int count = 1);
  // Every Forward call first sleeps this long (0 by default): keeps requests running long
  // enough for a test to act while they do.
  void SetDelay(absl::Duration delay);
  // Forward calls so far (failed ones included), and those that failed.
  int forward_calls() const;
  int failed_calls() const;

  absl::Status Forward(absl::Span<const ModelChunk> chunks, std::vector<float>* logits) override;
  const ModelConfig& config() const override { return model_->config(); }
  int max_positions() const override { return model_->max_positions(); }
  int kv_blocks() const override { return model_->kv_blocks(); }
  int kv_block_size() const override { return model_->kv_block_size(); }
  int state_slots() const override { return model_->state_slots(); }
  uint64_t memory_bytes() const override { return model_->memory_bytes(); }
  std::string backend() const override { return model_->backend(); }
  void set_routing_override(RoutingOverride* routing) override {
    model_->set_routing_override(routing);
  }

 private:
  const std::unique_ptr<ForwardModel> model_;
  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  int to_fail_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int failed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_FAILING_FORWARD_MODEL_H_
