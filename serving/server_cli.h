// ServerMain: the server binary's main around an engine factory: parses the flags (the server's
// and engine/engine_flags.h's, dashed or not), builds the engine, serves until SIGTERM/SIGINT,
// drains for --grace_period and returns the exit code. //serving:server passes the model engine;
// tests pass a scripted one.
#ifndef MOE_SERVING_SERVER_CLI_H_
#define MOE_SERVING_SERVER_CLI_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/model_engine.h"

namespace moe::serving {

using EngineFactory = std::function<absl::StatusOr<std::unique_ptr<engine::Engine>>(
    const engine::ModelEngineOptions& options)>;

int ServerMain(int argc, char** argv, const EngineFactory& create_engine);

}  // namespace moe::serving

#endif  // MOE_SERVING_SERVER_CLI_H_
