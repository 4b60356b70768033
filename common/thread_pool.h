// ThreadPool: a persistent pool for fork-join loops, ParallelFor(n, fn(task, worker)), built for
// the per-layer calls of MoE decode (a few microseconds each): workers spin briefly between calls
// and then sleep on a condition variable, so a busy pool reacts fast and an idle one burns no CPU.
// A caller about to hand the cores to another thread team (oneDNN's OpenMP threads) parks the
// pool first, so that its idle workers sleep at once instead of spinning beside that team.
// Also PhysicalCoreCount(), to size pools by physical rather than logical cores.
#ifndef MOE_COMMON_THREAD_POOL_H_
#define MOE_COMMON_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::common {

// Distinct (physical package, core) pairs from sysfs (or /proc/cpuinfo); falls back to
// std::thread::hardware_concurrency(); always >= 1.
int PhysicalCoreCount();

// Thread-safety: ParallelFor may be called from any number of threads; calls are serialized.
// It must not be called from inside fn (that would deadlock). The pool owns its threads; the
// destructor joins them and must not race with a ParallelFor.
class ThreadPool {
 public:
  // num_workers >= 1 (values below are treated as 1) counts the calling thread, which runs as
  // worker 0; num_workers - 1 threads are started once and persist. pin_to_cores pins worker
  // thread i (i >= 1) to the i-th physical core (modulo the core count), best effort: a failure is
  // logged once to stderr, not fatal. Worker 0 is whichever thread calls ParallelFor, and the pool
  // leaves that thread's affinity alone (it belongs to the caller).
  explicit ThreadPool(int num_workers, bool pin_to_cores = false);
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_workers() const { return num_workers_; }

  // Runs fn(task, worker) for every task in [0, n) exactly once; `worker` is in
  // [0, num_workers()) and no two concurrently running calls share a worker id (so per-worker
  // scratch needs no locks). Tasks are claimed one at a time from an atomic counter (dynamic load
  // balance; make tasks coarse enough to amortize one atomic add). Blocks until all tasks
  // finished. fn must not throw.
  template <typename Fn>
  void ParallelFor(uint64_t n, const Fn& fn) {
    if (n == 0) return;
    if (num_workers_ == 1 || n == 1) {
      // Nothing to share: skip waking the workers (saves their wake-up latency).
      std::lock_guard<std::mutex> lock(call_mu_);
      for (uint64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    Run(n, &Invoke<Fn>, &fn);
  }

  // Parking: while at least one Park() is outstanding, an idle worker goes to sleep at once
  // instead of spinning for its usual short while first. Park() returns once no worker spins
  // (each is asleep, or inside a job of a concurrent ParallelFor). ParallelFor keeps working
  // while parked: the workers wake for the job and go back to sleep right after it, so the
  // first call after a long parked stretch pays their wake-up (microseconds). Park and Unpark
  // pair up, nest, and may be called from any thread, including during a ParallelFor.
  void Park();
  void Unpark();

  // Parks `pool` (nullptr: nothing) for the lifetime of this object.
  class Parking {
   public:
    explicit Parking(ThreadPool* pool) : pool_(pool) {
      if (pool_ != nullptr) pool_->Park();
    }
    ~Parking() {
      if (pool_ != nullptr) pool_->Unpark();
    }
    Parking(const Parking&) = delete;
    Parking& operator=(const Parking&) = delete;

   private:
    ThreadPool* const pool_;
  };

  // Worker threads asleep on the condition variable right now (for tests and diagnostics).
  int sleeping_workers() const { return sleepers_.load(std::memory_order_relaxed); }

 private:
  using InvokeFn = void (*)(const void* fn, uint64_t task, int worker);
  template <typename Fn>
  static void Invoke(const void* fn, uint64_t task, int worker) {
    (*static_cast<const Fn*>(fn))(task, worker);
  }

  void Run(uint64_t n, InvokeFn invoke, const void* fn);
  void WorkerLoop(int worker);
  // Claims and runs tasks of the current job until none are left.
  void RunTasks(int worker);

  const int num_workers_;
  std::vector<std::thread> threads_;

  std::mutex call_mu_;  // serializes ParallelFor callers

  // The current job, written by the caller before it bumps epoch_ (release) and read by workers
  // after they see the new epoch (acquire).
  InvokeFn invoke_ = nullptr;
  const void* fn_ = nullptr;
  uint64_t n_ = 0;
  alignas(64) std::atomic<uint64_t> next_task_{0};
  alignas(64) std::atomic<uint64_t> epoch_{0};
  // The epoch whose job may still be joined (kClosed once the caller ran out of tasks), and the
  // number of worker threads inside a job. A worker enters (active_++) and then checks
  // open_epoch_; the caller closes and then waits for active_ == 0. So the caller never waits
  // for a worker that is asleep or preempted outside the job, which matters on a busy machine.
  static constexpr uint64_t kClosed = ~uint64_t{0};
  alignas(64) std::atomic<uint64_t> open_epoch_{kClosed};
  alignas(64) std::atomic<int> active_{0};

  // Sleeping workers wait on cv_ under sleep_mu_; sleepers_ tells the caller whether to notify.
  std::mutex sleep_mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};

  // Outstanding Park() calls, and the workers in their idle spin. A worker counts itself in
  // spinning_ and then checks parked_; Park() bumps parked_ and then waits for spinning_ == 0
  // (both seq_cst), so no worker keeps spinning once Park() returned.
  alignas(64) std::atomic<int> parked_{0};
  alignas(64) std::atomic<int> spinning_{0};
};

}  // namespace moe::common

#endif  // MOE_COMMON_THREAD_POOL_H_
