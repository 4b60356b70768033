// GPU memory plan: how the GPU engine splits the device's free memory between the dense weights
// (bf16: embeddings, LM head unless tied, attention, norms, router, shared expert, dense MLPs),
// the paged KV cache (bf16 K and V of the full-attention layers, enough blocks for max_batch
// sequences of max_context tokens), the Gated DeltaNet layers' recurrent states (f32, one slot
// per sequence of max_batch; a fixed size whatever the context), scratch (a workspace reserve plus f32 activations of the largest step) and the
// expert cache's slots (per MoE layer: at least top_k, at most every expert; bytes per slot from
// the same BankLayout the loader builds, engine/loader.h ExpertBankLayout). A safety reserve is
// never planned.
//
// The expert budget is either given (--gpu-expert-budget-gb, GiB) or automatic: what is left
// after everything else and the reserve. Anything that does not fit is an error that names it
// and says by how much.
//
// A pure function of its inputs (no CUDA): the caller passes cudaMemGetInfo's free bytes.
#ifndef MOE_ENGINE_GPU_MEMORY_PLAN_H_
#define MOE_ENGINE_GPU_MEMORY_PLAN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/formats.h"
#include "engine/model_config.h"

namespace moe::engine {

struct GpuMemoryRequest {
  common::WeightFormat expert_format = common::WeightFormat::kBf16;
  uint64_t gpu_free_bytes = 0;   // the device's free memory before the engine allocates
  double expert_budget_gib = 0;  // bytes for expert slots, in GiB; 0: automatic
  // Tokens per sequence; 0: min(max_position_embeddings, 4096), as the CPU engine.
  int max_context = 0;
  int max_batch = 0;  // sequences per step
  int max_step_tokens =
      0;  // rows of the largest forward (decode batch, prefill chunk); 0: max_batch
  int kv_block_size = 16;        // tokens per KV block
  int kv_bytes_per_element = 2;  // bf16 keys and values
  // cuBLAS workspaces, graph memory, attention partials: a fixed reserve inside scratch.
  uint64_t workspace_reserve_bytes = uint64_t{512} << 20;
  // Left free: allocator slack and the CUDA context's own growth.
  uint64_t safety_reserve_bytes = uint64_t{1} << 30;
  // Prefill streaming's double buffer (two MoE layers' experts), inside scratch; 0: none.
  uint64_t prefill_stream_bytes = 0;
};

// Dense weights on the GPU, in bytes (bf16).
struct DenseWeightBytes {
  uint64_t embeddings = 0;
  uint64_t lm_head = 0;    // 0 when tied to the embeddings (counted once)
  uint64_t attention = 0;  // q (with its output gate), k, v, o projections, their biases, q/k
                           // norms; a Gated DeltaNet layer's projections, conv and norm
  uint64_t norms = 0;      // per-layer and final RMSNorm weights
  uint64_t router = 0;
  uint64_t shared_expert = 0;  // shared expert and its gate
  uint64_t dense_mlp = 0;      // non-MoE layers' MLPs
  uint64_t total() const {
    return embeddings + lm_head + attention + norms + router + shared_expert + dense_mlp;
  }
};

struct GpuMemoryPlan {
  uint64_t free_bytes = 0;
  DenseWeightBytes dense;
  int max_context = 0, max_batch = 0;
  int kv_block_size = 0;
  int kv_blocks = 0;            // max_batch * ceil(max_context / kv_block_size)
  uint64_t kv_block_bytes = 0;  // all layers, K and V
  uint64_t kv_bytes = 0;
  // Gated DeltaNet layers: one state slot per sequence of max_batch, linear_state_bytes in all.
  int state_slots = 0;
  uint64_t state_bytes_per_sequence = 0;
  uint64_t linear_state_bytes = 0;
  uint64_t workspace_bytes = 0;
  uint64_t activation_bytes = 0;  // f32 activations of max_step_tokens rows (an upper bound)
  uint64_t prefill_stream_bytes = 0;  // prefill streaming's double buffer
  int max_step_tokens = 0;
  int moe_layers = 0;
  int experts_per_layer = 0;
  int top_k = 0;
  int slots_per_layer = 0;
  uint64_t slot_bytes = 0;    // one expert, padded as in the ExpertStore
  uint64_t expert_bytes = 0;  // slots_per_layer * moe_layers * slot_bytes
  bool automatic_budget = false;
  bool budget_capped = false;  // the given budget held more than every expert
  uint64_t safety_reserve_bytes = 0;
  common::WeightFormat expert_format = common::WeightFormat::kBf16;

  uint64_t scratch_bytes() const {
    return workspace_bytes + activation_bytes + prefill_stream_bytes;
  }
  uint64_t planned_bytes() const {
    return dense.total() + kv_bytes + linear_state_bytes + scratch_bytes() + expert_bytes;
  }
  // Free memory the plan leaves unused (the safety reserve included).
  uint64_t left_bytes() const { return free_bytes - planned_bytes(); }
  int total_slots() const { return slots_per_layer * moe_layers; }
  // Share of the routed experts resident at once (slots_per_layer / experts_per_layer).
  double resident_fraction() const;
  // One paragraph: what went where, the slots, the KV blocks, the fraction of experts resident.
  std::string Summary() const;
};

// InvalidArgument for bad request values (max_batch < 1, a negative or non-finite budget, a
// context past max_position_embeddings, ...) and for a budget below top_k slots per MoE layer;
// ResourceExhausted, naming the part and the numbers, when dense weights, scratch, the KV cache
// or the expert slots do not fit in the free memory.
absl::StatusOr<GpuMemoryPlan> PlanGpuMemory(const ModelConfig& config,
                                            const GpuMemoryRequest& request);

// Dense weight bytes of `config` in bf16 (no allocation; the arithmetic of the shapes).
DenseWeightBytes DenseWeightBytesOf(const ModelConfig& config);

// "12.0 GiB", "3.25 GiB", "640.0 MiB": the unit the plan's messages use.
std::string FormatBytes(uint64_t bytes);

}  // namespace moe::engine

#endif  // MOE_ENGINE_GPU_MEMORY_PLAN_H_
