// Model: the forward pass of a qwen3_moe / qwen2_moe / qwen3_5_moe decoder on the CPU over a
// batch of sequence chunks of different lengths (prefill chunks and single decode tokens mixed):
// embeddings, per layer RMSNorm, then the token mixer:
//   - full attention: GQA attention with RoPE (over the first rotary_dim dimensions of each
//     head) over the paged KV cache, q/k RMSNorm (qwen3_moe, qwen3_5_moe), qkv bias
//     (qwen2_moe), the sigmoid output gate from q_proj (qwen3_5_moe);
//   - Gated DeltaNet (qwen3_5_moe's linear-attention layers, engine/gated_delta_net.h):
//     in_proj_qkv, the causal conv with SiLU, L2-normalised q and k, the gated delta rule over
//     the sequence's recurrent state (chunked for chunks of several tokens, token by token for
//     one), the gated RMSNorm with in_proj_z, out_proj; the conv inputs and the recurrent state
//     live in a LinearAttentionState slot per sequence;
// then either the MoE block (router softmax in f32, top-k, optional renormalisation, routed
// experts through the ExpertBackend, the sigmoid-gated shared expert where the model has one)
// or a dense MLP, and the final norm and LM head for the rows that want logits.
//
// Borrows the weights, the expert backend, the pool (none is owned; all must outlive it); owns
// its RoPE table, dense-layer primitives and scratch. Not thread-safe: one caller (the engine's
// Step thread) at a time.
#ifndef MOE_ENGINE_MODEL_H_
#define MOE_ENGINE_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "engine/dense.h"
#include "engine/expert_backend.h"
#include "engine/forward_model.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/model_weights.h"
#include "engine/rope.h"
#include "engine/routing_override.h"

namespace moe::engine {

class Model {
 public:
  // deterministic: every row's results independent of the rest of the batch (per-row GEMV).
  // max_positions bounds positions (RoPE table size).
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelWeights* weights,
                                                       ExpertBackend* experts,
                                                       common::ThreadPool* pool, bool deterministic,
                                                       int max_positions);

  // The chunk type every model shares (engine/forward_model.h).
  using Logits = ChunkLogits;
  using Chunk = ModelChunk;

  // Runs the chunks as one batch, writes their keys and values into `kv` (its layers are the
  // full-attention layers, ModelConfig::KvLayerIndex) and their linear-attention state into
  // `state` (each chunk's state_slot; required when the model has linear-attention layers), and
  // appends to `logits` one [vocab] row per wanted token, in chunk order. InvalidArgument for
  // token ids outside the vocabulary, positions past max_positions, or missing, out-of-range or
  // repeated state slots.
  absl::Status Forward(absl::Span<const Chunk> chunks, KvCache* kv, std::vector<float>* logits,
                       LinearAttentionState* state = nullptr);

  const ModelConfig& config() const { return w_.config; }
  int max_positions() const { return rope_->max_positions(); }

  // Benchmarks: every later Forward takes its routed expert ids from `routing` (one trace token
  // per row, rows in chunk order) instead of the router's top-k; the weights are the router's
  // probabilities at those ids (ForcedRouteWeights). Borrowed (must outlive its use); nullptr
  // restores the router's own choice. Forward fails (InvalidArgument) if its layers or k differ
  // from the model's.
  void set_routing_override(RoutingOverride* routing) { routing_ = routing; }

 private:
  Model(const ModelWeights* weights, ExpertBackend* experts, common::ThreadPool* pool,
        bool deterministic);
  absl::Status Mlp(const Tensor& gate, const Tensor& up, const Tensor& down, int rows,
                   const float* x, float* out);
  absl::Status MoeBlock(const LayerWeights& lw, int rows, const float* x, float* h);
  // The Gated DeltaNet of linear-attention layer `linear_layer` on xn_, added into h_.
  absl::Status LinearAttention(const LayerWeights& lw, absl::Span<const Chunk> chunks, int rows,
                               int linear_layer, LinearAttentionState* state);

  const ModelWeights& w_;
  ExpertBackend* experts_;
  common::ThreadPool* pool_;
  bool deterministic_;
  RoutingOverride* routing_ = nullptr;
  std::unique_ptr<RopeTable> rope_;
  DenseLinear dense_;
  // Scratch, grown as needed.
  std::vector<float> h_, xn_, q_, k_, v_, attn_, gate_, up_, mlp_out_, router_, route_w_, sgate_;
  std::vector<float> q_gated_, attn_gate_;                               // gated attention
  std::vector<float> qkv_, conv_, z_, lin_b_, lin_a_, g_, beta_, core_;  // Gated DeltaNet
  std::vector<std::vector<float>> delta_scratch_;                        // per pool worker
  std::vector<int> chunk_rows_;                                          // first row of each chunk
  std::vector<int32_t> route_ids_, positions_;
  std::vector<int32_t> forced_ids_;  // [moe_layers, rows, k] from routing_ for this Forward
  std::vector<const int32_t*> tables_;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_MODEL_H_
