// A forward pass failing in the middle of a run, through the whole server: the real model engine
// on the embedded default model, its model wrapped in a FailingForwardModel
// (engine/failing_forward_model.h) that fails one Forward with ResourceExhausted, the scheduler,
// and the HTTP front over loopback. The requests running when the failure hits end with a clear
// error (503 naming the cause, or a final SSE error event); a request waiting behind them and
// requests sent afterwards complete normally; every KV block goes back; the server keeps serving.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/failing_forward_model.h"
#include "engine/model_engine.h"
#include "gtest/gtest.h"
#include "serving/server.h"
#include "tests/serving/test_util.h"

namespace moe::serving::testing {
namespace {

using nlohmann::json;

constexpr char kInjected[] = "GPU memory: 96 MiB more for the step's activations (injected)";

// Polls `done` every millisecond until it holds or `timeout` passes.
template <typename F>
bool WaitFor(F done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// The error a streamed answer ended with ("" when none).
std::string StreamError(const SseResult& r) {
  for (const json& chunk : r.chunks) {
    if (chunk.contains("error")) return chunk["error"].value("message", "?");
  }
  return "";
}

TEST(EngineFailureTest, RunningRequestsEndWithTheErrorAndTheServerKeepsServing) {
  engine::ModelEngineOptions eo;  // the embedded default model
  eo.max_batch = 3;
  eo.threads = 2;
  engine::FailingForwardModel* failing = nullptr;
  eo.wrap_model = [&failing](std::unique_ptr<engine::ForwardModel> m) {
    auto f = std::make_unique<engine::FailingForwardModel>(std::move(m));
    failing = f.get();
    return std::unique_ptr<engine::ForwardModel>(std::move(f));
  };
  auto created = engine::CreateModelEngine(eo);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_NE(failing, nullptr);
  ServerOptions so;
  so.grpc_port = 0;
  so.http_port = 0;
  so.max_batch = eo.max_batch;
  auto server = Server::Start(*std::move(created), so);
  ASSERT_TRUE(server.ok()) << server.status();
  const engine::Engine& engine = (*server)->engine();
  const int port = (*server)->http_port();
  // Steps slow enough that the long requests are still running when the failure is armed.
  failing->SetDelay(absl::Milliseconds(5));

  // Three long requests fill the batch (max_batch 3): a whole chat answer, a streamed chat, a
  // streamed completion.
  const std::string long_chat =
      R"({"messages": [{"role": "user", "content": "Tell me a fortune."}], "max_tokens": 1500,
          "ignore_eos": true)";
  const std::string long_completion =
      R"({"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true, "stream": true})";
  HttpResult whole;
  SseResult chat_stream, completion_stream;
  std::thread t1(
      [&] { whole = HttpRequest(port, "POST", "/v1/chat/completions", long_chat + "}"); });
  std::thread t2([&] {
    chat_stream = HttpStream(port, "/v1/chat/completions", long_chat + R"(, "stream": true})");
  });
  std::thread t3([&] { completion_stream = HttpStream(port, "/v1/completions", long_completion); });
  ASSERT_TRUE(WaitFor([&] { return engine.Stats().running == 3; }, absl::Seconds(30)));
  // A fourth waits behind them.
  HttpResult waited;
  std::thread t4([&] {
    waited =
        HttpRequest(port, "POST", "/v1/completions",
                    R"({"prompt": "The meaning of life", "max_tokens": 8, "ignore_eos": true})");
  });
  ASSERT_TRUE(WaitFor([&] { return engine.Stats().waiting == 1; }, absl::Seconds(30)));
  ASSERT_GT(engine.Stats().kv_blocks_used, 0);

  failing->FailNext(absl::ResourceExhaustedError(kInjected));
  t1.join();
  t2.join();
  t3.join();
  failing->SetDelay(absl::ZeroDuration());
  t4.join();
  EXPECT_EQ(failing->failed_calls(), 1);

  // The whole answer: 503 (the server's failure, worth retrying, not the client's rate) naming
  // the cause.
  EXPECT_EQ(whole.status, 503) << whole.body;
  ASSERT_TRUE(whole.json.contains("error")) << whole.body;
  const std::string message = whole.json["error"].value("message", "");
  EXPECT_TRUE(absl::StrContains(message, "the engine failed")) << message;
  EXPECT_TRUE(absl::StrContains(message, kInjected)) << message;
  EXPECT_EQ(whole.json["error"].value("type", ""), "service_unavailable");
  EXPECT_EQ(whole.json["error"].value("code", 0), 503);
  // The streams had started (200 and tokens); they end with an error event, then [DONE].
  for (const SseResult* s : {&chat_stream, &completion_stream}) {
    EXPECT_EQ(s->status, 200) << s->body;
    EXPECT_TRUE(s->problems.empty()) << s->problems[0];
    EXPECT_TRUE(absl::StrContains(StreamError(*s), kInjected)) << StreamError(*s);
    EXPECT_TRUE(s->done);
  }
  // The request that waited behind the failed batch was not part of it.
  EXPECT_EQ(waited.status, 200) << waited.body;
  EXPECT_EQ(waited.json["usage"].value("completion_tokens", 0), 8) << waited.body;

  // The server goes on: new requests, whole and streamed, complete.
  HttpResult chat = HttpRequest(
      port, "POST", "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "Tell me a fortune."}], "max_tokens": 12})");
  EXPECT_EQ(chat.status, 200) << chat.body;
  EXPECT_FALSE(chat.json["choices"][0]["message"].value("content", "").empty()) << chat.body;
  SseResult stream =
      HttpStream(port, "/v1/completions",
                 R"({"prompt": "Once upon a time", "max_tokens": 12, "stream": true})");
  EXPECT_EQ(stream.status, 200) << stream.body;
  EXPECT_TRUE(stream.done);
  EXPECT_EQ(StreamError(stream), "");
  EXPECT_FALSE(StreamText(stream).empty());

  // Every block went back, and the failure is counted.
  EXPECT_TRUE(
      WaitFor([&] { return engine.Stats().kv_blocks_used == 0 && engine.Stats().running == 0; },
              absl::Seconds(10)))
      << engine.Stats().kv_blocks_used << " blocks used";
  HttpResult metrics = HttpRequest(port, "GET", "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics.body, "\nmoe_engine_step_failures_total 1\n"))
      << metrics.body;
  EXPECT_TRUE(absl::StrContains(metrics.body, "\nmoe_kv_blocks_used 0\n"));
  EXPECT_EQ(HttpRequest(port, "GET", "/health").status, 200);
  EXPECT_EQ((*server)->Shutdown(absl::Seconds(5)), 0);
}

}  // namespace
}  // namespace moe::serving::testing
