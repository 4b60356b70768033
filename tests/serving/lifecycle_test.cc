// Server lifecycles, each on a server process of its own (scripted engine): API keys on both
// fronts, the bounded queue (429 / RESOURCE_EXHAUSTED), graceful shutdown on SIGTERM with
// streams in flight (they finish, exit 0) and past the grace period (they end with a clear
// status, exit 0).
//
// Arguments: the scripted server binary, then Qwen3's tokenizer.json (its folder is the model).
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "serving/proto/serving.grpc.pb.h"
#include "tests/serving/health.grpc.pb.h"
#include "tests/serving/test_util.h"

namespace moe::serving::testing {
namespace {

std::string g_binary;
std::string g_model_dir;

std::unique_ptr<ServerProcess> StartServer(std::vector<std::string> extra) {
  std::vector<std::string> args = {"--model", g_model_dir};
  args.insert(args.end(), extra.begin(), extra.end());
  auto p = ServerProcess::Start(g_binary, args);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(const std::string& target) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return resp.status();
}

// Runs a Generate to its end; returns the status and the tokens received.
grpc::Status Generate(const std::string& target, int max_tokens, int* tokens,
                      const std::string& key = "", std::atomic<int>* started = nullptr) {
  auto stub = v1::Serving::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  v1::GenerateRequest req;
  req.set_text("tell me a story");
  req.mutable_sampling()->set_max_tokens(max_tokens);
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  *tokens = 0;
  bool first = true;
  while (reader->Read(&resp)) {
    *tokens += resp.token_ids_size();
    if (first && started != nullptr) ++*started;
    first = false;
  }
  return reader->Finish();
}

// Waits until the engine runs `n` sequences.
void WaitRunning(const std::string& target, int n) {
  auto stub = v1::Serving::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 500; ++i) {
    grpc::ClientContext ctx;
    v1::Stats stats;
    if (stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok() && stats.running() >= n) return;
    absl::SleepFor(absl::Milliseconds(5));
  }
  ADD_FAILURE() << "fewer than " << n << " sequences running";
}

TEST(LifecycleTest, ApiKeyOnBothFronts) {
  auto s = StartServer({"--api_key", "s3cret-key"});
  ASSERT_NE(s, nullptr);
  const int port = s->http_port();
  const std::string body = R"({"prompt": "hi", "max_tokens": 2})";
  EXPECT_EQ(HttpRequest(port, "POST", "/v1/completions", body).status, 401);
  EXPECT_EQ(HttpRequest(port, "POST", "/v1/completions", body, "wrong").status, 401);
  EXPECT_EQ(HttpRequest(port, "POST", "/v1/completions", body, "s3cret-ke").status, 401);
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics").status, 401);
  EXPECT_EQ(HttpRequest(port, "GET", "/v1/models").status, 401);
  HttpResult ok = HttpRequest(port, "POST", "/v1/completions", body, "s3cret-key");
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(HttpRequest(port, "GET", "/health").status, 200);
  HttpResult denied = HttpRequest(port, "POST", "/v1/completions", body, "wrong");
  EXPECT_EQ(denied.json["error"]["type"], "authentication_error");
  EXPECT_FALSE(absl::StrContains(denied.body, "s3cret"));

  int tokens = 0;
  EXPECT_EQ(Generate(s->grpc_target(), 3, &tokens).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Generate(s->grpc_target(), 3, &tokens, "wrong").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Generate(s->grpc_target(), 3, &tokens, "s3cret-key").ok());
  EXPECT_EQ(tokens, 3);
  EXPECT_EQ(Health(s->grpc_target()), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_FALSE(absl::StrContains(s->Stdout(), "s3cret"));

  // Without a key everything is open.
  auto open = StartServer({});
  ASSERT_NE(open, nullptr);
  EXPECT_EQ(HttpRequest(open->http_port(), "POST", "/v1/completions", body).status, 200);
  EXPECT_TRUE(Generate(open->grpc_target(), 2, &tokens).ok());
}

TEST(LifecycleTest, FullQueueAnswers429) {
  auto s = StartServer({"--max_batch", "1", "--max_queue", "1", "--step_ms", "5"});
  ASSERT_NE(s, nullptr);
  std::atomic<int> started{0};
  int t1 = 0, t2 = 0;
  grpc::Status st1, st2;
  std::thread a([&] { st1 = Generate(s->grpc_target(), 150, &t1, "", &started); });
  std::thread b([&] { st2 = Generate(s->grpc_target(), 150, &t2, "", &started); });
  while (started.load() < 1) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(50));  // both admitted: one running, one queued
  HttpResult r = HttpRequest(s->http_port(), "POST", "/v1/completions", R"({"prompt": "x"})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_EQ(r.json["error"]["type"], "rate_limit_error");
  int t3 = 0;
  EXPECT_EQ(Generate(s->grpc_target(), 2, &t3).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  a.join();
  b.join();
  EXPECT_TRUE(st1.ok() && st2.ok());
  EXPECT_EQ(t1, 150);
  EXPECT_EQ(t2, 150);
  EXPECT_EQ(HttpRequest(s->http_port(), "POST", "/v1/completions", R"({"prompt": "x"})").status, 200);
}

TEST(LifecycleTest, SigtermLetsRunningStreamsFinish) {
  auto s = StartServer({"--step_ms", "10", "--grace_period", "20s"});
  ASSERT_NE(s, nullptr);
  constexpr int kStreams = 4;
  std::atomic<int> started{0};
  std::vector<int> tokens(kStreams);
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] { status[i] = Generate(s->grpc_target(), 60, &tokens[i], "", &started); });
  }
  SseResult sse;
  std::thread http([&] {
    sse = HttpStream(s->http_port(), "/v1/completions",
                     R"({"prompt": "x", "max_tokens": 60, "stream": true})");
  });
  WaitRunning(s->grpc_target(), kStreams + 1);
  s->Signal(SIGTERM);
  // Draining: health says so and new work is refused, while the streams go on.
  for (int i = 0; i < 100 && Health(s->grpc_target()) ==
                                 grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Health(s->grpc_target()), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  int refused_tokens = 0;
  const grpc::Status refused = Generate(s->grpc_target(), 2, &refused_tokens);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  for (auto& t : threads) t.join();
  http.join();
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_TRUE(status[i].ok()) << status[i].error_message();
    EXPECT_EQ(tokens[i], 60);
  }
  EXPECT_TRUE(sse.done);
  EXPECT_EQ(sse.chunks.back()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(s->Wait(absl::Seconds(20)), 0);
}

TEST(LifecycleTest, StreamsPastTheGracePeriodEndWithAClearStatus) {
  auto s = StartServer({"--step_ms", "10", "--grace_period", "200ms"});
  ASSERT_NE(s, nullptr);
  std::atomic<int> started{0};
  int tokens = 0;
  grpc::Status status;
  std::thread t([&] { status = Generate(s->grpc_target(), 1000, &tokens, "", &started); });
  SseResult sse;
  std::thread http([&] {
    sse = HttpStream(s->http_port(), "/v1/completions",
                     R"({"prompt": "x", "max_tokens": 1000, "stream": true})");
  });
  WaitRunning(s->grpc_target(), 2);
  const absl::Time sent = absl::Now();
  s->Signal(SIGTERM);
  t.join();
  http.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "shutting down")) << status.error_message();
  EXPECT_LT(tokens, 1000);
  // The SSE stream ends with an error event naming the shutdown, then [DONE].
  ASSERT_FALSE(sse.chunks.empty());
  EXPECT_TRUE(sse.chunks.back().contains("error")) << sse.chunks.back().dump();
  EXPECT_TRUE(sse.done);
  EXPECT_EQ(s->Wait(absl::Seconds(20)), 0);
  EXPECT_LT(absl::Now() - sent, absl::Seconds(10));
}

}  // namespace
}  // namespace moe::serving::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 3) {
    fprintf(stderr, "usage: lifecycle_test SCRIPTED_SERVER TOKENIZER_JSON\n");
    return 2;
  }
  moe::serving::testing::g_binary = moe::serving::testing::Runfile(argv[1]);
  moe::serving::testing::g_model_dir =
      std::filesystem::path(moe::serving::testing::Runfile(argv[2])).parent_path().string();
  return RUN_ALL_TESTS();
}
