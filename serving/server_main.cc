// moe-offload's server: one MoE model over gRPC (moe.serving.v1, grpc.health.v1) and an
// OpenAI-compatible HTTP API with a chat page, from one process.
//
//   tools/bazel run //serving:server                      # the embedded model
//   tools/bazel run //serving:server -- --model /path/to/hf_folder --http-port 8080
//
// Flags: --help (server_cli.cc and engine/engine_flags.cc define them).
#include "engine/model_engine.h"
#include "serving/server_cli.h"

int main(int argc, char** argv) {
  return moe::serving::ServerMain(argc, argv, moe::engine::CreateModelEngine);
}
