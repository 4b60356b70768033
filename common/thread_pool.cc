#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe::common {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker spins before sleeping. Decode calls a pool once or twice per layer,
// every few tens to hundreds of microseconds, so workers stay hot through a step while an idle
// server's pool sleeps after this long.
constexpr auto kSpinTime = std::chrono::microseconds(200);

bool ReadInt(const std::string& path, int* out) {
  std::ifstream f(path);
  return static_cast<bool>(f >> *out);
}

// Logical CPUs this process may run on, grouped by physical core and ordered by (package, core
// id). Sysfs first, then /proc/cpuinfo; empty when neither says anything.
std::vector<std::vector<int>> PhysicalCores() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  const bool have_allowed = sched_getaffinity(0, sizeof(allowed), &allowed) == 0;
  auto is_allowed = [&](int cpu) { return !have_allowed || CPU_ISSET(cpu, &allowed); };
  const int max_cpu =
      have_allowed ? CPU_SETSIZE : static_cast<int>(std::thread::hardware_concurrency());
  std::map<std::pair<int, int>, std::vector<int>> cores;
  for (int cpu = 0; cpu < max_cpu; ++cpu) {
    if (!is_allowed(cpu)) continue;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    int package = 0, core = 0;
    if (!ReadInt(dir + "core_id", &core)) continue;
    ReadInt(dir + "physical_package_id", &package);
    cores[{package, core}].push_back(cpu);
  }
  if (cores.empty()) {
    std::ifstream f("/proc/cpuinfo");
    std::string line;
    int cpu = -1, package = 0;
    while (std::getline(f, line)) {
      const size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
      const int value = std::atoi(line.c_str() + colon + 1);
      if (key == "processor") cpu = value, package = 0;
      if (key == "physical id") package = value;
      if (key == "core id" && cpu >= 0 && is_allowed(cpu)) cores[{package, value}].push_back(cpu);
    }
  }
  std::vector<std::vector<int>> out;
  for (auto& [key, cpus] : cores) out.push_back(std::move(cpus));
  return out;
}

void PinCurrentThread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  const int err = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (err != 0) {
    static std::once_flag once;
    std::call_once(once, [err] {
      std::fprintf(stderr, "ThreadPool: cannot pin worker threads to cores (%s); running unpinned\n",
                   std::strerror(err));
    });
  }
}

}  // namespace

int PhysicalCoreCount() {
  const int n = static_cast<int>(PhysicalCores().size());
  if (n > 0) return n;
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::ThreadPool(int num_workers, bool pin_to_cores)
    : num_workers_(std::max(1, num_workers)) {
  std::vector<std::vector<int>> cores;
  if (pin_to_cores) cores = PhysicalCores();
  threads_.reserve(num_workers_ - 1);
  for (int w = 1; w < num_workers_; ++w) {
    std::vector<int> cpus;
    if (!cores.empty()) cpus = cores[w % cores.size()];
    threads_.emplace_back([this, w, cpus = std::move(cpus)] {
      if (!cpus.empty()) PinCurrentThread(cpus);
      WorkerLoop(w);
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::RunTasks(int worker) {
  const uint64_t n = n_;
  for (uint64_t i = next_task_.fetch_add(1, std::memory_order_relaxed); i < n;
       i = next_task_.fetch_add(1, std::memory_order_relaxed)) {
    invoke_(fn_, i, worker);
  }
}

void ThreadPool::Run(uint64_t n, InvokeFn invoke, const void* fn) {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  invoke_ = invoke;
  fn_ = fn;
  n_ = n;
  next_task_.store(0, std::memory_order_relaxed);
  const uint64_t epoch = epoch_.load(std::memory_order_relaxed) + 1;
  open_epoch_.store(epoch, std::memory_order_seq_cst);
  // seq_cst (not just release): paired with the worker's seq_cst sleepers_ increment, at least
  // one side sees the other, so a worker going to sleep cannot miss this epoch.
  epoch_.store(epoch, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lock(sleep_mu_); }  // a sleeper between check and wait
    cv_.notify_all();
  }
  RunTasks(0);
  // Every task is claimed now. Close the job so no further worker enters, then wait for those
  // inside: they hold the only unfinished tasks and may still read the job fields. Both sides
  // use seq_cst (store then load of the other's variable), so a worker either sees the job closed
  // or is counted in active_.
  open_epoch_.store(kClosed, std::memory_order_seq_cst);
  for (int spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
    if (spins < 4096) {
      CpuRelax();
    } else {
      std::this_thread::yield();  // the worker inside may have been preempted
    }
  }
}

void ThreadPool::Park() {
  parked_.fetch_add(1, std::memory_order_seq_cst);
  // A spinner sees parked_ within one iteration of its loop; one preempted mid-spin needs its
  // next time slice.
  while (spinning_.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
}

void ThreadPool::Unpark() { parked_.fetch_sub(1, std::memory_order_seq_cst); }

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  while (true) {
    // Wait for a new epoch: spin for a while (not while parked), then sleep.
    uint64_t epoch = epoch_.load(std::memory_order_acquire);
    if (epoch == seen) {
      spinning_.fetch_add(1, std::memory_order_seq_cst);
      const auto spin_until = std::chrono::steady_clock::now() + kSpinTime;
      for (int i = 0;; ++i) {
        epoch = epoch_.load(std::memory_order_acquire);
        if (epoch != seen || stop_.load(std::memory_order_relaxed) ||
            parked_.load(std::memory_order_seq_cst) > 0) {
          break;
        }
        CpuRelax();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > spin_until) break;
      }
      spinning_.fetch_sub(1, std::memory_order_seq_cst);
    }
    if (epoch == seen) {
      std::unique_lock<std::mutex> lock(sleep_mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lock, [&] {
        return epoch_.load(std::memory_order_seq_cst) != seen ||
               stop_.load(std::memory_order_relaxed);
      });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      epoch = epoch_.load(std::memory_order_acquire);
    }
    if (epoch == seen) return;  // stop_ and no new job
    seen = epoch;
    active_.fetch_add(1, std::memory_order_seq_cst);
    // Join only if this epoch's job is still open; a late worker (the caller already finished
    // it, maybe even published the next one) leaves without touching the job fields.
    if (open_epoch_.load(std::memory_order_seq_cst) == seen) RunTasks(worker);
    active_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace moe::common
