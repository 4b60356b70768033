#include "engine/engine_flags.h"

#include <cstdlib>

#include <cmath>
#include <deque>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/loader.h"
#include "moe_cache/policy_core.h"

ABSL_FLAG(std::string, model, "",
          "Hugging Face model folder (config.json, *.safetensors, tokenizer.json); empty: the "
          "embedded default model");
ABSL_FLAG(std::string, expert_format, "auto",
          "format of the routed experts in memory: auto (the checkpoint's own: nvfp4 for an "
          "NVFP4 checkpoint, fp8_block for an FP8 block-scaled one, bf16 for bf16/f16/f32; a "
          "quantized checkpoint is never widened), bf16, fp8_block, q4_0, nvfp4, mxfp4");
ABSL_FLAG(int, threads, 0, "worker threads; 0: physical cores");
ABSL_FLAG(int, max_batch, 64,
          "sequences per step (the GPU engine sizes its KV cache for max_batch sequences of "
          "max_context tokens)");
ABSL_FLAG(int, max_context, 0,
          "tokens per sequence (prompt + output); 0: min(max_position_embeddings, 4096)");
ABSL_FLAG(int, kv_blocks, 0, "KV cache blocks of 16 tokens; 0: sized from max_batch and context");
ABSL_FLAG(int, prefill_chunk, 256, "prompt tokens of one sequence per step");
ABSL_FLAG(bool, deterministic, false,
          "results of a sequence independent of the batch (fixed kernels; slower)");
ABSL_FLAG(std::string, backend, "cpu",
          "where the model runs: cpu, or cuda (dense layers, attention and the KV cache on the "
          "GPU, routed experts from a GPU slot cache fed from host memory)");
ABSL_FLAG(double, gpu_expert_budget_gb, 0,
          "GPU engine: GiB of GPU memory for the expert cache's slots (at least top_k slots per "
          "MoE layer, at most every expert); 0: automatic, what is left after dense weights, "
          "the KV cache for --max_context x --max_batch, scratch and a safety reserve. The CPU "
          "engine ignores it");
ABSL_FLAG(std::string, moe_cache_policy, "scored",
          "GPU engine: the expert cache's eviction policy: lru (least recently used), lfu "
          "(lowest decayed frequency), scored (largest expected time to next use), pinned "
          "(scored, plus the hottest experts pinned, re-chosen every --adapt_every steps). The "
          "CPU engine ignores it");
ABSL_FLAG(int, adapt_every, 16,
          "GPU engine with --moe_cache_policy pinned: decode steps between re-choosing the "
          "pinned hot experts. The CPU engine ignores it");
ABSL_FLAG(bool, cuda_graphs, true,
          "GPU engine: replay each decode step (batches of decode tokens only) as a CUDA graph "
          "captured once per batch bucket (1, 2, 4, ... up to --max_batch); false: eager "
          "launches. The CPU engine ignores it");

ABSL_FLAG(std::string, moe_mode, "offload",
          "GPU engine: where expert misses are computed: offload (every miss fetched over the "
          "host link into the GPU cache), hybrid (each layer's misses split between the link and "
          "the CPU by the bandwidth profile, the CPU's computed from host memory and handed off "
          "inside the decode step), auto (each decode batch size tries both and keeps the "
          "faster). The CPU engine ignores it");
ABSL_FLAG(std::string, bandwidth_profile, "",
          "GPU engine, --moe_mode hybrid or auto: the bandwidth profile of the host link and the "
          "CPU experts (as //tools:bandwidth_probe writes it); read when it exists, else "
          "measured at start (a few seconds) and written there. Default: "
          "~/.cache/moe-offload/bandwidth_profile.txt");

