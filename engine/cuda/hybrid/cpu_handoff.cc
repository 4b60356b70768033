#include "engine/cuda/hybrid/cpu_handoff.h"

#include <chrono>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moe::engine::hybrid {
namespace {

size_t Align64(size_t x) { return (x + 63) / 64 * 64; }

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

size_t HandoffBytes(const HandoffShape& s) {
  const size_t routes = static_cast<size_t>(s.max_rows) * s.top_k;
  const size_t rows = static_cast<size_t>(s.max_rows) * s.hidden;
  return sizeof(HandoffControl) + Align64(routes * 4) * 2 + Align64(rows * 4) * 2;
}

HandoffView MakeHandoffView(void* base, const HandoffShape& s) {
  HandoffView v;
  v.shape = s;
  uint8_t* p = static_cast<uint8_t*>(base);
  const size_t routes = static_cast<size_t>(s.max_rows) * s.top_k;
  const size_t rows = static_cast<size_t>(s.max_rows) * s.hidden;
  v.ctrl = reinterpret_cast<HandoffControl*>(p);
  p += sizeof(HandoffControl);
  v.ids = reinterpret_cast<int32_t*>(p);
  p += Align64(routes * 4);
  v.weights = reinterpret_cast<float*>(p);
  p += Align64(routes * 4);
  v.x = reinterpret_cast<float*>(p);
  p += Align64(rows * 4);
  v.y = reinterpret_cast<float*>(p);
  return v;
}

CpuWorker::CpuWorker(const HandoffView& view, HandoffCompute compute)
    : view_(view), compute_(std::move(compute)) {
  thread_ = std::thread([this] { Loop(); });
}

CpuWorker::~CpuWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    polling_.store(false, std::memory_order_relaxed);
  }
  cv_.notify_all();
  thread_.join();
}

void CpuWorker::Arm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    polling_.store(true, std::memory_order_relaxed);
  }
  cv_.notify_all();
}

void CpuWorker::Disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  polling_.store(false, std::memory_order_relaxed);
}

absl::Status CpuWorker::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(error_, absl::OkStatus());
}

double CpuWorker::busy_seconds() const {
  return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) * 1e-9;
}

void CpuWorker::Loop() {
  HandoffControl* ctrl = view_.ctrl;
  uint32_t last = __atomic_load_n(&ctrl->done_seq, __ATOMIC_ACQUIRE);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return armed_ || stop_; });
      if (stop_) return;
    }
    // Armed: poll until disarmed. A request posted before Disarm was called is answered first:
    // the host disarms only after the GPU has consumed every answer.
    while (polling_.load(std::memory_order_relaxed)) {
      const uint32_t seq = __atomic_load_n(&ctrl->request_seq, __ATOMIC_ACQUIRE);
      if (seq == last) {
        CpuRelax();
        continue;
      }
      const auto t0 = std::chrono::steady_clock::now();
      const int layer = ctrl->layer;
      const int tokens = ctrl->num_tokens;
      absl::Status st;
      if (tokens < 0 || tokens > view_.shape.max_rows) {
        st = absl::InternalError("hybrid handoff: a request with an impossible row count");
      } else {
        st = compute_(layer, tokens, view_.ids, view_.weights, view_.x, view_.y);
      }
      ctrl->status = st.ok() ? 0 : static_cast<int32_t>(st.code());
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (error_.ok()) error_ = st;
      }
      __atomic_store_n(&ctrl->done_seq, seq, __ATOMIC_RELEASE);
      last = seq;
      requests_.fetch_add(1, std::memory_order_relaxed);
      busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - t0)
                             .count(),
                         std::memory_order_relaxed);
    }
  }
}

}  // namespace moe::engine::hybrid
