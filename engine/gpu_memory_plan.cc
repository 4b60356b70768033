#include "engine/gpu_memory_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"

namespace moe::engine {
namespace {

constexpr uint64_t kBf16 = 2;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

uint64_t U(int64_t v) { return static_cast<uint64_t>(v); }

// Free bytes after `used`, 0 when used exceeds free.
uint64_t After(uint64_t free, uint64_t used) { return free > used ? free - used : 0; }

// f32 values one row of a forward holds at once at most: residual, normed input and layer
// output; q, k, v and attention output; router logits, route ids and weights; per routed expert
// its gate/up and down outputs; the shared expert's; a dense MLP's; the logits.
uint64_t ActivationBytesPerRow(const ModelConfig& c) {
  const int64_t H = c.hidden_size, q = int64_t{c.num_attention_heads} * c.head_dim,
                kv = int64_t{c.num_key_value_heads} * c.head_dim, k = c.num_experts_per_tok;
  int64_t floats = 3 * H + 2 * q + 2 * kv;
  if (c.attn_output_gate) floats += 2 * q;  // the gated q projection and the gate
  if (c.NumLinearAttentionLayers() > 0) {
    // The DeltaNet's projections (qkv, z, b, a), conv output, g and beta, core output.
    const LinearAttentionConfig& la = c.linear;
    floats += 2 * int64_t{la.conv_dim()} + 2 * int64_t{la.value_dim()} +
              4 * int64_t{la.num_value_heads};
  }
  if (c.NumMoeLayers() > 0) {
    floats += c.num_experts + 2 * k + k * (2 * int64_t{c.moe_intermediate_size} + H);
    floats += 2 * int64_t{c.shared_expert_intermediate_size} + 1;
  }
  if (c.NumMoeLayers() < c.num_hidden_layers) floats += 2 * int64_t{c.intermediate_size};
  floats += c.vocab_size;
  return U(floats) * 4;
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  const double g = static_cast<double>(bytes) / kGiB;
  if (g >= 10) return absl::StrFormat("%.1f GiB", g);
  if (g >= 1) return absl::StrFormat("%.2f GiB", g);
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

DenseWeightBytes DenseWeightBytesOf(const ModelConfig& c) {
  DenseWeightBytes d;
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim,
                q = int64_t{c.num_attention_heads} * hd, kv = int64_t{c.num_key_value_heads} * hd;
  d.embeddings = U(V * H) * kBf16;
  d.lm_head = c.tie_word_embeddings ? 0 : U(V * H) * kBf16;
  d.norms = U(H) * kBf16;  // final norm
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    if (c.IsLinearAttentionLayer(layer)) {
      const LinearAttentionConfig& la = c.linear;
      const int64_t proj = (int64_t{la.conv_dim()} + la.value_dim() + 2 * la.num_value_heads) * H +
                           H * int64_t{la.value_dim()};
      d.attention += U(proj) * kBf16;
      // f32: conv taps, dt_bias, A_log, the gated norm's weight.
      d.attention += U(int64_t{la.conv_kernel} * la.conv_dim() + 2 * la.num_value_heads +
                       la.value_head_dim) * 4;
    } else {
      int64_t attention = (c.attn_output_gate ? 2 : 1) * q * H + 2 * kv * H + H * q;
      if (c.attention_bias) attention += q + 2 * kv;
      if (c.qk_norm) attention += 2 * hd;
      d.attention += U(attention) * kBf16;
    }
    d.norms += U(2 * H) * kBf16;
    if (c.IsMoeLayer(layer)) {
      d.router += U(int64_t{c.num_experts} * H) * kBf16;
      if (c.shared_expert_intermediate_size > 0) {
        d.shared_expert += U(3 * H * c.shared_expert_intermediate_size + H) * kBf16;
      }
    } else {
      d.dense_mlp += U(3 * H * c.intermediate_size) * kBf16;
    }
  }
  return d;
}

double GpuMemoryPlan::resident_fraction() const {
  return experts_per_layer == 0 ? 0.0 : static_cast<double>(slots_per_layer) / experts_per_layer;
}

std::string GpuMemoryPlan::Summary() const {
  std::string s = absl::StrCat(
      "GPU memory plan for ", FormatBytes(free_bytes), " free: dense weights ",
      FormatBytes(dense.total()), " in bf16 (embeddings ", FormatBytes(dense.embeddings),
      dense.lm_head == 0 ? ", tied LM head"
                         : absl::StrCat(", LM head ", FormatBytes(dense.lm_head)),
      ", attention ", FormatBytes(dense.attention), ", router ", FormatBytes(dense.router));
  if (dense.shared_expert > 0)
    absl::StrAppend(&s, ", shared experts ", FormatBytes(dense.shared_expert));
  if (dense.dense_mlp > 0) absl::StrAppend(&s, ", dense MLPs ", FormatBytes(dense.dense_mlp));
  absl::StrAppend(&s, "); KV cache ", FormatBytes(kv_bytes), ", ", kv_blocks, " blocks of ",
                  kv_block_size, " tokens (--max-context ", max_context, " x --max-batch ",
                  max_batch, ")",
                  linear_state_bytes > 0
                      ? absl::StrCat("; linear-attention states ", FormatBytes(linear_state_bytes),
                                     " (", state_slots, " sequences of ",
                                     FormatBytes(state_bytes_per_sequence), ")")
                      : std::string(),
                  "; scratch ", FormatBytes(scratch_bytes()), " (workspace ",
                  FormatBytes(workspace_bytes), ", activations of ", max_step_tokens, " tokens ",
                  FormatBytes(activation_bytes),
                  prefill_stream_bytes > 0
                      ? absl::StrCat(", prefill expert stream ", FormatBytes(prefill_stream_bytes))
                      : std::string(),
                  ")");
  if (moe_layers > 0) {
    absl::StrAppend(&s, "; expert cache ", slots_per_layer, " slots per MoE layer x ", moe_layers,
                    " layers = ", total_slots(), " slots of ", FormatBytes(slot_bytes), " (",
                    std::string(common::WeightFormatName(expert_format)),
                    ") = ", FormatBytes(expert_bytes),
                    automatic_budget ? " (automatic budget)"
                                     : (budget_capped ? " (the budget holds every expert)" : ""),
                    ": ", absl::StrFormat("%.1f%%", 100.0 * resident_fraction()), " of the ",
                    moe_layers * experts_per_layer, " routed experts resident");
  }
  absl::StrAppend(&s, "; ", FormatBytes(left_bytes()), " left free (safety reserve ",
                  FormatBytes(safety_reserve_bytes), ").");
  return s;
}

absl::StatusOr<GpuMemoryPlan> PlanGpuMemory(const ModelConfig& c, const GpuMemoryRequest& r) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (r.max_batch < 1) return bad("--max-batch ", r.max_batch, ": must be >= 1");
  if (r.max_context < 0) return bad("--max-context ", r.max_context, ": must be >= 0");
  if (r.max_step_tokens < 0) return bad("max_step_tokens ", r.max_step_tokens, " must be >= 0");
  if (r.kv_block_size < 1 || r.kv_bytes_per_element < 1) {
    return bad("KV block size ", r.kv_block_size, " and bytes per element ", r.kv_bytes_per_element,
               " must be >= 1");
  }
  if (!std::isfinite(r.expert_budget_gib) || r.expert_budget_gib < 0) {
    return bad("--gpu-expert-budget-gb ", r.expert_budget_gib, ": must be >= 0 (0: automatic)");
  }
  if (r.gpu_free_bytes == 0) return bad("the GPU reports no free memory");
  GpuMemoryPlan p;
  p.free_bytes = r.gpu_free_bytes;
  p.max_batch = r.max_batch;
  p.max_context =
      r.max_context > 0
          ? r.max_context
          : std::min(c.max_position_embeddings > 0 ? c.max_position_embeddings : 4096, 4096);
  if (c.max_position_embeddings > 0 && p.max_context > c.max_position_embeddings) {
    return bad("--max-context ", p.max_context, " exceeds the model's ", c.max_position_embeddings,
               " positions");
  }
  p.max_step_tokens = r.max_step_tokens > 0 ? r.max_step_tokens : r.max_batch;
  p.safety_reserve_bytes = r.safety_reserve_bytes;
  p.expert_format = r.expert_format;
  const uint64_t free = r.gpu_free_bytes;

