// Helpers for the serving tests: a server binary run as a child process on free loopback ports,
// raw HTTP requests, and a server-sent-events reader that checks every chunk as it arrives.
// Not thread-safe unless a function says so.
#ifndef MOE_TESTS_SERVING_TEST_UTIL_H_
#define MOE_TESTS_SERVING_TEST_UTIL_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace moe::serving::testing {

// A server process. It gets `--port 0 --http_port 0` and reports the ports it bound on stdout,
// which a reader thread collects. The destructor kills it if it still runs.
class ServerProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const std::string& binary,
                                                              std::vector<std::string> args);
  ~ServerProcess();

  int grpc_port() const { return grpc_port_; }
  int http_port() const { return http_port_; }
  pid_t pid() const { return pid_; }
  std::string grpc_target() const;
  void Signal(int signal) const;
  // The exit code once it exited by itself, -1 on a timeout, 128+N when signal N killed it.
  int Wait(absl::Duration timeout);
  std::string Stdout() const;

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int grpc_port_ = 0;
  int http_port_ = 0;
  bool exited_ = false;
  int exit_code_ = 0;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string stdout_ ABSL_GUARDED_BY(mu_);
};

struct HttpResult {
  int status = 0;  // 0: no response (connection failed)
  std::string body;
  nlohmann::json json;  // the body parsed (discarded when it is not JSON)
};

// One request over a fresh connection. Thread-safe.
HttpResult HttpRequest(int port, const std::string& method, const std::string& path,
                       const std::string& body = "", const std::string& api_key = "");

// A streamed response: every `data:` event in arrival order.
struct SseResult {
  int status = 0;
  std::vector<nlohmann::json> chunks;  // parsed JSON events (without [DONE])
  bool done = false;                   // saw data: [DONE] as the last event
  std::vector<std::string> problems;   // anything malformed
  std::string body;                    // the raw body for non-200 answers
};

// POSTs `body` and reads the answer as server-sent events, parsing each complete event as soon
// as it arrives. `stop_after` > 0 closes the connection after that many chunks. Thread-safe.
SseResult HttpStream(int port, const std::string& path, const std::string& body,
                     const std::string& api_key = "", int stop_after = 0);

// The text a completion stream carried, concatenated over its chunks (choice 0; chat: content).
std::string StreamText(const SseResult& result);

// A path given on the test's command line ($(rootpath ...)), made absolute.
std::string Runfile(const std::string& rootpath);

}  // namespace moe::serving::testing

#endif  // MOE_TESTS_SERVING_TEST_UTIL_H_
