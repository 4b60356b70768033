// Command-line flags shared by every binary that builds a ModelEngine (the server,
// tools/generate): --model, --expert_format, --threads, --max_batch, --max_context, --kv_blocks,
// --prefill_chunk, --deterministic. Dashed spellings (--expert-format) are accepted too:
// ParseCommandLine rewrites them before Abseil parses.
#ifndef MOE_ENGINE_ENGINE_FLAGS_H_
#define MOE_ENGINE_ENGINE_FLAGS_H_

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "engine/model_engine.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, expert_format);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(int, max_batch);
ABSL_DECLARE_FLAG(int, max_context);
ABSL_DECLARE_FLAG(int, kv_blocks);
ABSL_DECLARE_FLAG(int, prefill_chunk);
ABSL_DECLARE_FLAG(bool, deterministic);

namespace moe::engine {

// The options the flags above describe. InvalidArgument naming the flag for a bad value.
absl::StatusOr<ModelEngineOptions> ModelEngineOptionsFromFlags();

// absl::ParseCommandLine after rewriting "--flag-name" to "--flag_name" (the part before any
// '='; arguments after a bare "--" are left alone). Sets the usage message. Returns the
// positional arguments (argv[0] first). The returned pointers point into argv or into storage
// that lives until the process exits.
std::vector<char*> ParseCommandLine(int argc, char** argv, const char* usage);

}  // namespace moe::engine

#endif  // MOE_ENGINE_ENGINE_FLAGS_H_
