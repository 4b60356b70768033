#include "serving/scheduler.h"

#include <cstdio>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::serving {

void EventQueue::Push(Item item) {
  {
    absl::MutexLock lock(&mu_);
    items_.push_back(std::move(item));
  }
  absl::MutexLock lock(&listener_mu_);
  if (listener_) listener_();
}

bool EventQueue::Pop(Item* out) {
  absl::MutexLock lock(&mu_);
  if (items_.empty()) return false;
  *out = std::move(items_.front());
  items_.pop_front();
  return true;
}

bool EventQueue::WaitPop(Item* out, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto nonempty = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !items_.empty(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&nonempty), timeout)) return false;
  *out = std::move(items_.front());
  items_.pop_front();
  return true;
}

void EventQueue::SetListener(std::function<void()> listener) {
  absl::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

namespace {

// What clients are told when the engine failed in the middle of their request: the cause's
// message, under a code of the server's own failure, never one that blames the client or its
// rate (ResourceExhausted would reach HTTP clients as 429): out of a resource (device memory)
// is 503 / UNAVAILABLE, worth retrying; anything else 500 / INTERNAL.
absl::Status EngineFailure(const absl::Status& cause) {
  const std::string message = absl::StrCat(
      "the engine failed: ", cause.ok() ? "no reason given" : absl::string_view(cause.message()));
  if (absl::IsResourceExhausted(cause) || absl::IsUnavailable(cause)) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

}  // namespace

// What the engine callbacks of one call share. Fields below `call` are touched only on the step
// thread (every engine callback runs there, and so does FailAll).
struct Scheduler::CallState {
  std::shared_ptr<Call> call;
  std::vector<bool> finished;
  std::vector<absl::Time> last_token;  // InfinitePast until the first token
  int unfinished = 0;                  // guarded by the scheduler's mu_
  bool submitted = false;  // every request reached the engine; guarded by the scheduler's mu_
};

Scheduler::Scheduler(engine::Engine* engine, SchedulerOptions options, Metrics* metrics)
    : engine_(engine), options_(options), metrics_(metrics), thread_([this] { Loop(); }) {}

Scheduler::~Scheduler() { Stop(); }

absl::StatusOr<std::shared_ptr<Call>> Scheduler::Submit(
    std::vector<engine::GenerationRequest> requests) {
  const int n = static_cast<int>(requests.size());
  if (n == 0) return absl::InvalidArgumentError("no request to submit");
  auto state = std::make_shared<CallState>();
  state->call = std::make_shared<Call>();
  state->call->submitted = absl::Now();
  state->finished.assign(n, false);
  state->last_token.assign(n, absl::InfinitePast());
  state->unfinished = n;
  {
    absl::MutexLock lock(&mu_);
    if (draining_ || stop_) {
      return absl::UnavailableError("the server is shutting down and takes no new requests");
    }
    const int limit = options_.max_batch + options_.max_queue;
    if (in_flight_ + n > limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the request queue is full (", in_flight_, " requests admitted, limit ",
                       limit, "); retry later"));
    }
    in_flight_ += n;
    live_.insert(state);
  }
  for (int i = 0; i < n; ++i) {
    // A raw pointer: the state lives in live_ until its last final event has been handled.
    CallState* s = state.get();
    requests[i].on_event = [this, s, i](const engine::GenerationEvent& event) {
      if (s->finished[i]) return;  // after FailAll, the engine's own final event
      const absl::Time now = absl::Now();
      if (!event.token_ids.empty()) {
        if (s->last_token[i] == absl::InfinitePast()) {
          metrics_->ObserveTimeToFirstToken(absl::ToDoubleSeconds(now - s->call->submitted));
        } else {
          metrics_->ObserveInterTokenLatency(absl::ToDoubleSeconds(now - s->last_token[i]));
        }
        s->last_token[i] = now;
      }
      const bool final = event.finish_reason != engine::FinishReason::kNone;
      if (final) {
        s->finished[i] = true;
        metrics_->AddTokens(event.prompt_tokens, event.completion_tokens);
      }
      if (event.finish_reason == engine::FinishReason::kError) {
        ++step_errors_;  // the step thread's own counter (see Loop)
        engine::GenerationEvent failed = event;
        failed.error = EngineFailure(event.error);
        s->call->events->Push({i, std::move(failed)});
      } else {
        s->call->events->Push({i, event});
      }
      if (final) OnFinal(s);
    };
    absl::StatusOr<uint64_t> id = engine_->Submit(std::move(requests[i]));
    if (!id.ok()) {
      // Undo: the ones already submitted end through Cancel (their final events still come
      // and release their slots); the rest never started.
      for (uint64_t done : state->call->request_ids) engine_->Cancel(done);
      absl::MutexLock lock(&mu_);
      in_flight_ -= n - i;
      state->unfinished -= n - i;
      if (state->unfinished == 0) live_.erase(state);
      return id.status();
    }
    state->call->request_ids.push_back(*id);
  }
  {
    absl::MutexLock lock(&mu_);
    state->submitted = true;
    wake_ = true;
  }
  return state->call;
}

void Scheduler::OnFinal(CallState* state) {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  if (--state->unfinished == 0) {
    for (auto it = live_.begin(); it != live_.end(); ++it) {
      if (it->get() == state) {
        live_.erase(it);
        break;
      }
    }
  }
}

void Scheduler::Cancel(const Call& call) {
  for (uint64_t id : call.request_ids) engine_->Cancel(id);
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void Scheduler::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool Scheduler::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

bool Scheduler::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void Scheduler::CancelAll() {
  std::vector<std::shared_ptr<Call>> calls;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& s : live_) calls.push_back(s->call);
    wake_ = true;
  }
  for (const auto& call : calls) {
    for (uint64_t id : call->request_ids) engine_->Cancel(id);
  }
}

