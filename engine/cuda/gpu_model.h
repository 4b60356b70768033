// GpuModel: the forward pass of a qwen3_moe / qwen2_moe / qwen3_5_moe decoder on one GPU, with
// the same contract as the CPU's engine::Model (engine/model.h) behind the ForwardModel
// interface: chunks of consecutive tokens of different sequences (prefill chunks and decode
// tokens mixed), their keys and values into a paged bf16 KV cache in device memory, logits of
// the rows that want them copied back to the host.
//
// Per layer, on the compute stream: RMSNorm, the q/k/v projections (cuBLAS, bf16 weights and
// activations, f32 out, qwen2_moe's biases), Qwen3's q/k RMSNorm and RoPE (over the first
// rotary_dim of each head), the KV append, decode attention (one token per sequence, split over
// the sequence) or causal prefill attention per chunk, qwen3_5_moe's sigmoid output gate, the o
// projection into the residual; qwen3_5_moe's Gated DeltaNet layers instead run the token mixer
// of engine/cuda/ops/delta_net.h on each sequence's state slot (one GEMM for the q/k/v/z/b/a
// projections, the conv, the gates, the delta rule, the gated norm, the output projection).
// Then the MoE block: router GEMM, softmax top-k in
// f32 (or the routing override's forced ids, weighted by the router's probabilities),
// moe_cache's ensure_experts kernel (the single writer of the slot map and the miss plan), the
// miss copy from the pinned host ExpertStore into the GPU SlotPool by the gather kernel, and the
// routed experts computed from the slots (engine/cuda/experts). The sigmoid-gated shared
// expert (qwen2_moe, qwen3_5_moe) runs on the compute stream beside the miss copy on the side
// stream (moe_overlap's fork/join); without a shared expert the copy runs on the compute stream.
// Dense (non-MoE) layers run a SwiGLU MLP. The final RMSNorm and LM head run only on the rows
// that want logits.
//
// Memory: PlanGpuMemory (engine/gpu_memory_plan.h) on the device's free memory decides the KV
// blocks and the expert slots; every device buffer is allocated in Create, and an allocation
// that fails there is a ResourceExhausted naming the part. Forward allocates nothing on the
// device; it splits a batch into passes of at most max_step_tokens rows and max_batch chunks
// (a longer chunk is split into consecutive pieces), and splits one MoE layer's rows further
// when the slot pool cannot hold the experts of all of them at once, so results never depend on
// the cache's size or state: the same kernels run whatever the cache holds.
//
// deterministic: every row's results are independent of the rest of the batch (per-row GEMMs,
// attention per sequence, routed experts per route); slower.
//
// Ownership: borrows the weights and the ExpertStore (both must outlive it); owns every device
// allocation, the streams, cuBLAS handle and cache state. Not thread-safe: one caller at a time.
// Plain C++ header: no CUDA includes. Without CUDA or a device, Create returns Unavailable.
#ifndef MOE_ENGINE_CUDA_GPU_MODEL_H_
#define MOE_ENGINE_CUDA_GPU_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/forward_model.h"
#include "engine/gpu_memory_plan.h"
#include "engine/model_weights.h"
#include "engine/routing_override.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/hybrid_split.h"
#include "moe_cache/policy_core.h"

