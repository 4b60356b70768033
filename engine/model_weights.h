// ModelWeights: everything a forward pass reads, as LoadModel (loader.h) leaves it: dense
// weights as owned row-major tensors (bf16, or f32 where asked), norms and biases in f32, and
// every routed expert of every MoE layer in one moe_cache::ExpertStore in the chosen expert
// format, laid out so that one MoE layer's experts form a cpu_moe::ExpertBank in place (through
// the store's common::ExpertLayerView).
//
// Ownership: ModelWeights owns all of it (tensors and store). Banks from ExpertBankFor() point
// into the store and live as long as the ModelWeights. Read-only after loading, so concurrent
// readers need no locks.
#ifndef MOE_ENGINE_MODEL_WEIGHTS_H_
#define MOE_ENGINE_MODEL_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/model_config.h"
#include "moe_cache/gpu/expert_store.h"

namespace moe::engine {

enum class DType { kF32, kBf16 };

// A dense row-major [rows, cols] matrix (vectors: rows = 1) that owns its bytes.
struct Tensor {
  DType dtype = DType::kBf16;
  int64_t rows = 0, cols = 0;
  common::AlignedBuffer<uint8_t> data;

  // Element pointers; valid only for the matching dtype (nullptr otherwise).
  const float* f32() const;
  const uint16_t* bf16() const;
  float* mutable_f32();
  uint16_t* mutable_bf16();
  bool empty() const { return rows == 0 || cols == 0; }
  int64_t numel() const { return rows * cols; }
  // Element (r, c) as float, whatever the dtype (for tests and references; not a hot path).
  float At(int64_t r, int64_t c) const;
};

// RMSNorm weights are held as the multipliers the norm applies: a zero-centred checkpoint
// weight w (ModelConfig::zero_centered_norms) is held as 1 + w.
struct LayerWeights {
  Tensor input_layernorm, post_attention_layernorm;  // f32 [1, H]
  // Full-attention layers. q_proj is [nh * head_dim, H], or with attn_output_gate
  // [nh * 2 * head_dim, H]: per head its head_dim query rows, then its head_dim gate rows.
  Tensor q_proj, k_proj, v_proj, o_proj;  // [out, in]
  Tensor q_bias, k_bias, v_bias;          // f32 [1, out]; empty unless attention_bias
  Tensor q_norm, k_norm;                  // f32 [1, head_dim]; empty unless qk_norm
  // Gated DeltaNet (linear-attention layers; LinearAttentionConfig gives the sizes).
  Tensor in_proj_qkv;           // [conv_dim, H]: rows q (key_dim), k (key_dim), v (value_dim)
  Tensor in_proj_z;             // [value_dim, H]: the output gate of the gated norm
  Tensor in_proj_b, in_proj_a;  // [num_value_heads, H]: beta and the decay's input
  Tensor conv1d;                // f32 [conv_kernel, conv_dim]: tap-major, the transpose of
                                // the checkpoint's [conv_dim, 1, conv_kernel]
  Tensor dt_bias, a_log;        // f32 [1, num_value_heads]
  Tensor linear_norm;           // f32 [1, value_head_dim]: the gated RMSNorm's weight (plain)
  Tensor out_proj;              // [H, value_dim]
  bool is_moe = false;
  int moe_index = -1;  // index into the ExpertStore's layers (-1 for dense layers)
  Tensor router;       // [E, H] (mlp.gate.weight)
  Tensor shared_gate_proj, shared_up_proj, shared_down_proj;  // empty without a shared expert
  Tensor shared_expert_gate;                                  // [1, H]
  Tensor mlp_gate_proj, mlp_up_proj, mlp_down_proj;           // dense (non-MoE) layers only
};

struct ModelWeights {
  ModelConfig config;
  Tensor embed_tokens;  // [V, H]
  Tensor final_norm;    // f32 [1, H]
  Tensor lm_head;       // [V, H]; empty when tied (use embed_tokens)
  std::vector<LayerWeights> layers;
  common::WeightFormat expert_format = common::WeightFormat::kBf16;
  // Every routed expert of every MoE layer; store layer index = LayerWeights::moe_index.
  // Banks: bf16 "gate_up", "down"; fp8_block adds "gate_up_scales", "down_scales"; q4_0, mxfp4
  // and nvfp4 hold panels (cpu_moe::Layout::kPanels, scales inside) in "gate_up", "down", and
  // nvfp4 adds "gate_up_global_scale" (the gate rows'), "up_global_scale" (the up rows') and
  // "down_global_scale" (one float per expert each).
  std::unique_ptr<moe_cache::ExpertStore> experts;
  // fp8_block only, and only for shapes whose per-expert scale rows are not whole 16-byte rows
  // (the store pads them; real Qwen shapes never need this): per MoE layer, the experts' block
  // scales contiguous ([E, ceil(2I/128), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)] floats),
  // which ExpertBankFor hands to cpu_moe instead of the store's padded rows.
  std::vector<std::vector<float>> gate_up_scales, down_scales;

  // The cpu_moe bank of MoE layer `moe_index`: the store's view of that layer
  // (ExpertStore::LayerView) read in place by cpu_moe::BankFromView, no copy: gate_up rows are
  // [gate; up] stacked ([2*I, H]), down [H, I]; panels for the 4-bit formats. moe_index must be
  // in [0, experts->num_layers()).
  cpu_moe::ExpertBank ExpertBankFor(int moe_index) const;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_MODEL_WEIGHTS_H_