void Scheduler::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_ && !thread_.joinable()) return;
    draining_ = true;
  }
  CancelAll();
  // Let the engine deliver the cancellations (bounded: an engine that never finishes them must
  // not hang shutdown).
  WaitUntilIdle(absl::Now() + absl::Seconds(5));
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int Scheduler::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

uint64_t Scheduler::step_failures() const {
  absl::MutexLock lock(&mu_);
  return step_failures_;
}

int Scheduler::FailAll(const absl::Status& status) {
  std::vector<std::shared_ptr<CallState>> states;
  {
    absl::MutexLock lock(&mu_);
    // Calls still being submitted on another thread are left alone: their request ids are not
    // complete yet, and they arrived after the failure.
    for (const auto& s : live_) {
      if (s->submitted) states.push_back(s);
    }
  }
  int ended = 0;
  for (const auto& s : states) {
    for (size_t i = 0; i < s->finished.size(); ++i) {
      if (s->finished[i]) continue;
      engine_->Cancel(s->call->request_ids[i]);
      s->finished[i] = true;
      engine::GenerationEvent event;
      event.finish_reason = engine::FinishReason::kError;
      event.error = EngineFailure(status);
      s->call->events->Push({static_cast<int>(i), std::move(event)});
      OnFinal(s.get());
      ++ended;
    }
  }
  return ended;
}

void Scheduler::Loop() {
  while (true) {
    // HasWork is asked outside mu_: the engine's lock and ours are never held together.
    const bool work = engine_->HasWork();
    {
      absl::MutexLock lock(&mu_);
      // The timeout is a safety net: Submit and Cancel set wake_.
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return wake_ || stop_; };
      if (!work) mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(20));
      if (stop_) return;
      wake_ = false;
    }
    if (!work) continue;
    step_errors_ = 0;
    absl::Status status = engine_->Step();
    if (status.ok()) continue;
    // The engine's own failure. It ends the requests the failure touched (their final events,
    // with the error, arrived during the step); the others stay queued and the loop goes on, so
    // the server keeps serving. An engine that ended none would leave its requests waiting on a
    // failed step forever: then every admitted request ends here instead.
    int ended = step_errors_;
    if (ended == 0) ended = FailAll(status);
    {
      absl::MutexLock lock(&mu_);
      ++step_failures_;
    }
    metrics_->CountEngineFailure();
    std::fprintf(stderr, "server: engine step failed: %s; %d request(s) ended with it\n",
                 status.ToString().c_str(), ended);
  }
}

}  // namespace moe::serving
