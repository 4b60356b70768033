// Command-line flags shared by every binary that builds a ModelEngine (the server,
// tools/generate): --model, --expert_format, --threads, --max_batch, --max_context, --kv_blocks,
// --prefill_chunk, --deterministic, --backend, and the GPU engine's --gpu_expert_budget_gb,
// --moe_cache_policy, --adapt_every (which the CPU engine validates and ignores). Dashed
// spellings (--expert-format) are accepted too: ParseCommandLine rewrites them before Abseil
// parses.
#ifndef MOE_ENGINE_ENGINE_FLAGS_H_
#define MOE_ENGINE_ENGINE_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "engine/model_engine.h"
#include "moe_cache/policy_core.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, expert_format);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(int, max_batch);
ABSL_DECLARE_FLAG(int, max_context);
ABSL_DECLARE_FLAG(int, kv_blocks);
ABSL_DECLARE_FLAG(int, prefill_chunk);
ABSL_DECLARE_FLAG(bool, deterministic);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(double, gpu_expert_budget_gb);
ABSL_DECLARE_FLAG(std::string, moe_cache_policy);
ABSL_DECLARE_FLAG(int, adapt_every);
ABSL_DECLARE_FLAG(bool, cuda_graphs);
ABSL_DECLARE_FLAG(std::string, moe_mode);
ABSL_DECLARE_FLAG(std::string, bandwidth_profile);

namespace moe::engine {

// The options the flags above describe. InvalidArgument naming the flag for a bad value,
// the GPU engine's flags included.
absl::StatusOr<ModelEngineOptions> ModelEngineOptionsFromFlags();

// The GPU engine's own options (GpuEngineOptions, engine/model_engine.h) come from
// --gpu_expert_budget_gb, --moe_cache_policy, --adapt_every, --cuda_graphs, --moe_mode and
// --bandwidth_profile.

// The cache policies --moe_cache_policy takes, in the order its help lists them.
const std::vector<std::string>& MoeCachePolicyNames();

// InvalidArgument naming the flag for a bad value.
absl::StatusOr<GpuEngineOptions> GpuEngineOptionsFromFlags();

// absl::ParseCommandLine after rewriting "--flag-name" to "--flag_name" (the part before any
// '='; arguments after a bare "--" are left alone). Sets the usage message. Returns the
// positional arguments (argv[0] first). The returned pointers point into argv or into storage
// that lives until the process exits.
std::vector<char*> ParseCommandLine(int argc, char** argv, const char* usage);

}  // namespace moe::engine

#endif  // MOE_ENGINE_ENGINE_FLAGS_H_
