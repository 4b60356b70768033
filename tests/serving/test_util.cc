#include "tests/serving/test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

extern char** environ;

namespace moe::serving::testing {

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(const std::string& binary,
                                                                    std::vector<std::string> args) {
  std::unique_ptr<ServerProcess> p(new ServerProcess());
  args.insert(args.begin(), {binary, "--host", "127.0.0.1", "--port", "0", "--http_port", "0"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  const int rc = posix_spawn(&p->pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return absl::InternalError(absl::StrCat("cannot start ", binary));
  }
  p->out_fd_ = fds[0];
  ServerProcess* raw = p.get();
  p->reader_ = std::thread([raw] {
    char buf[4096];
    ssize_t n;
    while ((n = read(raw->out_fd_, buf, sizeof(buf))) > 0) {
      absl::MutexLock lock(&raw->mu_);
      raw->stdout_.append(buf, static_cast<size_t>(n));
    }
  });
  // "  gRPC  127.0.0.1:PORT (...)" and "  HTTP  http://127.0.0.1:PORT/v1 ..." (server_cli.cc).
  auto port_after = [](const std::string& out, const std::string& marker) {
    size_t at = out.find(marker);
    if (at == std::string::npos) return 0;
    at += marker.size();
    size_t end = at;
    while (end < out.size() && isdigit(static_cast<unsigned char>(out[end]))) ++end;
    int port = 0;
    if (!absl::SimpleAtoi(out.substr(at, end - at), &port)) return 0;
    return port;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(40);
  while (absl::Now() < deadline) {
    const std::string out = p->Stdout();
    p->grpc_port_ = port_after(out, "gRPC  127.0.0.1:");
    p->http_port_ = port_after(out, "HTTP  http://127.0.0.1:");
    if (p->grpc_port_ > 0 && p->http_port_ > 0) return p;
    int status;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->exited_ = true;
      return absl::InternalError(absl::StrCat("the server exited at start: ", out));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("the server did not report its ports within 40 s");
}

ServerProcess::~ServerProcess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
  if (reader_.joinable()) reader_.join();
  if (out_fd_ >= 0) close(out_fd_);
}

std::string ServerProcess::grpc_target() const { return absl::StrCat("127.0.0.1:", grpc_port_); }

void ServerProcess::Signal(int signal) const { kill(pid_, signal); }

int ServerProcess::Wait(absl::Duration timeout) {
  if (exited_) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

std::string ServerProcess::Stdout() const {
  absl::MutexLock lock(&mu_);
  return stdout_;
}

HttpResult HttpRequest(int port, const std::string& method, const std::string& path,
                       const std::string& body, const std::string& api_key) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60, 0);
  httplib::Headers headers;
  if (!api_key.empty()) headers.emplace("Authorization", "Bearer " + api_key);
  httplib::Result r = method == "GET" ? cli.Get(path.c_str(), headers)
                                      : cli.Post(path.c_str(), headers, body, "application/json");
  HttpResult out;
  if (!r) return out;
  out.status = r->status;
  out.body = r->body;
  out.json = nlohmann::json::parse(out.body, nullptr, false);
  return out;
}

SseResult HttpStream(int port, const std::string& path, const std::string& body,
                     const std::string& api_key, int stop_after) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  if (!api_key.empty()) req.set_header("Authorization", "Bearer " + api_key);
  SseResult out;
  std::string buffer;
  int events = 0;
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    buffer.append(data, len);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (absl::StartsWith(event, ":")) continue;  // a comment (keep-alive)
      if (!absl::StartsWith(event, "data: ")) {
        out.problems.push_back("not a data event: " + event);
        continue;
      }
      if (out.done) out.problems.push_back("an event after [DONE]");
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        out.done = true;
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
      if (j.is_discarded()) {
        out.problems.push_back("not JSON: " + payload);
        continue;
      }
      out.chunks.push_back(std::move(j));
      if (stop_after > 0 && ++events >= stop_after) return false;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error;
  cli.send(req, res, error);
  out.status = res.status;
  if (res.status != 200) {
    out.body = res.body.empty() ? buffer : res.body;
    return out;
  }
  if (!buffer.empty() && stop_after == 0) out.problems.push_back("trailing bytes: " + buffer);
  return out;
}

std::string StreamText(const SseResult& result) {
  std::string text;
  for (const nlohmann::json& chunk : result.chunks) {
    if (!chunk.contains("choices")) continue;
    for (const nlohmann::json& c : chunk["choices"]) {
      if (c.value("index", 0) != 0) continue;
      if (c.contains("text") && c["text"].is_string()) text += c["text"].get<std::string>();
      if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string()) {
        text += c["delta"]["content"].get<std::string>();
      }
    }
  }
  return text;
}

std::string Runfile(const std::string& rootpath) {
  return std::filesystem::absolute(rootpath).string();
}

}  // namespace moe::serving::testing
