// Scheduler: the thread that drives Engine::Step, admission control in front of the engine, and
// the per-call event queues the HTTP and gRPC fronts read from.
//
// Continuous batching is the engine's (every Step advances all active sequences: new ones join
// at a step boundary, prefilled in chunks, finished ones leave); the scheduler keeps that loop
// running while there is work, bounds how many requests may be admitted (max_batch running plus
// max_queue waiting; beyond that ResourceExhausted, which the fronts send as 429), refuses new
// work with Unavailable while draining, and routes each engine event to the queue of the call it
// belongs to. One call (an HTTP request or a gRPC stream) may own several engine requests (the
// OpenAI `n`); their events arrive in one queue tagged with the choice index.
//
// Ownership: the Scheduler borrows the Engine (which must outlive it) and owns its thread. A Call
// is shared by the front that consumes it and the engine callbacks that feed it.
// Thread-safety: every public method is thread-safe.
#ifndef MOE_SERVING_SCHEDULER_H_
#define MOE_SERVING_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "serving/metrics.h"

namespace moe::serving {

// Events of one call, in the order the engine produced them.
class EventQueue {
 public:
  struct Item {
    int index = 0;  // which of the call's requests (the OpenAI choice index)
    engine::GenerationEvent event;
  };

  void Push(Item item);
  // Non-blocking; false when empty.
  bool Pop(Item* out);
  // Waits up to `timeout` for an item; false when none came.
  bool WaitPop(Item* out, absl::Duration timeout);
  // `listener` runs after every Push (on the pushing thread, outside the queue's lock, so it may
  // Pop). Setting a new listener (or nullptr) waits for a running call of the old one to return:
  // after SetListener(nullptr) the old one is never called again.
  void SetListener(std::function<void()> listener);

 private:
  absl::Mutex mu_;
  std::deque<Item> items_ ABSL_GUARDED_BY(mu_);
  absl::Mutex listener_mu_;
  std::function<void()> listener_ ABSL_GUARDED_BY(listener_mu_);
};

// One admitted call. Its queue receives every event of every request; each request's last event
// has a finish reason (kCancelled when cancelled, kError when the engine failed: its status is
// then Unavailable when the engine ran out of a resource, Internal otherwise, with the engine's
// message).
struct Call {
  std::shared_ptr<EventQueue> events = std::make_shared<EventQueue>();
  std::vector<uint64_t> request_ids;  // engine ids, by choice index; set once Submit returns
  absl::Time submitted;
};

struct SchedulerOptions {
  int max_batch = 64;  // requests the engine runs at once
  int max_queue = 256;  // requests admitted beyond those; more are refused (ResourceExhausted)
};

class Scheduler {
 public:
  Scheduler(engine::Engine* engine, SchedulerOptions options, Metrics* metrics);
  ~Scheduler();  // Stop()s

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Admits all of `requests` (their on_event is replaced) or none: ResourceExhausted when the
  // queue is full, Unavailable while draining, the engine's InvalidArgument for a bad request.
  absl::StatusOr<std::shared_ptr<Call>> Submit(std::vector<engine::GenerationRequest> requests);
  // Ends every request of the call; the engine frees their sequences at its next step.
  void Cancel(const Call& call);

  // Refuse new calls from now on (Unavailable); running ones continue.
  void StartDraining();
  bool draining() const;
  // True once no admitted request is left, false at `deadline` otherwise.
  bool WaitUntilIdle(absl::Time deadline);
  // Cancels every admitted request.
  void CancelAll();
  // Ends the step thread (requests still admitted are cancelled first). Idempotent.
  void Stop();

  // Admitted requests whose final event has not been delivered yet.
  int in_flight() const;
  engine::Engine& engine() const { return *engine_; }
  const SchedulerOptions& options() const { return options_; }
  // Engine steps that failed. The requests the failure touched ended with kError; the loop
  // goes on with the others and with new ones.
  uint64_t step_failures() const;

 private:
  struct CallState;
  void Loop();
  void OnFinal(CallState* state) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every admitted request with the engine's failure (on the step thread); returns how many.
  int FailAll(const absl::Status& status);

  engine::Engine* const engine_;
  const SchedulerOptions options_;
  Metrics* const metrics_;

  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t step_failures_ ABSL_GUARDED_BY(mu_) = 0;
  // Requests the engine ended with kError during the current step (step thread only).
  int step_errors_ = 0;
  // Calls with requests in flight (owned jointly with their engine callbacks).
  absl::flat_hash_set<std::shared_ptr<CallState>> live_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace moe::serving

#endif  // MOE_SERVING_SCHEDULER_H_
