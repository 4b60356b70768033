// Server: one engine served over gRPC (moe.serving.v1 + grpc.health.v1) and HTTP (OpenAI API and
// the chat page) from one process, with graceful shutdown.
//
// Ownership: owns the engine, the scheduler, the metrics and both fronts. Start/Shutdown are
// called from one thread (main); everything else runs on gRPC's, httplib's and the scheduler's
// threads.
#ifndef MOE_SERVING_SERVER_H_
#define MOE_SERVING_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"

namespace moe::serving {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int grpc_port = 50051;  // 0: a free port
  int http_port = 8000;   // 0: a free port; -1: no HTTP front
  std::string api_key;    // empty: no authentication
  int max_batch = 64;     // requests the engine runs at once (the engine's own limit)
  int max_queue = 256;    // requests waiting beyond those before 429 / RESOURCE_EXHAUSTED
  int max_n = 8;          // choices per HTTP request
  size_t max_body_bytes = 4 << 20;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(std::unique_ptr<engine::Engine> engine,
                                                       const ServerOptions& options);
  ~Server();  // Shutdown(0) unless already shut down

  int grpc_port() const;
  int http_port() const;  // -1 without HTTP
  const engine::Engine& engine() const;

  // Health goes NOT_SERVING and new calls are refused (UNAVAILABLE / 503); running requests get
  // up to `grace` to finish, the rest are cancelled (their clients see UNAVAILABLE / CANCELLED);
  // then both fronts stop. Returns how many requests had to be cancelled. Idempotent.
  int Shutdown(absl::Duration grace);

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::serving

#endif  // MOE_SERVING_SERVER_H_
