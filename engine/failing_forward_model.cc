#include "engine/failing_forward_model.h"

#include <utility>

#include "absl/time/clock.h"

namespace moe::engine {

FailingForwardModel::FailingForwardModel(std::unique_ptr<ForwardModel> model)
    : model_(std::move(model)) {}

void FailingForwardModel::FailNext(absl::Status status, int count) {
  absl::MutexLock lock(&mu_);
  failure_ = std::move(status);
  to_fail_ = failure_.ok() ? 0 : count;
}

void FailingForwardModel::SetDelay(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  delay_ = delay;
}

int FailingForwardModel::forward_calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

int FailingForwardModel::failed_calls() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

absl::Status FailingForwardModel::Forward(absl::Span<const ModelChunk> chunks,
                                          std::vector<float>* logits) {
  absl::Duration delay;
  {
    absl::MutexLock lock(&mu_);
    delay = delay_;
  }
  // Outside the lock: FailNext may arm a failure while this call sleeps.
  if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
  {
    absl::MutexLock lock(&mu_);
    ++calls_;
    if (to_fail_ > 0) {
      --to_fail_;
      ++failed_;
      return failure_;
    }
  }
  return model_->Forward(chunks, logits);
}

}  // namespace moe::engine
