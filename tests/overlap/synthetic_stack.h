// SyntheticMoeStack: a decode step of an MoE model's MoE part that needs no model files, for the
// overlap tests and benchmark. Per layer, on the compute stream unless said otherwise:
//   router GEMM (cuBLAS, bf16 in, f32 logits) -> top-k -> ensure_experts (moe_cache kernel) ->
//   fork: [side] copy_missing (moe_cache gather kernel)  |  [compute] shared expert: gate_up GEMM
//         (cuBLAS bf16) -> SiLU*up -> down GEMM (cuBLAS bf16)
//   join -> checksum consumer over the routed experts' slots (the routed GEMM's stand-in: a copy
//   that lands late changes the checksum) -> residual combine.
// The fork/join is moe_overlap's ForkJoinScope on the stack's StreamPair, so the same code runs
// eager, captured, with the overlap on or off, and (linked against :fork_join_without_join) as
// the negative control. Weights are random from a seed; two stacks built from the same config
// compute the same thing.
//
// Routed experts are stored 4-bit with one scale byte per 16 weights (banks gate_up, down,
// gate_up_scales, down_scales): the byte volume of an NVFP4-style checkpoint, which keeps a
// 40 x 256-expert store of I=512, H=2048 at 17 GB of pinned host memory.
//
// Ownership: owns everything it allocates (store, slot pool, cache state, weights, cuBLAS handle,
// static input/output buffers, the stream pair). All device buffers are allocated in Create(), so
// EnqueueStep() is capturable. Not thread-safe: one host thread drives it.
#ifndef MOE_TESTS_OVERLAP_SYNTHETIC_STACK_H_
#define MOE_TESTS_OVERLAP_SYNTHETIC_STACK_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe_cache/gpu/ensure_kernels.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"
#include "moe_cache/policy_core.h"
#include "moe_overlap/stream_pair.h"

struct CUevent_st;

namespace moe::overlap_test {

struct StackConfig {
  int layers = 4;
  int experts = 32;       // routed experts per layer
  int top_k = 4;
  int hidden = 256;       // H
  int inter = 128;        // routed expert intermediate size (sets the bytes per expert)
  int shared_inter = 128; // shared expert intermediate size
  int slots = 48;         // GPU expert slots, shared by all layers
  int max_batch = 4;      // largest batch (bucket) a step may have
  int vocab = 512;
  uint32_t seed = 1;
  int32_t policy = moe_cache::kPolicyLru;
  moe_cache::GatherLaunchConfig gather;
  moe_overlap::OverlapOptions overlap;
  int host_threads = 4;  // threads that fill the store
};

// Per-layer timing events for one eager step (benchmark only): the side branch (copy_missing) and
// the compute branch (shared expert) of every layer, bracketed by timing events.
struct LayerTimers {
  std::vector<CUevent_st*> side_begin, side_end, compute_begin, compute_end;
  // Optional, [layers * kStageMarks] on the compute stream: before the router, after the router,
  // after ensure_experts, after the join, after the combine (the step's time by stage).
  static constexpr int kStageMarks = 5;
  std::vector<CUevent_st*> stages;
};

class SyntheticMoeStack {
 public:
  // Unavailable without CUDA or a device; InvalidArgument for bad shapes.
  static absl::StatusOr<std::unique_ptr<SyntheticMoeStack>> Create(const StackConfig& config);
  ~SyntheticMoeStack();
  SyntheticMoeStack(const SyntheticMoeStack&) = delete;
  SyntheticMoeStack& operator=(const SyntheticMoeStack&) = delete;

  const StackConfig& config() const { return config_; }
  const moe_overlap::StreamPair& streams() const { return *pair_; }
  CUstream_st* compute() const { return pair_->compute(); }

  // Selects the overlap arm for the following steps (A/B runs on one stack). Both arms share the
  // same two streams; each has its own events. A graph captured under one arm keeps that arm.
  void set_overlap(bool on) { pair_ = on == config_.overlap.overlap ? own_pair_.get() : alt_pair_.get(); }
  bool overlap() const { return pair_->options().overlap; }

  // Replaces the slot pool and cache state with `slots` empty slots (the store stays). Graphs
  // captured before bake in the old ones and must be captured again.
  absl::Status ResetCache(int slots);

  // Copies `tokens` (size = batch <= max_batch) into the static token buffer on the compute
  // stream (not capturable: done before each replay or eager step).
  absl::Status SetTokens(const std::vector<int32_t>& tokens);