namespace moe::engine::gpu {

struct GpuModelOptions {
  int max_batch = 8;         // chunks (sequences) of one pass
  int max_step_tokens = 0;   // rows of one pass; 0: max(max_batch, 256)
  int max_context = 0;       // positions per sequence; 0: min(max_position_embeddings, 4096)
  int kv_block_size = 16;    // a power of two, 16 to 1024
  int kv_blocks = 0;         // 0: the memory plan's (max_batch sequences of max_context)
  double expert_budget_gib = 0;  // GPU expert slots; 0: automatic (what the plan leaves)
  int32_t cache_policy = moe_cache::kPolicyScored;
  // Pin the hottest experts (moe_cache's HotPinner over the routes seen), re-chosen every
  // adapt_every forwards; pinned experts are never evicted. Needs cache_policy kPolicyScored.
  bool pin_hot_experts = false;
  int adapt_every = 16;
  bool deterministic = false;
  // Capture each all-decode pass of up to max_batch sequences as a CUDA graph per batch bucket
  // (1, 2, 4, ...: the batch is padded to its bucket) and replay it; false: eager launches.
  bool graphs = true;
  // Prefill expert streaming: a pass of at least prefill_stream_min_rows rows (0: 4 x experts /
  // top_k, where nearly every expert of a layer is routed to) does not go through the cache;
  // each MoE layer's experts are copied whole from host memory into one of two layer buffers
  // on the side stream, two layers ahead of the compute that reads them, so the copy overlaps
  // compute and the decode cache keeps its experts. Costs two layers of experts of GPU memory
  // (planned as scratch; left off when that does not fit or every expert is resident).
  bool prefill_stream = true;
  int prefill_stream_min_rows = 0;
  // The miss copy on the side stream beside the shared expert (moe_overlap); the environment
  // switch MOE_DECODE_SHARED_OVERLAP=0|1 overrides it.
  bool overlap = true;
  // Print the memory plan's Summary to stderr in Create.
  bool print_plan = true;
  // Hybrid experts: in passes of at most hybrid_max_rows rows, each ensure call leaves the
  // share of its misses that hybrid_profile gives the CPU (moe_cache's FetchTable: the link and
  // the CPU finish together) to cpu_moe, which computes them straight from the store's pinned
  // memory while the GPU fetches and computes the rest; those experts take no slot. The handoff
  // runs inside the step, and its graph, through mapped host memory (engine/cuda/hybrid): no
  // host round trip per layer. Larger passes (prefill) fetch every miss.
  // hybrid_auto: each decode batch bucket tries hybrid and offload for its first 8 passes
  // (alternating) and keeps the faster by median pass time; other passes fetch every miss.
  // A profile with no host-link figure is measured on the model's own experts in Create.
  bool hybrid = false;
  bool hybrid_auto = false;
  moe_cache::BandwidthProfile hybrid_profile;
  int hybrid_max_rows = 64;
  int hybrid_threads = 0;  // CPU threads computing misses (the polling one included); 0: all
                           // hardware threads but one
};

// Counters since Create (or ResetStats), read back after each Forward.
struct GpuCacheStats {
  int64_t rows = 0;       // token rows forwarded
  int64_t routes = 0;     // routed (layer, token, expert) triples, padding excluded
  int64_t misses = 0;     // experts copied from host memory into a slot
  // Distinct experts per MoE layer and pass, summed: the expert weights read from GPU memory
  // (each distinct expert of a layer once per pass).
  int64_t distinct_experts = 0;
  int64_t ensure_calls = 0;
  uint64_t bytes_fetched = 0;  // misses x the store's payload bytes per expert
  int64_t passes = 0;
  int64_t graph_replays = 0;   // passes replayed from a captured decode graph
  int64_t graph_captures = 0;  // decode buckets captured (each once unless routing changes)
  int64_t pin_changes = 0;     // pinned-expert flags changed by the pinned policy
  int64_t streamed_routes = 0;  // routes of streamed passes (in routes; never cache hits)
  int64_t streamed_layers = 0;  // MoE layers of prefill passes streamed whole (their bytes are
                                // in bytes_fetched, not in misses)
  // Hybrid mode: experts computed on the CPU (distinct per ensure call, summed; never in
  // misses), their routes, the bytes the CPU read for them, and the CPU worker's busy time.
  int64_t cpu_experts = 0;
  int64_t cpu_routes = 0;
  uint64_t bytes_cpu = 0;
  double cpu_seconds = 0;
  int64_t handoffs = 0;  // requests the CPU worker answered
};

class GpuModel final : public ForwardModel {
 public:
  // `weights` holds dense weights (bf16 or f32: uploaded as bf16) and the config; `store` every
  // routed expert (bf16, q4_0, fp8_block or nvfp4, the loader's layout), pinned and mapped.
  // InvalidArgument for shapes or formats the kernels do not serve; FailedPrecondition for a store
  // that is not pinned; ResourceExhausted (naming the part) when the plan or an allocation does not
  // fit; Unavailable without CUDA or a device.
  static absl::StatusOr<std::unique_ptr<GpuModel>> Create(const ModelWeights* weights,
                                                          const moe_cache::ExpertStore* store,
                                                          const GpuModelOptions& options);
  ~GpuModel() override;
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  absl::Status Forward(absl::Span<const ModelChunk> chunks, std::vector<float>* logits) override;
  const ModelConfig& config() const override;
  int max_positions() const override;
  int kv_blocks() const override;
  int kv_block_size() const override;
  // qwen3_5_moe: one Gated DeltaNet state slot per sequence of max_batch (the memory plan's);
  // 0 for models without linear-attention layers.
  int state_slots() const override;
  uint64_t memory_bytes() const override;
  std::string backend() const override { return "cuda"; }
  void set_routing_override(RoutingOverride* routing) override;

