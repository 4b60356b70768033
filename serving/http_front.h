// HttpFront: the OpenAI-compatible HTTP API and the chat page, on cpp-httplib, in the server's
// process: POST /v1/completions and /v1/chat/completions (whole JSON or server-sent events),
// GET /v1/models, POST /tokenize and /detokenize, GET /health, GET /metrics (Prometheus), GET /
// (the chat page). Request parsing lives in openai.h, scheduling in scheduler.h; this file only
// moves bytes between them.
//
// Every request but GET /health and GET / (a static page with no data; it asks for the key
// itself) needs `Authorization: Bearer <key>` when a key is set.
//
// Ownership: borrows the ServingContext; owns the httplib server and its thread pool (one thread
// per open connection: streams block their thread while they wait for tokens).
// Thread-safety: Start/Stop from one thread; handlers run on the pool's threads.
#ifndef MOE_SERVING_HTTP_FRONT_H_
#define MOE_SERVING_HTTP_FRONT_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "serving/context.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace moe::serving {

class HttpFront {
 public:
  // `threads`: connections served at once (more wait in the accept queue).
  HttpFront(const ServingContext* context, int threads);
  ~HttpFront();

  // Binds host:port (0 picks a free port) and starts serving on a thread of its own; returns
  // the bound port.
  absl::StatusOr<int> Start(const std::string& host, int port);
  // Stops accepting and closes connections; open streams see a failed write and end.
  void Stop();

 private:
  void Routes();

  const ServingContext* context_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

// The chat page (chat_page.html), built into the binary.
extern const char kChatPageHtml[];

}  // namespace moe::serving

#endif  // MOE_SERVING_HTTP_FRONT_H_