  // Enqueues one decode step over `batch` rows on the compute stream (and the side stream through
  // the fork/join). Capturable; `timers` (eager only) adds per-layer timing events.
  absl::Status EnqueueStep(int batch, LayerTimers* timers = nullptr);

  // Pieces of a layer, public so tests can capture them alone and count their graph nodes.
  absl::Status EnqueueRouter(int layer, int batch, CUstream_st* stream);
  absl::Status EnqueueSharedExpert(int layer, int batch, CUstream_st* stream);

  // What the last step left (synchronous reads on the compute stream; the caller synchronises the
  // side stream first where the join may be missing).
  struct StepResult {
    std::vector<float> hidden;          // [batch, H]
    std::vector<int32_t> ids;           // [layers, batch * k]
    std::vector<int32_t> slots;         // [layers, batch * k]
    std::vector<int32_t> plan_counts;   // [layers]
    std::vector<uint32_t> checksums;    // [layers, batch * k]
  };
  absl::StatusOr<StepResult> ReadStep(int batch) const;

  // Host reference checksum of global expert g (over all banks), from the store.
  uint32_t ExpectedChecksum(int global_expert) const { return expected_[global_expert]; }
  // Routes of `result` whose checksum differs from the store's (padding routes excluded).
  int CountMismatches(const StepResult& result, int batch) const;

  const moe_cache::DeviceCacheState& cache_state() const { return *state_; }
  uint64_t bytes_per_expert() const { return store_->bytes_per_expert(); }

 private:
  SyntheticMoeStack() = default;
  absl::Status Init(const StackConfig& config);

  StackConfig config_;
  std::unique_ptr<moe_overlap::StreamPair> own_pair_;  // config_.overlap
  std::unique_ptr<moe_overlap::StreamPair> alt_pair_;  // the other arm, on own_pair_'s streams
  const moe_overlap::StreamPair* pair_ = nullptr;      // the arm in use
  std::unique_ptr<moe_cache::ExpertStore> store_;
  std::unique_ptr<moe_cache::SlotPool> pool_;
  std::unique_ptr<moe_cache::DeviceCacheState> state_;
  moe_cache::GatherDescriptor desc_{};
  std::vector<uint32_t> expected_;  // [layers * experts]
  void* blas_ = nullptr;            // cublasHandle_t
  // One device allocation holds every buffer below (offsets into it), allocated before capture.
  void* arena_ = nullptr;
  int32_t* tokens_ = nullptr;         // [max_batch]
  uint16_t* embed_ = nullptr;         // [vocab, H]
  uint16_t* router_w_ = nullptr;      // [layers, E, H]
  uint16_t* shared_gu_w_ = nullptr;   // [layers, 2*Is, H]
  uint16_t* shared_d_w_ = nullptr;    // [layers, H, Is]
  uint16_t* x_ = nullptr;             // [max_batch, H]
  float* h_ = nullptr;                // [max_batch, H]
  float* logits_ = nullptr;           // [max_batch, E]
  uint16_t* gate_up_ = nullptr;       // [max_batch, 2*Is]
  uint16_t* act_ = nullptr;           // [max_batch, Is]
  uint16_t* shared_out_ = nullptr;    // [max_batch, H]
  int32_t* ids_ = nullptr;            // [layers, max_batch * k]
  float* weights_ = nullptr;          // [layers, max_batch * k]
  int32_t* slot_ids_ = nullptr;       // [layers, max_batch * k]
  int32_t* plan_counts_ = nullptr;    // [layers]
  moe_cache::MissPlanEntry* plans_ = nullptr;  // [layers, max_batch * k]
  uint32_t* partials_ = nullptr;      // [max_batch * k * kChecksumSplit]
  uint32_t* checksums_ = nullptr;     // [layers, max_batch * k]
  void* blas_workspace_ = nullptr;
  // Pinned staging ring for SetTokens: entry i is rewritten only after the copy that last read
  // it (its event) completed, so the host may run steps ahead of the GPU.
  static constexpr int kStagingRing = 4;
  int32_t* staging_ = nullptr;        // pinned [kStagingRing, max_batch]
  CUevent_st* staging_done_[kStagingRing] = {};
  int staging_next_ = 0;
};

}  // namespace moe::overlap_test

#endif  // MOE_TESTS_OVERLAP_SYNTHETIC_STACK_H_