  // Dense weights.
  p.dense = DenseWeightBytesOf(c);
  const uint64_t dense = p.dense.total();
  if (dense + r.safety_reserve_bytes > free) {
    return absl::ResourceExhaustedError(
        absl::StrCat("dense weights need ", FormatBytes(dense), " in bf16, ",
                     FormatBytes(After(free, r.safety_reserve_bytes)), " of the GPU's ",
                     FormatBytes(free), " free are usable (", FormatBytes(r.safety_reserve_bytes),
                     " kept in reserve); this model needs a larger GPU"));
  }
  // Scratch.
  p.workspace_bytes = r.workspace_reserve_bytes;
  p.activation_bytes = ActivationBytesPerRow(c) * U(p.max_step_tokens);
  p.prefill_stream_bytes = r.prefill_stream_bytes;
  const uint64_t used_dense = dense + r.safety_reserve_bytes;
  if (used_dense + p.scratch_bytes() > free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "scratch for steps of ", p.max_step_tokens, " tokens needs ",
        FormatBytes(p.scratch_bytes()), ", ", FormatBytes(After(free, used_dense)),
        " free after dense weights and the safety reserve; lower --max-batch or --prefill-chunk"));
  }
  // KV cache.
  p.kv_block_size = r.kv_block_size;
  const int64_t per_seq = (int64_t{p.max_context} + r.kv_block_size - 1) / r.kv_block_size;
  const int64_t blocks = per_seq * r.max_batch;
  if (blocks > std::numeric_limits<int>::max())
    return bad("--max-context x --max-batch needs too many KV blocks");
  p.kv_blocks = static_cast<int>(blocks);
  p.kv_block_bytes = 2 * U(c.NumKvLayers()) * U(c.num_key_value_heads) * U(r.kv_block_size) *
                     U(c.head_dim) * U(r.kv_bytes_per_element);
  p.kv_bytes = U(blocks) * p.kv_block_bytes;
  const uint64_t used_scratch = used_dense + p.scratch_bytes();
  if (used_scratch + p.kv_bytes > free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache for --max-context ", p.max_context, " x --max-batch ", r.max_batch, " needs ",
        FormatBytes(p.kv_bytes), ", ", FormatBytes(After(free, used_scratch)),
        " free after dense weights, scratch and the safety reserve; lower --max-context or "
        "--max-batch"));
  }
  // Gated DeltaNet states.
  if (c.NumLinearAttentionLayers() > 0) {
    p.state_slots = r.max_batch;
    p.state_bytes_per_sequence = LinearAttentionState::BytesPerSequence(c);
    p.linear_state_bytes = U(p.state_slots) * p.state_bytes_per_sequence;
    const uint64_t used_kv = used_scratch + p.kv_bytes;
    if (used_kv + p.linear_state_bytes > free) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "linear-attention states of --max-batch ", r.max_batch, " sequences need ",
          FormatBytes(p.linear_state_bytes), ", ", FormatBytes(After(free, used_kv)),
          " free after dense weights, KV cache, scratch and the safety reserve; lower "
          "--max-batch"));
    }
  }
  // Expert slots.
  p.moe_layers = c.NumMoeLayers();
  p.experts_per_layer = p.moe_layers > 0 ? c.num_experts : 0;
  p.top_k = c.num_experts_per_tok;
  p.automatic_budget = r.expert_budget_gib == 0;
  if (p.moe_layers == 0) return p;
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout,
                   ExpertBankLayout(r.expert_format, c.hidden_size, c.moe_intermediate_size));
  p.slot_bytes = layout.padded_bytes_per_expert();
  const uint64_t row = U(p.moe_layers) * p.slot_bytes;  // one slot in every MoE layer
  const uint64_t available = After(free, used_scratch + p.kv_bytes + p.linear_state_bytes);
  const std::string fmt(common::WeightFormatName(r.expert_format));
  if (p.automatic_budget) {
    p.slots_per_layer = static_cast<int>(std::min<uint64_t>(U(c.num_experts), available / row));
    if (p.slots_per_layer < p.top_k) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "expert cache: top-", p.top_k, " routing needs at least ", p.top_k,
          " slots per MoE layer (", p.moe_layers, " layers x ", FormatBytes(p.slot_bytes), " per ",
          fmt, " expert = ", FormatBytes(U(p.top_k) * row), "), ", FormatBytes(available),
          " free after dense weights, KV cache, scratch and the safety reserve; lower "
          "--max-context or --max-batch, or use a smaller --expert-format"));
    }
  } else {
    const uint64_t budget = static_cast<uint64_t>(r.expert_budget_gib * kGiB);
    const uint64_t slots = budget / row;
    if (slots < U(p.top_k)) {
      return bad("--gpu-expert-budget-gb ", r.expert_budget_gib, " holds ", slots,
                 " expert slots per MoE layer (", p.moe_layers, " layers x ",
                 FormatBytes(p.slot_bytes), " per ", fmt, " expert); top-", p.top_k,
                 " routing needs at least ", p.top_k,
                 " per layer: ", FormatBytes(U(p.top_k) * row));
    }
    p.budget_capped = slots > U(c.num_experts);
    p.slots_per_layer = static_cast<int>(std::min<uint64_t>(slots, U(c.num_experts)));
    const uint64_t need = U(p.slots_per_layer) * row;
    if (need > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "--gpu-expert-budget-gb ", r.expert_budget_gib, " needs ", FormatBytes(need), " for ",
          p.slots_per_layer, " slots per MoE layer, ", FormatBytes(available),
          " free after dense weights, KV cache, scratch and the safety reserve; lower it or pass "
          "0 (automatic)"));
    }
  }
  p.expert_bytes = U(p.slots_per_layer) * row;
  return p;
}

}  // namespace moe::engine
