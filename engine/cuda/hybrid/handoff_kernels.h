// The GPU side of the hybrid handoff (cpu_handoff.h): the exchange block in mapped pinned host
// memory, and the two kernels a captured decode step runs per MoE layer:
//   PostCpuRoutes after ensure_experts: copies the routes ensure sent to the CPU (kCpuSlot), their
//     weights and the hidden rows they need into the exchange, then publishes a new request
//     number (a layer with no CPU route posts nothing);
//   WaitAndAddCpuResult before the layer's output is used: waits until the CPU worker has
//     answered that number, then adds the CPU's rows into y.
// Both are allocation-free and host-sync-free, so they are captured into the decode graph; the
// request counter lives in device memory and advances on every replay.
//
// A wait gives up after `timeout_ns` (a CPU worker that died must not hang the GPU): it sets
// HandoffControl::gpu_timeouts, later waits of the step skip waiting, and the host reports the
// step as failed (GpuHandoff::TakeError).
//
// Thread-safety: GpuHandoff is used by one host thread and one stream at a time.
#ifndef MOE_ENGINE_CUDA_HYBRID_HANDOFF_KERNELS_H_
#define MOE_ENGINE_CUDA_HYBRID_HANDOFF_KERNELS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/hybrid/cpu_handoff.h"

struct CUstream_st;

namespace moe::engine::hybrid {

// Owns the exchange block (pinned, mapped), the device-side counters and the CpuWorker.
class GpuHandoff {
 public:
  // Unavailable without a CUDA device; ResourceExhausted when the pinned block cannot be had.
  static absl::StatusOr<std::unique_ptr<GpuHandoff>> Create(const HandoffShape& shape,
                                                            HandoffCompute compute);
  ~GpuHandoff();
  GpuHandoff(const GpuHandoff&) = delete;
  GpuHandoff& operator=(const GpuHandoff&) = delete;

  // Enqueue on `stream` (capturable).
  //   ids, slot_ids, route_weights: device [rows, top_k]; x: device [rows, hidden] f32.
  absl::Status Post(int layer, int rows, const int32_t* ids, const int32_t* slot_ids,
                    const float* route_weights, const float* x, CUstream_st* stream);
  //   y: device [rows, hidden] f32, y += the CPU's rows. wait = false skips the wait (a negative
  //   control for tests: it reads whatever the exchange holds).
  absl::Status WaitAndAdd(int rows, float* y, CUstream_st* stream, bool wait = true);

  // Around each step: Arm before launching it, Disarm after its stream finished.
  void Arm() { worker_->Arm(); }
  void Disarm() { worker_->Disarm(); }
  // After a step's stream finished: a CPU compute error or a wait that timed out (then clears
  // both), else OK.
  absl::Status TakeError();

  const CpuWorker& worker() const { return *worker_; }
  const HandoffView& host_view() const { return host_; }
  void set_timeout_ns(int64_t ns) { timeout_ns_ = ns; }

 private:
  GpuHandoff() = default;
  HandoffView host_;    // host addresses
  HandoffView device_;  // the same block as the GPU addresses it
  void* block_ = nullptr;
  // Device memory: [0] request counter, [1] posted flag, [2] blocks done, [3] CPU routes, then
  // [max_rows] per-row "has a CPU route" flags.
  uint32_t* counters_ = nullptr;
  int64_t timeout_ns_ = 2'000'000'000;
  std::unique_ptr<CpuWorker> worker_;
};

}  // namespace moe::engine::hybrid

#endif  // MOE_ENGINE_CUDA_HYBRID_HANDOFF_KERNELS_H_
