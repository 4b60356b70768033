// ensure_experts kernel and DeviceCacheState: see ensure_kernels.h.
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "moe_cache/gpu/ensure_kernels.h"

namespace moe::moe_cache {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct Candidate {
  uint64_t score;
  int32_t slot;  // -1: none
};

__device__ inline Candidate Better(Candidate a, Candidate b) {
  return ArgminBetter(a.score, a.slot, b.score, b.slot) ? a : b;
}

// Block-wide argmin of (SlotScore, slot) over eligible slots; the result is in every thread.
__device__ Candidate BlockPickVictim(const CacheStateView& st, int32_t layer, uint32_t counter,
                                     Candidate* warp_best) {
  Candidate best{0, -1};
  for (int32_t s = threadIdx.x; s < st.num_slots; s += blockDim.x) {
    if (!SlotEligible(&st, s, counter)) continue;
    best = Better(Candidate{SlotScore(&st, s, layer, counter), s}, best);
  }
  for (int off = 16; off > 0; off >>= 1) {
    Candidate other;
    other.score = __shfl_down_sync(0xffffffffu, best.score, off);
    other.slot = __shfl_down_sync(0xffffffffu, best.slot, off);
    best = Better(other, best);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_best[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    Candidate b = warp_best[0];
    for (int w = 1; w < kWarps; ++w) b = Better(warp_best[w], b);
    warp_best[0] = b;
  }
  __syncthreads();
  const Candidate result = warp_best[0];
  __syncthreads();  // warp_best is reused by the next search
  return result;
}

// One block. Follows THE DECISION ORDER of policy_core.h step by step; every step that writes
// state another thread reads is closed by __syncthreads(), which also orders global memory
// within the block.
__global__ void __launch_bounds__(kThreads)
    EnsureExpertsKernel(CacheStateView st, int32_t layer, const int32_t* ids, int32_t num_ids,
                        int32_t* slot_ids, int32_t* plan_count, MissPlanEntry* plan,
                        int32_t* error_flag, const int32_t* fetch_of_misses) {
  // first[E]: the first index of each expert in ids (the split's tie-break); used[E]: 0 not
  // routed, 1 routed, 2 sent to the CPU, 3 a miss found unplaceable, 4 to be sent to the CPU.
  extern __shared__ int32_t first[];
  uint8_t* used = reinterpret_cast<uint8_t*>(first + st.num_experts);
  __shared__ Candidate warp_best[kWarps];
  __shared__ int32_t misses;
  __shared__ int32_t distinct_misses;
  const int32_t E = st.num_experts;
  const uint32_t counter = *st.call_counter;
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    used[e] = 0;
    first[e] = num_ids;
  }
  if (threadIdx.x == 0) {
    misses = 0;
    distinct_misses = 0;
  }
  __syncthreads();

  // (1) Hits: mark used, refresh the slot. Idempotent per slot, so order does not matter here.
  for (int32_t i = threadIdx.x; i < num_ids; i += blockDim.x) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) {
      // An id >= E: skipped like padding, reported through the flag (the first one wins).
      if (id >= E && error_flag != nullptr) atomicCAS(error_flag, 0, id);
      continue;
    }
    used[id] = 1;
    if (fetch_of_misses != nullptr) atomicMin(&first[id], i);
    const int32_t s = st.slot_of[layer * E + id];
    if (s >= 0) OnHit(&st, s, counter);
  }
  __syncthreads();

  // (1b) The hybrid split: the misses ranked past FetchCount (FetchBefore's order) go to the
  // CPU.
  if (fetch_of_misses != nullptr) {
    int32_t local = 0;
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
      local += used[e] != 0 && st.slot_of[layer * E + e] < 0;
    }
    if (local != 0) atomicAdd(&distinct_misses, local);
    __syncthreads();
    const int32_t fetch = FetchCount(fetch_of_misses, distinct_misses);
    for (int32_t a = threadIdx.x; a < E; a += blockDim.x) {
      if (used[a] == 0 || st.slot_of[layer * E + a] >= 0) continue;
      const uint32_t fa = st.freq[layer * E + a];
      int32_t rank = 0;
      for (int32_t b = 0; b < E; ++b) {
        if (used[b] == 0 || st.slot_of[layer * E + b] >= 0) continue;
        rank += FetchBefore(st.freq[layer * E + b], first[b], fa, first[a]);
      }
      if (rank >= fetch) used[a] = 4;  // other threads only test used[] against 0 here
    }
    __syncthreads();
  }

  // (2) Misses to fetch, in order of first occurrence: one block-wide argmin each. Every branch
  // below is uniform across the block (reads after a barrier).
  for (int32_t i = 0; i < num_ids; ++i) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) continue;
    const int32_t g = layer * E + id;
    if (st.slot_of[g] >= 0) continue;
    if (used[id] == 2 || used[id] == 3) continue;  // already sent to the CPU or unplaceable
    if (used[id] == 4) {
      __syncthreads();  // every thread has read used[id]
      if (threadIdx.x == 0) used[id] = 2;
      __syncthreads();
      continue;
    }
    const Candidate victim = BlockPickVictim(st, layer, counter, warp_best);
    if (victim.slot < 0) {  // nothing eligible: left unplaced
      if (threadIdx.x == 0) used[id] = 3;
      __syncthreads();
      continue;
    }
    if (threadIdx.x == 0) {
      OnFill(&st, g, victim.slot, counter);
      plan[misses] = MissPlanEntry{g, victim.slot};
      ++misses;
    }
    __syncthreads();
  }

  // (2b) Slot ids for every route: the slot, kCpuSlot for an expert on the CPU, -1 for padding
  // or an unplaced miss.
  for (int32_t i = threadIdx.x; i < num_ids; i += blockDim.x) {
    const int32_t id = ids[i];
    if (!IsRoutedId(id, E)) {
      slot_ids[i] = -1;
      continue;
    }
    const int32_t s = st.slot_of[layer * E + id];
    slot_ids[i] = s >= 0 ? s : (used[id] == 2 ? kCpuSlot : -1);
  }
  // (3) Frequencies of this layer's experts, then the counter.
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    UpdateFrequency(&st, layer * E + e, used[e] != 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *plan_count = misses;
    FinishCall(&st);
  }
}

