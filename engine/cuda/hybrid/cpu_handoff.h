// The handoff of hybrid expert computation between the GPU's captured decode step and CPU
// workers, through one block of host memory that the GPU maps into its address space.
//
// Per MoE layer the GPU (handoff_kernels.h) writes the routes that ensure_experts sent to the
// CPU (kCpuSlot), their routing weights and the hidden rows they need, then a sequence number;
// a CpuWorker polling that number computes the routes (cpu_moe, straight from the expert store's
// pinned memory) into `y`, then publishes the same number as done; a kernel in the graph waits for
// it and adds y into the layer's output. No driver call and no host synchronisation per layer:
// only loads and stores to this memory.
//
// Memory order: each side writes its payload, then its sequence number with release semantics
// (the GPU: a system-scope fence, then the store); the reader loads the number with acquire
// semantics before reading the payload.
//
// Thread-safety: CpuWorker's public methods may be called from any one host thread; its worker
// thread is the only CPU writer of `y` and of the control block's CPU fields.
#ifndef MOE_ENGINE_CUDA_HYBRID_CPU_HANDOFF_H_
#define MOE_ENGINE_CUDA_HYBRID_CPU_HANDOFF_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/status/status.h"

namespace moe::engine::hybrid {

// The control block, at the start of the exchange. The GPU's fields and the CPU's sit on
// different 64-byte lines.
struct alignas(64) HandoffControl {
  // Written by the GPU; request_seq last.
  uint32_t request_seq;
  int32_t layer;       // MoE layer index of the request
  int32_t num_tokens;  // rows of ids / weights / x
  int32_t cpu_routes;  // routes for the CPU in the request
  uint32_t gpu_timeouts;  // set by a wait that gave up (the host reports and clears it)
  uint32_t gpu_pad[11];
  // Written by the CPU worker; done_seq last.
  uint32_t done_seq;
  int32_t status;  // 0, or the absl::StatusCode of a compute that failed (y is then not valid)
  uint32_t cpu_pad[14];
};
static_assert(sizeof(HandoffControl) == 128, "two cache lines");

struct HandoffShape {
  int max_rows = 0;  // tokens of the largest request
  int top_k = 0;
  int hidden = 0;
};

// Pointers into one exchange block (host addresses, or the GPU's addresses of the same block).
//   ids     [max_rows, top_k] int32: the expert of each route for the CPU, -1 for the others
//   weights [max_rows, top_k] f32: routing weights
//   x       [max_rows, hidden] f32: the hidden rows (valid for rows with a CPU route)
//   y       [max_rows, hidden] f32: the CPU's result (valid for rows with a CPU route)
struct HandoffView {
  HandoffControl* ctrl = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  float* x = nullptr;
  float* y = nullptr;
  HandoffShape shape;
};

// Bytes of an exchange block of `shape` (every array 64-byte aligned).
size_t HandoffBytes(const HandoffShape& shape);
// The view of an exchange block at `base` (64-byte aligned, HandoffBytes(shape) long).
HandoffView MakeHandoffView(void* base, const HandoffShape& shape);

// Computes one request: y[t] = sum over the routes j of row t with ids[t, j] >= 0 of
// weights[t, j] * expert_{ids[t, j]}(x[t]), for the MoE layer `layer`. Rows with no route need not
// be written. Runs on the worker thread.
using HandoffCompute =
    std::function<absl::Status(int layer, int num_tokens, const int32_t* ids,
                               const float* weights, const float* x, float* y)>;

// The CPU side: a thread that, while armed, polls the control block and answers each request.
// Armed only while the host has a step in flight (the poll spins on one core); disarmed, it
// sleeps.
class CpuWorker {
 public:
  // `view` uses host addresses and outlives the worker.
  CpuWorker(const HandoffView& view, HandoffCompute compute);
  ~CpuWorker();  // stops and joins the thread
  CpuWorker(const CpuWorker&) = delete;
  CpuWorker& operator=(const CpuWorker&) = delete;

  void Arm();
  // Stops polling once the requests seen so far are answered; call after the step's stream
  // has finished (every request it posted has been answered by then).
  void Disarm();

  // The first compute error since the last call (OK if none), and clears it.
  absl::Status TakeError();
  int64_t requests() const { return requests_.load(std::memory_order_relaxed); }
  // Seconds spent computing requests (from seeing the request to publishing the answer).
  double busy_seconds() const;

 private:
  void Loop();

  HandoffView view_;
  HandoffCompute compute_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;  // guarded by mu_
  bool stop_ = false;   // guarded by mu_
  std::atomic<bool> polling_{false};
  absl::Status error_;  // guarded by mu_
  std::atomic<int64_t> requests_{0};
  std::atomic<int64_t> busy_ns_{0};
  std::thread thread_;
};

}  // namespace moe::engine::hybrid

#endif  // MOE_ENGINE_CUDA_HYBRID_CPU_HANDOFF_H_
