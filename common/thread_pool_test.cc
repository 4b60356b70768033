#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe::common {
namespace {

// Counts calls per task and checks worker ids: in range, and never used by two calls at once.
class Checker {
 public:
  Checker(uint64_t n, int workers) : counts_(n), in_use_(workers) {}

  void operator()(uint64_t task, int worker) const {
    if (worker < 0 || worker >= static_cast<int>(in_use_.size())) {
      bad_worker_.fetch_add(1);
      return;
    }
    if (in_use_[worker].exchange(true, std::memory_order_acq_rel)) overlaps_.fetch_add(1);
    counts_[task].fetch_add(1, std::memory_order_relaxed);
    // A little work so calls overlap in time.
    for (volatile int i = 0; i < static_cast<int>(task % 7) * 10; ++i) {
    }
    in_use_[worker].store(false, std::memory_order_release);
  }

  void ExpectExactlyOnce() const {
    EXPECT_EQ(bad_worker_.load(), 0);
    EXPECT_EQ(overlaps_.load(), 0);
    for (size_t i = 0; i < counts_.size(); ++i) {
      ASSERT_EQ(counts_[i].load(), 1) << "task " << i;
    }
  }

 private:
  mutable std::vector<std::atomic<int>> counts_;
  mutable std::vector<std::atomic<bool>> in_use_;
  mutable std::atomic<int> bad_worker_{0};
  mutable std::atomic<int> overlaps_{0};
};

TEST(ThreadPoolTest, ExactlyOnceWithManySmallTasks) {
  // More workers than the machine's cores: the contended, preempted case.
  ThreadPool pool(6);
  EXPECT_EQ(pool.num_workers(), 6);
  for (int rep = 0; rep < 30; ++rep) {
    const uint64_t n = 20000 + rep * 37;
    Checker check(n, pool.num_workers());
    pool.ParallelFor(n, check);
    check.ExpectExactlyOnce();
  }
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerializedAndExact) {
  ThreadPool pool(4);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&pool, &failures, c] {
      for (int rep = 0; rep < 150; ++rep) {
        const uint64_t n = 1 + (rep * 131 + c * 17) % 3000;
        Checker check(n, pool.num_workers());
        pool.ParallelFor(n, check);
        check.ExpectExactlyOnce();
        if (::testing::Test::HasFailure()) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPoolTest, ZeroTasksCallsNothing) {
  ThreadPool pool(3);
  std::atomic<int> calls{0};
  pool.ParallelFor(0, [&](uint64_t, int) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 0);
}

TEST(ThreadPoolTest, FewerTasksThanWorkers) {
  ThreadPool pool(8);
  for (uint64_t n = 1; n < 8; ++n) {
    Checker check(n, pool.num_workers());
    pool.ParallelFor(n, check);
    check.ExpectExactlyOnce();
  }
}

TEST(ThreadPoolTest, PoolOfOneRunsEverythingOnTheCaller) {
  ThreadPool pool(1);
  EXPECT_EQ(pool.num_workers(), 1);
  const std::thread::id me = std::this_thread::get_id();
  Checker check(1000, 1);
  std::atomic<int> elsewhere{0};
  pool.ParallelFor(1000, [&](uint64_t task, int worker) {
    if (std::this_thread::get_id() != me || worker != 0) elsewhere.fetch_add(1);
    check(task, worker);
  });
  check.ExpectExactlyOnce();
  EXPECT_EQ(elsewhere.load(), 0);
  EXPECT_EQ(ThreadPool(0).num_workers(), 1);
}

TEST(ThreadPoolTest, WorkerZeroIsTheCallerAndEveryWorkerTakesPart) {
  constexpr int kWorkers = 4;
  ThreadPool pool(kWorkers);
  // Each task waits until all kWorkers tasks have started: that only completes if every worker
  // took exactly one, concurrently (a blocked worker cannot claim a second task).
  std::atomic<int> arrived{0};
  std::vector<std::atomic<int>> by_worker(kWorkers);
  std::atomic<bool> timed_out{false};
  std::atomic<int> zero_not_caller{0};
  const std::thread::id me = std::this_thread::get_id();
  pool.ParallelFor(kWorkers, [&](uint64_t, int worker) {
    by_worker[worker].fetch_add(1);
    if ((worker == 0) != (std::this_thread::get_id() == me)) zero_not_caller.fetch_add(1);
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < kWorkers) {
      if (std::chrono::steady_clock::now() > deadline) {
        timed_out = true;
        break;
      }
      std::this_thread::yield();
    }
  });
  EXPECT_FALSE(timed_out.load());
  EXPECT_EQ(zero_not_caller.load(), 0);
  for (int w = 0; w < kWorkers; ++w) EXPECT_EQ(by_worker[w].load(), 1) << w;
}

TEST(ThreadPoolTest, WorksAfterWorkersFellAsleep) {
  ThreadPool pool(3);
  for (int rep = 0; rep < 5; ++rep) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // past the spin window
    Checker check(500, pool.num_workers());
    pool.ParallelFor(500, check);
    check.ExpectExactlyOnce();
  }
}

