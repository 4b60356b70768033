// The server's command line (flags, start-up message, signal handling, graceful shutdown) around
// any engine, so that test builds can serve a scripted engine through the same code.
#include <csignal>
#include <cstdio>
#include <pthread.h>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/engine_flags.h"
#include "engine/model_engine.h"
#include "serving/server_cli.h"
#include "serving/auth.h"
#include "serving/server.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "address both fronts listen on (0.0.0.0 for every interface; mind --api-key)");
ABSL_FLAG(int, port, 50051, "gRPC port (moe.serving.v1.Serving and grpc.health.v1); 0: a free one");
ABSL_FLAG(int, http_port, 8000,
          "HTTP port (OpenAI API, /metrics, /health, the chat page at /); 0: a free one; -1: off");
ABSL_FLAG(int, max_queue, 256,
          "requests admitted beyond --max_batch; more get HTTP 429 / RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_n, 8, "largest `n` (choices per request) accepted");
ABSL_FLAG(int64_t, max_body_bytes, 4 << 20, "largest HTTP body or gRPC message accepted");
ABSL_FLAG(std::string, api_key, "",
          "require `Authorization: Bearer KEY` on every HTTP request and gRPC call except health "
          "(the key is never logged)");
ABSL_FLAG(std::string, api_key_file, "", "read the API key from the first line of this file");
ABSL_FLAG(absl::Duration, grace_period, absl::Seconds(30),
          "on SIGTERM/SIGINT, how long running requests may take to finish before they are "
          "cancelled");

namespace moe::serving {
namespace {

constexpr char kUsage[] =
    "Serves a Mixture-of-Experts model over gRPC and an OpenAI-compatible HTTP API.\n"
    "\n"
    "  server [--model DIR] [--port 50051] [--http-port 8000] [--host 127.0.0.1]\n"
    "         [--max-batch 64] [--max-queue 256] [--max-context N] [--api-key KEY]\n"
    "\n"
    "Without --model it serves the embedded default model. Flags may be spelled with dashes or\n"
    "underscores. SIGTERM or SIGINT drains: health goes NOT_SERVING, new requests are refused,\n"
    "running ones get --grace-period to finish, then the process exits 0.";

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "server: %s\n", std::string(status.message()).c_str());
  return 1;
}

}  // namespace

int ServerMain(int argc, char** argv, const EngineFactory& create_engine) {
  // --help lists the server's and the engine's flags (Abseil's default shows only flags defined
  // in a file named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "serving/") || absl::StrContains(file, "engine/engine_flags") ||
           absl::StrContains(file, "tests/serving/");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  engine::ParseCommandLine(argc, argv, kUsage);
  // Signals are taken by sigwait below: block them before any thread starts so that no other
  // thread receives them. A closed client socket must not kill the process either.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::string> key =
      LoadApiKey(absl::GetFlag(FLAGS_api_key), absl::GetFlag(FLAGS_api_key_file));
  if (!key.ok()) return Fail(key.status());
  absl::StatusOr<engine::ModelEngineOptions> engine_options =
      engine::ModelEngineOptionsFromFlags();
  if (!engine_options.ok()) return Fail(engine_options.status());
  std::fprintf(stderr, "server: loading %s\n",
               engine_options->model_dir.empty() ? "the embedded default model"
                                                 : engine_options->model_dir.c_str());
  absl::StatusOr<std::unique_ptr<engine::Engine>> engine =
      create_engine(*engine_options);
  if (!engine.ok()) return Fail(engine.status());

  ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.grpc_port = absl::GetFlag(FLAGS_port);
  options.http_port = absl::GetFlag(FLAGS_http_port);
  options.api_key = *key;
  options.max_batch = engine_options->max_batch;
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.max_n = absl::GetFlag(FLAGS_max_n);
  if (absl::GetFlag(FLAGS_max_body_bytes) < 1024) {
    return Fail(absl::InvalidArgumentError("--max_body_bytes must be >= 1024"));
  }
  options.max_body_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_body_bytes));
  absl::StatusOr<std::unique_ptr<Server>> server =
      Server::Start(*std::move(engine), options);
  if (!server.ok()) return Fail(server.status());

  const engine::ModelInfo& info = (*server)->engine().model_info();
  std::printf("serving %s (%s, %d layers, %d experts in %s, context %d) on %s\n",
              info.name.c_str(), info.family.c_str(), info.num_layers, info.num_experts,
              info.expert_format.c_str(), info.max_context, options.host.c_str());
  std::printf("  gRPC  %s:%d (moe.serving.v1.Serving, grpc.health.v1.Health)\n",
              options.host.c_str(), (*server)->grpc_port());
  if ((*server)->http_port() >= 0) {
    const std::string base = absl::StrCat("http://", options.host, ":", (*server)->http_port());
    std::printf("  HTTP  %s/v1 (OpenAI API), %s/ (chat page), %s/metrics\n", base.c_str(),
                base.c_str(), base.c_str());
    std::printf("try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d "
                "'{\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
                "\"max_tokens\": 32}'\n",
                base.c_str(), key->empty() ? "" : " -H \"Authorization: Bearer $API_KEY\"");
  }
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  const absl::Duration grace = absl::GetFlag(FLAGS_grace_period);
  std::fprintf(stderr, "server: %s: draining (grace period %s)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", absl::FormatDuration(grace).c_str());
  const int cancelled = (*server)->Shutdown(grace);
  std::fprintf(stderr, "server: stopped (%d request(s) cancelled at the end of the grace period)\n",
               cancelled);
  return 0;
}

}  // namespace moe::serving