namespace moe::engine {

absl::StatusOr<ModelEngineOptions> ModelEngineOptionsFromFlags() {
  ModelEngineOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.expert_format = absl::GetFlag(FLAGS_expert_format);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.max_context = absl::GetFlag(FLAGS_max_context);
  options.kv_blocks = absl::GetFlag(FLAGS_kv_blocks);
  options.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.deterministic = absl::GetFlag(FLAGS_deterministic);
  auto bad = [](const char* flag, int value, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", want));
  };
  if (options.threads < 0) return bad("threads", options.threads, "must be >= 0");
  if (options.max_batch < 1) return bad("max_batch", options.max_batch, "must be >= 1");
  if (options.max_context < 0) return bad("max_context", options.max_context, "must be >= 0");
  if (options.kv_blocks < 0) return bad("kv_blocks", options.kv_blocks, "must be >= 0");
  if (options.prefill_chunk < 1) {
    return bad("prefill_chunk", options.prefill_chunk, "must be >= 1");
  }
  if (absl::Status s = ParseExpertFormat(options.expert_format).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--expert_format: ", s.message()));
  }
  ASSIGN_OR_RETURN(options.gpu, GpuEngineOptionsFromFlags());
  options.backend = absl::GetFlag(FLAGS_backend);
  if (options.backend != "cpu" && options.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", options.backend, ": must be cpu or cuda"));
  }
  return options;
}

const std::vector<std::string>& MoeCachePolicyNames() {
  static const auto* names = new std::vector<std::string>{"lru", "lfu", "scored", "pinned"};
  return *names;
}

absl::StatusOr<GpuEngineOptions> GpuEngineOptionsFromFlags() {
  GpuEngineOptions o;
  o.expert_budget_gb = absl::GetFlag(FLAGS_gpu_expert_budget_gb);
  if (!std::isfinite(o.expert_budget_gb) || o.expert_budget_gb < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--gpu_expert_budget_gb=", o.expert_budget_gb,
                                                   ": must be >= 0 (0: automatic)"));
  }
  const std::string policy = absl::GetFlag(FLAGS_moe_cache_policy);
  if (policy == "lru") {
    o.cache_policy = moe_cache::kPolicyLru;
  } else if (policy == "lfu") {
    o.cache_policy = moe_cache::kPolicyLfu;
  } else if (policy == "scored" || policy == "pinned") {
    o.cache_policy = moe_cache::kPolicyScored;
    o.pin_hot_experts = policy == "pinned";
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--moe_cache_policy=", policy,
                                                   ": must be one of ",
                                                   absl::StrJoin(MoeCachePolicyNames(), ", ")));
  }
  o.adapt_every = absl::GetFlag(FLAGS_adapt_every);
  if (o.adapt_every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--adapt_every=", o.adapt_every, ": must be >= 1"));
  }
  o.graphs = absl::GetFlag(FLAGS_cuda_graphs);
  const std::string mode = absl::GetFlag(FLAGS_moe_mode);
  if (mode == "offload") {
    o.moe_mode = GpuEngineOptions::MoeMode::kOffload;
  } else if (mode == "hybrid") {
    o.moe_mode = GpuEngineOptions::MoeMode::kHybrid;
  } else if (mode == "auto") {
    o.moe_mode = GpuEngineOptions::MoeMode::kAuto;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_mode=", mode, ": must be one of offload, hybrid, auto"));
  }
  o.bandwidth_profile = absl::GetFlag(FLAGS_bandwidth_profile);
  if (o.bandwidth_profile.empty()) {
    const char* home = std::getenv("HOME");
    o.bandwidth_profile =
        absl::StrCat(home != nullptr ? home : ".", "/.cache/moe-offload/bandwidth_profile.txt");
  }
  return o;
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const char* usage) {
  // Rewritten arguments must outlive the parse and the flags' use of argv: keep them for the
  // life of the process.
  static auto* storage = new std::deque<std::string>();
  std::vector<char*> args;
  args.reserve(argc);
  bool after_dashdash = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && !after_dashdash && arg == "--") after_dashdash = true;
    if (i > 0 && !after_dashdash && arg.size() > 2 && arg[0] == '-') {
      size_t start = arg[1] == '-' ? 2 : 1;
      size_t end = arg.find('=');
      if (end == std::string::npos) end = arg.size();
      for (size_t j = start; j < end; ++j) {
        if (arg[j] == '-') arg[j] = '_';
      }
    }
    storage->push_back(std::move(arg));
  }
  for (std::string& s : *storage) args.push_back(s.data());
  absl::SetProgramUsageMessage(usage);
  return absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
}

}  // namespace moe::engine