// CPU seconds of clock `id` (CLOCK_PROCESS_CPUTIME_ID, CLOCK_THREAD_CPUTIME_ID).
double CpuSeconds(clockid_t id) {
  timespec ts;
  clock_gettime(id, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// CPU time the pool's worker threads burn over `reps` small jobs, each followed by 1 ms of the
// caller sleeping: the time the workers spin between jobs (the whole process's CPU time less
// the caller's own).
double WorkerCpuSecondsBetweenJobs(ThreadPool& pool, int reps) {
  const double process0 = CpuSeconds(CLOCK_PROCESS_CPUTIME_ID);
  const double self0 = CpuSeconds(CLOCK_THREAD_CPUTIME_ID);
  for (int rep = 0; rep < reps; ++rep) {
    Checker check(64, pool.num_workers());
    pool.ParallelFor(64, check);
    check.ExpectExactlyOnce();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return (CpuSeconds(CLOCK_PROCESS_CPUTIME_ID) - process0) -
         (CpuSeconds(CLOCK_THREAD_CPUTIME_ID) - self0);
}

TEST(ThreadPoolTest, ParkedWorkersSleepInsteadOfSpinning) {
  ThreadPool pool(4);
  pool.ParallelFor(64, [](uint64_t, int) {});  // workers now spin
  pool.Park();
  // Park() returned: nobody spins, so all three worker threads reach the condition variable.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (pool.sleeping_workers() < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  EXPECT_EQ(pool.sleeping_workers(), 3);
  // Jobs still run exactly once while parked, and the workers burn far less CPU between them
  // than unparked workers, which spin for a while after each job.
  const double parked = WorkerCpuSecondsBetweenJobs(pool, 40);
  pool.Unpark();
  const double unparked = WorkerCpuSecondsBetweenJobs(pool, 40);
  std::printf("worker CPU between 40 jobs: parked %.2f ms, unparked %.2f ms\n", 1e3 * parked,
              1e3 * unparked);
  if (unparked < 2e-3) GTEST_SKIP() << "unparked workers spun only " << unparked << " s";
  EXPECT_LT(parked, 0.5 * unparked) << "parked " << parked << " s, unparked " << unparked << " s";
}

TEST(ThreadPoolTest, ParkingNestsAndRacesWithCallers) {
  ThreadPool pool(4);
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::thread caller([&] {
    while (!done.load()) {
      Checker check(1000, pool.num_workers());
      pool.ParallelFor(1000, check);
      check.ExpectExactlyOnce();
      if (::testing::Test::HasFailure()) failures.fetch_add(1);
    }
  });
  for (int rep = 0; rep < 200; ++rep) {
    ThreadPool::Parking outer(&pool);
    { ThreadPool::Parking inner(&pool); }
    ThreadPool::Parking none(nullptr);
  }
  done.store(true);
  caller.join();
  EXPECT_EQ(failures.load(), 0);
  // Unparked again: workers spin after a job as before, and still run every task.
  Checker check(500, pool.num_workers());
  pool.ParallelFor(500, check);
  check.ExpectExactlyOnce();
}

TEST(ThreadPoolTest, PhysicalCoreCountIsPositive) {
  const int n = PhysicalCoreCount();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

TEST(ThreadPoolTest, PinnedWorkersRunOnDistinctCores) {
  const int cores = PhysicalCoreCount();
  const int workers = std::max(2, cores);
  ThreadPool pool(workers, /*pin_to_cores=*/true);
  std::vector<cpu_set_t> masks(workers);
  std::atomic<int> arrived{0};
  pool.ParallelFor(workers, [&](uint64_t, int worker) {
    pthread_getaffinity_np(pthread_self(), sizeof(cpu_set_t), &masks[worker]);
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < workers && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
  });
  if (cores < 2) GTEST_SKIP() << "one physical core: nothing to distinguish";
  cpu_set_t all;
  sched_getaffinity(0, sizeof(all), &all);
  for (int w = 1; w < workers; ++w) {
    // Pinned to one core's CPUs: fewer than the process may use.
    EXPECT_LT(CPU_COUNT(&masks[w]), CPU_COUNT(&all)) << "worker " << w;
    for (int v = w + 1; v < workers; ++v) {
      if (w % cores == v % cores) continue;
      cpu_set_t both;
      CPU_AND(&both, &masks[w], &masks[v]);
      EXPECT_EQ(CPU_COUNT(&both), 0) << "workers " << w << " and " << v << " share a CPU";
    }
  }
}

}  // namespace
}  // namespace moe::common
