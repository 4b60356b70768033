// ensure_experts on the GPU: the single writer of the device-side slot map, policy state and
// miss plan. One launch per MoE layer, no host synchronization and no allocation, so it is
// captured into the decode graph and replayed with new routing ids each step. It runs the same
// decision core (moe_cache/policy_core.h) as the CPU mirror (moe_cache/ensure_cpu.h) in the same
// order, so both choose the same victims, victim for victim.
//
// DeviceCacheState owns the device arrays behind a CacheStateView; it is not thread-safe (one
// stream writes it). Plain C++ header: no CUDA includes.
#ifndef MOE_MOE_CACHE_GPU_ENSURE_KERNELS_H_
#define MOE_MOE_CACHE_GPU_ENSURE_KERNELS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe_cache/policy_core.h"

struct CUstream_st;

namespace moe::moe_cache {

// Largest experts-per-layer the kernel supports (its per-call "used" flags live in shared memory).
inline constexpr int kMaxExpertsPerLayer = 1024;

class DeviceCacheState {
 public:
  // All slots free, frequencies zero, nothing pinned, call counter 1 (as the CPU mirror starts).
  static absl::StatusOr<std::unique_ptr<DeviceCacheState>> Create(int num_layers, int num_experts,
                                                                  int num_slots,
                                                                  const PolicyParams& params);
  ~DeviceCacheState();
  DeviceCacheState(const DeviceCacheState&) = delete;
  DeviceCacheState& operator=(const DeviceCacheState&) = delete;

  // The device-side view the kernel takes (pointers into device memory).
  const CacheStateView& view() const { return view_; }

  // Back to the state Create made (every slot free, nothing pinned), in place: the view's
  // addresses, and graphs captured with them, stay valid. Synchronous; between steps.
  absl::Status Reset();

  // Copies every array from / to a host view of the same shape (synchronous; not for the decode
  // loop: for tests, checkpoints and the host pinner, which only writes `pinned`).
  absl::Status Upload(const CacheStateView& host);
  absl::Status Download(const CacheStateView& host) const;
  absl::Status UploadPinned(const uint8_t* pinned);

 private:
  DeviceCacheState() = default;
  CacheStateView view_{};
  void* block_ = nullptr;  // one allocation holding every array
};

// ids: device [num_ids] routed expert ids of this layer (row-major [T, k]; < 0 is padding).
// slot_ids: device [num_ids] out: slot of each id, -1 for padding (or if no slot was eligible).
// plan_count: device [1] out: number of misses placed; plan: device [capacity >= num_ids] out.
// error_flag: optional device int32 [1], zero before the first launch. An id >= E is an error
// that a captured kernel cannot return: the kernel skips that id like padding (no state is read
// or written for it) and, when error_flag is set, stores the id there (the first one wins; the
// flag stays set until cleared). The host checks it once per step with TakeEnsureError.
// fetch_of_misses: optional device int32 [E + 1], the hybrid split table (FetchCount in
// policy_core.h): misses past the count it gives take no slot and get kCpuSlot in slot_ids.
absl::Status LaunchEnsureExperts(const CacheStateView& state, int32_t layer, const int32_t* ids,
                                 int32_t num_ids, int32_t* slot_ids, int32_t* plan_count,
                                 MissPlanEntry* plan, CUstream_st* stream,
                                 int32_t* error_flag = nullptr,
                                 const int32_t* fetch_of_misses = nullptr);

// Reads the error flag of the launches so far on `stream` (waits for the stream) and clears it:
// InvalidArgument naming the offending id when a launch saw an id >= E, else OK; Internal for a
// CUDA failure. Host-synchronous: call outside graph capture, once per step.
absl::Status TakeEnsureError(int32_t* error_flag, CUstream_st* stream);

}  // namespace moe::moe_cache

#endif  // MOE_MOE_CACHE_GPU_ENSURE_KERNELS_H_
