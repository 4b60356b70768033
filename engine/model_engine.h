// ModelEngine: the Engine (engine.h) that runs a Hugging Face MoE checkpoint (qwen3_moe,
// qwen2_moe) through a ForwardModel (engine/forward_model.h): on the CPU (dense layers through
// oneDNN, attention over a paged KV cache, routed experts through cpu_moe) or on the GPU
// (options.backend "cuda", engine/cuda/gpu_model.h), with sampling per sequence with its own
// RNG, and continuous batching (chunked prefill, one decode token per running sequence per step,
// preemption of the newest sequence when the KV pool runs out).
//
// CreateModelEngine loads the model folder (weights, tokenizer, chat template) and returns an
// Engine that owns all of it. Thread safety is the Engine contract's: Submit, Cancel, HasWork,
// Stats and the accessors from any thread; Step from one thread at a time.
#ifndef MOE_ENGINE_MODEL_ENGINE_H_
#define MOE_ENGINE_MODEL_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cpu_moe/cpu_moe.h"
#include "engine/engine.h"
#include "engine/forward_model.h"
#include "engine/model_weights.h"
#include "moe_cache/policy_core.h"

namespace moe::engine {

// The CUDA backend's own options (with ModelEngineOptions' max_batch, max_context,
// kv_block_size, prefill_chunk and expert_format they make its GpuMemoryRequest,
// engine/gpu_memory_plan.h).
struct GpuEngineOptions {
  double expert_budget_gb = 0;  // GiB for expert slots; 0: automatic
  // Eviction policy: moe_cache::kPolicyLru, kPolicyLfu or kPolicyScored.
  int32_t cache_policy = moe_cache::kPolicyScored;
  // "pinned": the scored policy plus moe_cache::HotPinner re-choosing pinned hot experts every
  // adapt_every steps.
  bool pin_hot_experts = false;
  int adapt_every = 16;
  bool graphs = true;  // decode steps replayed as CUDA graphs per batch bucket
  // Where misses are computed: kOffload fetches every miss over the host link; kHybrid leaves
  // the CPU the share of each layer's misses the bandwidth profile gives it (computed by
  // cpu_moe from the store's pinned memory, handed off inside the step); kAuto tries both per
  // decode batch bucket and keeps the faster.
  enum class MoeMode { kOffload, kHybrid, kAuto };
  MoeMode moe_mode = MoeMode::kOffload;
  // The hybrid split's bandwidth profile (moe_cache/hybrid_split.h). Hybrid and auto read it
  // when the file exists; otherwise the engine measures one at start (a few seconds) and writes
  // it here. "": measure every start, write nothing.
  std::string bandwidth_profile;
};

struct ModelEngineOptions {
  // A Hugging Face model folder (config.json, *.safetensors, tokenizer.json,
  // tokenizer_config.json); "": the embedded default model (DefaultModelDir()).
  std::string model_dir;
  // Format the routed experts are held in: "auto" (the checkpoint's own: nvfp4 for an NVFP4
  // checkpoint, fp8_block for FP8 block-scaled, bf16 for bf16/f16/f32; LoadModel resolves it),
  // "bf16", "fp8_block", "q4_0", "nvfp4", "mxfp4". ModelInfo::expert_format reports the format
  // the experts are held in.
  std::string expert_format = "auto";
  int threads = 0;     // worker threads; 0: the machine's physical cores
  int max_batch = 64;  // sequences per step (prefilling and decoding together)
  // Tokens one sequence may hold (prompt + output); 0: min(max_position_embeddings, 4096).
  int max_context = 0;
  int kv_block_size = 16;  // tokens per KV block
  // Blocks in the KV pool; 0: enough for max_batch sequences of max_context, capped so that the
  // pool takes at most a quarter of the machine's memory.
  int kv_blocks = 0;
  int prefill_chunk = 256;  // prompt tokens of one sequence per step
  // Every sequence's results do not depend on what else is in the batch: per-row kernels with
  // a fixed summation order, no batch-size-dependent switch to AMX or oneDNN. Slower; the fast
  // mode differs from it only by rounding.
  bool deterministic = false;
  // Dense weights in f32 instead of bf16, and the routed experts' activations in f32 (cpu_moe's
  // bf16 dot product off): for comparisons with float references.
  bool dense_f32 = false;
  // Seed of the engine's own seed generator (requests without a seed draw from it).
  uint64_t seed = 0;
  // "cpu": everything on the CPU. "cuda": dense layers, attention and the KV cache on the GPU,
  // routed experts from a GPU slot cache fed from host memory (engine/cuda/gpu_model.h); the
  // GPU memory plan is printed to stderr at start.
  std::string backend = "cpu";
  GpuEngineOptions gpu;  // backend "cuda" only
  // Tests only (fault injection, engine/failing_forward_model.h): when set, the engine runs the
  // model this returns in place of the one it built for `backend`. The returned model owns the
  // one it is given and must keep its KV geometry. Unset: the built model runs as it is.
  std::function<std::unique_ptr<ForwardModel>(std::unique_ptr<ForwardModel>)> wrap_model;
};

// Loads the model and builds the engine. InvalidArgument for bad options, NotFound / the
// loader's errors for a bad model folder.
absl::StatusOr<std::unique_ptr<Engine>> CreateModelEngine(const ModelEngineOptions& options);

// An engine over a model already in memory (tests, benchmarks): `weights` and the memory behind
// `banks` (one cpu_moe bank per MoE layer) stay alive as long as `keepalive` does, which the
// engine holds; tokenizer and chat template may be null (then prompts must be ids and events
// carry no text). options.model_dir and expert_format are only reported ("auto" as the weights'
// own expert_format).
struct ModelEngineParts {
  std::shared_ptr<void> keepalive;
  const ModelWeights* weights = nullptr;
  std::vector<cpu_moe::ExpertBank> banks;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  std::shared_ptr<const tokenizer::ChatTemplate> chat_template;
  std::string name;
  // Routed experts' activations in f32 (cpu_moe's bf16 dot product off), for reference tests.
  bool f32_expert_activations = false;
};
absl::StatusOr<std::unique_ptr<Engine>> CreateModelEngineFromParts(
    ModelEngineParts parts, const ModelEngineOptions& options);

// The embedded default model's folder (models/tiny_qwen3_moe from the runfiles of the running
// binary or test, or $MOE_DEFAULT_MODEL_DIR when set); "" when it cannot be found.
std::string DefaultModelDir();

}  // namespace moe::engine

#endif  // MOE_ENGINE_MODEL_ENGINE_H_