  const GpuMemoryPlan& plan() const;
  const GpuCacheStats& stats() const;
  void ResetStats();
  // Slots in the pool (all MoE layers share it).
  int total_slots() const;
  // Largest decode bucket (batch sizes 1, 2, 4, ... up to it are padded and run as one shape,
  // captured as a graph when options.graphs).
  int max_bucket() const;
  // Decode buckets replayed from graphs (true) or launched eagerly; the same kernels and shapes
  // either way. Starts as options.graphs.
  void set_graphs(bool on);
  bool graphs() const;
  // Empties the expert cache (every slot free, pinned flags cleared) in place, between
  // forwards: for benchmarks that compare modes from the same cold start.
  absl::Status ResetExpertCache();
  // Rows from which a pass streams its experts (0: streaming off).
  int prefill_stream_min_rows() const;
  // Experts fetched by each ensure call (one per MoE layer for decode) of the last pass: for
  // benchmarks that compute a floor from each layer's misses.
  const std::vector<int32_t>& last_pass_fetches() const;
  // The bandwidth profile the hybrid split runs on (given or measured at start); zeros when
  // hybrid experts are off.
  moe_cache::BandwidthProfile hybrid_profile() const;

  // Benchmarks: fills the whole KV cache (bf16 in [-1, 1)) and every linear-attention state (f32
  // in [-0.05, 0.05)) with pseudo-random values of `seed`, so decode can start at any position
  // of a sequence without a prefill (chunks that start past 0 continue from these values).
  absl::Status FillSyntheticContext(uint64_t seed);

  // Test hook: the capture of the decode bucket after `captures` more successful ones fails as
  // an out-of-memory of cudaGraphInstantiate would (ResourceExhausted, the pass not run); -1
  // turns it off. Graph instantiation is the engine's only device allocation after Create.
  void InjectGraphOutOfMemory(int captures);

  struct Impl;

 private:
  explicit GpuModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// An ExpertStore in the loader's layout (ExpertBankLayout), every bank of the format, filled
// from cpu_moe banks of one format (bf16 or fp8_block row-major, q4_0, mxfp4 or nvfp4 panels;
// experts contiguous; nvfp4 without up_global_scales gives up rows the gate's global scale), for
// models made in memory (tests, benchmarks). Store layer l, expert e is bank l % banks.size()'s
// expert e % its num_experts, so a few distinct experts can fill a full-size store; num_layers /
// num_experts 0: the banks'. Pinned and mapped where a device is visible.
absl::StatusOr<std::unique_ptr<moe_cache::ExpertStore>> ExpertStoreFromBanks(
    absl::Span<const cpu_moe::ExpertBank> banks, int num_layers = 0, int num_experts = 0);

// cpu_moe banks over `store`'s experts in `format` (the loader's layout: the 4-bit formats in
// panels, bf16 and fp8_block row-major), one per MoE layer, read in place: the CPU's share of
// hybrid experts. cpu_moe reads fp8 block scales dense; where the store pads their rows, dense
// copies are made into `dense_scales`, which must outlive the banks.
absl::StatusOr<std::vector<cpu_moe::ExpertBank>> CpuBanksFromStore(
    const moe_cache::ExpertStore& store, common::WeightFormat format, int num_layers,
    int num_experts, int hidden, int intermediate,
    std::vector<std::vector<uint8_t>>* dense_scales);

}  // namespace moe::engine::gpu

#endif  // MOE_ENGINE_CUDA_GPU_MODEL_H_