uint64_t AlignUp(uint64_t x) { return (x + 255) / 256 * 256; }

}  // namespace

absl::Status LaunchEnsureExperts(const CacheStateView& state, int32_t layer, const int32_t* ids,
                                 int32_t num_ids, int32_t* slot_ids, int32_t* plan_count,
                                 MissPlanEntry* plan, CUstream_st* stream, int32_t* error_flag,
                                 const int32_t* fetch_of_misses) {
  if (layer < 0 || layer >= state.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("ensure_experts: layer ", layer, " out of [0, ", state.num_layers, ")"));
  }
  if (state.num_experts <= 0 || state.num_experts > kMaxExpertsPerLayer) {
    return absl::InvalidArgumentError(absl::StrCat("ensure_experts: ", state.num_experts,
                                                   " experts per layer; at most ",
                                                   kMaxExpertsPerLayer));
  }
  if (num_ids < 0) return absl::InvalidArgumentError("ensure_experts: negative id count");
  const size_t shared_bytes = static_cast<size_t>(state.num_experts) * 5;
  EnsureExpertsKernel<<<1, kThreads, shared_bytes, stream>>>(state, layer, ids, num_ids,
                                                                  slot_ids, plan_count, plan,
                                                                  error_flag, fetch_of_misses);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status TakeEnsureError(int32_t* error_flag, CUstream_st* stream) {
  if (error_flag == nullptr) return absl::InvalidArgumentError("TakeEnsureError: null flag");
  int32_t bad_id = 0;
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&bad_id, error_flag, sizeof(bad_id), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (bad_id == 0) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(error_flag, 0, sizeof(int32_t), stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::InvalidArgumentError(absl::StrCat(
      "ensure_experts: routed expert id ", bad_id, " is >= the experts per layer"));
}

namespace {

// Byte offsets of each array inside DeviceCacheState's single allocation.
struct Offsets {
  uint64_t slot_of, expert_of_slot, last_use, freq, pinned, counter, total;
};

Offsets ComputeOffsets(uint64_t experts, uint64_t slots) {
  Offsets o{};
  uint64_t at = 0;
  o.slot_of = at;
  at = AlignUp(at + experts * 4);
  o.expert_of_slot = at;
  at = AlignUp(at + slots * 4);
  o.last_use = at;
  at = AlignUp(at + slots * 4);
  o.freq = at;
  at = AlignUp(at + experts * 4);
  o.pinned = at;
  at = AlignUp(at + experts);
  o.counter = at;
  o.total = AlignUp(at + 4);
  return o;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceCacheState>> DeviceCacheState::Create(
    int num_layers, int num_experts, int num_slots, const PolicyParams& params) {
  if (num_layers <= 0 || num_experts <= 0 || num_slots <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("device cache state needs positive sizes, got ",
                                                   num_layers, " x ", num_experts, ", ",
                                                   num_slots, " slots"));
  }
  RETURN_IF_ERROR(common::CudaAvailable());
  const uint64_t experts = static_cast<uint64_t>(num_layers) * num_experts;
  const Offsets o = ComputeOffsets(experts, num_slots);
  std::unique_ptr<DeviceCacheState> state(new DeviceCacheState());
  CUDA_RETURN_IF_ERROR(cudaMalloc(&state->block_, o.total));
  uint8_t* base = static_cast<uint8_t*>(state->block_);
  CacheStateView& v = state->view_;
  v.slot_of = reinterpret_cast<int32_t*>(base + o.slot_of);
  v.expert_of_slot = reinterpret_cast<int32_t*>(base + o.expert_of_slot);
  v.last_use = reinterpret_cast<uint32_t*>(base + o.last_use);
  v.freq = reinterpret_cast<uint32_t*>(base + o.freq);
  v.pinned = base + o.pinned;
  v.call_counter = reinterpret_cast<uint32_t*>(base + o.counter);
  v.num_layers = num_layers;
  v.num_experts = num_experts;
  v.num_slots = num_slots;
  v.params = params;

  RETURN_IF_ERROR(state->Reset());
  return state;
}

absl::Status DeviceCacheState::Reset() {
  // The initial state, built on the host and copied over the arrays in place.
  const uint64_t experts = static_cast<uint64_t>(view_.num_layers) * view_.num_experts;
  const Offsets o = ComputeOffsets(experts, view_.num_slots);
  std::vector<uint8_t> init(o.total, 0);
  std::memset(init.data() + o.slot_of, 0xff, experts * 4);                // -1: not resident
  std::memset(init.data() + o.expert_of_slot, 0xff, view_.num_slots * 4);  // -1: free
  const uint32_t one = 1;
  std::memcpy(init.data() + o.counter, &one, 4);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(block_, init.data(), o.total, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

DeviceCacheState::~DeviceCacheState() {
  if (block_ != nullptr) cudaFree(block_);
}

namespace {

// The arrays of a cache state as (device, host, bytes) triples, for copies in either direction.
struct ArrayPair {
  void* device;
  void* host;
  uint64_t bytes;
};

absl::Status CopyState(const CacheStateView& dev, const CacheStateView& host, cudaMemcpyKind kind) {
  if (host.num_layers != dev.num_layers || host.num_experts != dev.num_experts ||
      host.num_slots != dev.num_slots) {
    return absl::InvalidArgumentError("DeviceCacheState: host view has another shape");
  }
  const uint64_t experts = static_cast<uint64_t>(dev.num_layers) * dev.num_experts;
  const uint64_t slots = dev.num_slots;
  const ArrayPair arrays[] = {
      {dev.slot_of, host.slot_of, experts * 4},
      {dev.expert_of_slot, host.expert_of_slot, slots * 4},
      {dev.last_use, host.last_use, slots * 4},
      {dev.freq, host.freq, experts * 4},
      {dev.pinned, host.pinned, experts},
      {dev.call_counter, host.call_counter, 4},
  };
  for (const ArrayPair& a : arrays) {
    const bool up = kind == cudaMemcpyHostToDevice;
    CUDA_RETURN_IF_ERROR(cudaMemcpy(up ? a.device : a.host, up ? a.host : a.device, a.bytes, kind));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DeviceCacheState::Upload(const CacheStateView& h) {
  RETURN_IF_ERROR(CopyState(view_, h, cudaMemcpyHostToDevice));
  view_.params = h.params;
  return absl::OkStatus();
}

absl::Status DeviceCacheState::Download(const CacheStateView& h) const {
  return CopyState(view_, h, cudaMemcpyDeviceToHost);
}

absl::Status DeviceCacheState::UploadPinned(const uint8_t* pinned) {
  const uint64_t experts = static_cast<uint64_t>(view_.num_layers) * view_.num_experts;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(view_.pinned, pinned, experts, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

}  // namespace moe::moe_cache
