// End-to-end tests of the server binary (with a scripted engine, so that reasoning and tool
// calls can be replayed) over real loopback connections: HTTP (raw, SSE parsed chunk by chunk)
// and gRPC, health, metrics, stats, cancellation and deadlines, bad input.
//
// Arguments: the scripted server binary, then the folder of Qwen3's tokenizer files.
#include <cmath>
#include <filesystem>
#include <fstream>
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

using nlohmann::json;

std::string g_binary;
std::string g_model_dir;

// What the scripted "model" says to prompts containing these words (the first match wins; the
// tools' description in the prompt mentions weather).
constexpr char kScript[] = R"([
  {"match": "use a tool",
   "output": "get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"},
  {"match": "capital of France",
   "output": "<think>\nEasy one.\n</think>\n\nThe capital of France is Paris."},
  {"match": "weather",
   "output": "<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"}
])";

const json kTools = json::parse(R"([{"type": "function", "function": {
  "name": "get_weather", "description": "Current weather of a city",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                 "required": ["city"]}}}])");

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string script = absl::StrCat(getenv("TEST_TMPDIR"), "/script.json");
    std::ofstream(script) << kScript;
    auto p = ServerProcess::Start(g_binary, {"--model", g_model_dir, "--script_file", script,
                                             "--step_ms", "2", "--max_context", "2048"});
    ASSERT_TRUE(p.ok()) << p.status();
    server_ = p->release();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(server_->grpc_target(), grpc::InsecureChannelCredentials()));
  }
  static void TearDownTestSuite() {
    delete channel_;
    delete server_;
  }

  static int http() { return server_->http_port(); }
  static std::unique_ptr<v1::Serving::Stub> stub() { return v1::Serving::NewStub(*channel_); }

  static v1::Stats Stats() {
    grpc::ClientContext ctx;
    v1::Stats stats;
    EXPECT_TRUE(stub()->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    return stats;
  }
  // Waits until the engine holds no sequence (cancel frees at the next step).
  static bool WaitIdle() {
    for (int i = 0; i < 200; ++i) {
      v1::Stats s = Stats();
      if (s.running() == 0 && s.waiting() == 0 && s.kv_blocks_used() == 0 && s.queue_depth() == 0) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  static ServerProcess* server_;
  static std::shared_ptr<grpc::Channel>* channel_;
};

ServerProcess* ServerTest::server_ = nullptr;
std::shared_ptr<grpc::Channel>* ServerTest::channel_ = nullptr;

TEST_F(ServerTest, Health) {
  auto health = grpc::health::v1::Health::NewStub(*channel_);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  HttpResult r = HttpRequest(http(), "GET", "/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.json["status"], "ok");
}

TEST_F(ServerTest, CompletionWholeAndStreamedAgree) {
  const json req = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}};
  HttpResult whole = HttpRequest(http(), "POST", "/v1/completions", req.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(whole.json["object"], "text_completion");
  EXPECT_EQ(whole.json["model"], "scripted");
  EXPECT_EQ(whole.json["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole.json["usage"]["completion_tokens"], 12);
  EXPECT_EQ(whole.json["usage"]["total_tokens"],
            whole.json["usage"]["prompt_tokens"].get<int>() + 12);
  const std::string text = whole.json["choices"][0]["text"];
  EXPECT_FALSE(text.empty());

  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  SseResult s = HttpStream(http(), "/v1/completions", sreq.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_TRUE(s.problems.empty()) << s.problems[0];
  EXPECT_TRUE(s.done);
  ASSERT_GE(s.chunks.size(), 3u);
  EXPECT_EQ(StreamText(s), text);
  for (size_t i = 0; i + 1 < s.chunks.size(); ++i) {
    EXPECT_EQ(s.chunks[i]["object"], "text_completion");
    EXPECT_EQ(s.chunks[i]["id"], s.chunks[0]["id"]);
  }
  const json& usage_chunk = s.chunks.back();
  EXPECT_TRUE(usage_chunk["choices"].empty());
  EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 12);
  EXPECT_EQ(s.chunks[s.chunks.size() - 2]["choices"][0]["finish_reason"], "length");
}

TEST_F(ServerTest, ChatReasoningIsApartFromTheAnswer) {
  const json req = {{"messages", {{{"role", "user"}, {"content", "What is the capital of France?"}}}},
                    {"max_tokens", 64}};
  HttpResult whole = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json& msg = whole.json["choices"][0]["message"];
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_TRUE(absl::StrContains(msg["reasoning_content"].get<std::string>(), "Easy one."));
  EXPECT_TRUE(absl::StrContains(msg["content"].get<std::string>(), "The capital of France is Paris."));
  EXPECT_FALSE(absl::StrContains(msg["content"].get<std::string>(), "think>"));
  EXPECT_EQ(whole.json["choices"][0]["finish_reason"], "stop");

  json sreq = req;
  sreq["stream"] = true;
  SseResult s = HttpStream(http(), "/v1/chat/completions", sreq.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_TRUE(s.problems.empty());
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string reasoning;
  for (const json& c : s.chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    const json& d = c["choices"][0]["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, msg["reasoning_content"].get<std::string>());
  EXPECT_EQ(StreamText(s), msg["content"].get<std::string>());
}

TEST_F(ServerTest, ChatTemplateKwargsReachTheTemplate) {
  // enable_thinking false: Qwen3's template closes an empty think block in the prompt, so the
  // prompt is longer than with thinking on.
  json req = {{"messages", {{{"role", "user"}, {"content", "hello"}}}}, {"max_tokens", 2}};
  HttpResult on = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  req["chat_template_kwargs"] = {{"enable_thinking", false}};
  HttpResult off = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(on.status, 200) << on.body;
  ASSERT_EQ(off.status, 200) << off.body;
  EXPECT_GT(off.json["usage"]["prompt_tokens"].get<int>(), on.json["usage"]["prompt_tokens"].get<int>());
}

TEST_F(ServerTest, ToolCallsWholeAndStreamed) {
  json req = {{"messages", {{{"role", "user"}, {"content", "What is the weather in Paris?"}}}},
              {"tools", kTools},
              {"max_tokens", 100}};
  HttpResult whole = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json& choice = whole.json["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << whole.body;
  const json& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_FALSE(call["id"].get<std::string>().empty());
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_TRUE(absl::StrContains(choice["message"]["reasoning_content"].get<std::string>(),
                                "call the tool"));

  req["stream"] = true;
  SseResult s = HttpStream(http(), "/v1/chat/completions", req.dump());
  ASSERT_EQ(s.status, 200);
  EXPECT_TRUE(s.done);
  int calls = 0;
  std::string finish;
  for (const json& c : s.chunks) {
    const json& ch = c["choices"][0];
    if (ch["delta"].contains("tool_calls")) {
      for (const json& t : ch["delta"]["tool_calls"]) {
        EXPECT_EQ(t["index"], calls);
        EXPECT_EQ(t["function"]["name"], "get_weather");
        EXPECT_EQ(json::parse(t["function"]["arguments"].get<std::string>())["city"], "Paris");
        ++calls;
      }
    }
    if (ch["finish_reason"].is_string()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(finish, "tool_calls");

  // tool_choice none: the tools are not offered and nothing is parsed as a call.
  req["stream"] = false;
  req["tool_choice"] = "none";
  HttpResult none = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(none.status, 200);
  EXPECT_FALSE(none.json["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(none.json["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(none.json["usage"]["prompt_tokens"].get<int>(), whole.json["usage"]["prompt_tokens"].get<int>());
}

TEST_F(ServerTest, RequiredAndNamedToolChoiceForceTheCallPrefix) {
  // The script continues after the forced `<tool_call>\n{"name": "` with the rest of a call.
  json req = {{"messages", {{{"role", "user"}, {"content", "Please use a tool now."}}}},
              {"tools", kTools},
              {"tool_choice", "required"},
              {"max_tokens", 60}};
  HttpResult r = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json& msg = r.json["choices"][0]["message"];
  ASSERT_TRUE(msg.contains("tool_calls")) << r.body;
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>())["city"], "Rome");

  req["tool_choice"] = {{"type", "function"}, {"function", {{"name", "nope"}}}};
  HttpResult bad = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  EXPECT_EQ(bad.status, 400);
  EXPECT_TRUE(absl::StrContains(bad.body, "tool_choice")) << bad.body;
}

TEST_F(ServerTest, NSeedsAndLogprobs) {
  const json req = {{"prompt", "abc"}, {"max_tokens", 5}, {"n", 2}, {"temperature", 0.8},
                    {"seed", 7}, {"logprobs", 2}};
  HttpResult a = HttpRequest(http(), "POST", "/v1/completions", req.dump());
  HttpResult b = HttpRequest(http(), "POST", "/v1/completions", req.dump());
  ASSERT_EQ(a.status, 200) << a.body;
  ASSERT_EQ(a.json["choices"].size(), 2u);
  EXPECT_EQ(a.json["choices"], b.json["choices"]);  // the same seed, the same text
  EXPECT_NE(a.json["choices"][0]["text"], a.json["choices"][1]["text"]);
  const json& lp = a.json["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"].size(), 5u);
  EXPECT_EQ(lp["token_logprobs"].size(), 5u);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
  EXPECT_EQ(a.json["usage"]["completion_tokens"], 10);

  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 3},
                     {"logprobs", true}, {"top_logprobs", 3}};
  HttpResult c = HttpRequest(http(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(c.status, 200) << c.body;
  const json& content = c.json["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(content[0]["top_logprobs"].size(), 3u);
  EXPECT_TRUE(content[0]["bytes"].is_array());
}

TEST_F(ServerTest, StopStrings) {
  const json req = {{"messages", {{{"role", "user"}, {"content", "capital of France?"}}}},
                    {"stop", {"Paris"}}, {"max_tokens", 64},
                    {"chat_template_kwargs", {{"enable_thinking", false}}}};
  HttpResult r = HttpRequest(http(), "POST", "/v1/chat/completions", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const std::string content = r.json["choices"][0]["message"]["content"];
  EXPECT_TRUE(absl::EndsWith(content, "The capital of France is ")) << content;
  EXPECT_EQ(r.json["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerTest, ModelsTokenizeDetokenize) {
  HttpResult models = HttpRequest(http(), "GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.json["object"], "list");
  EXPECT_EQ(models.json["data"][0]["id"], "scripted");
  HttpResult tok = HttpRequest(http(), "POST", "/tokenize", R"({"prompt": "Hello world"})");
  ASSERT_EQ(tok.status, 200) << tok.body;
  // Qwen3: "Hello" 9707, " world" 1879 (as HF tokenizers gives them).
  EXPECT_EQ(tok.json["tokens"], json({9707, 1879}));
  HttpResult detok = HttpRequest(http(), "POST", "/detokenize", R"({"tokens": [9707, 1879]})");
  ASSERT_EQ(detok.status, 200);
  EXPECT_EQ(detok.json["prompt"], "Hello world");

  grpc::ClientContext c1, c2, c3;
  v1::TokenizeRequest treq;
  treq.set_text("Hello world");
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(stub()->Tokenize(&c1, treq, &tresp).ok());
  ASSERT_EQ(tresp.token_ids_size(), 2);
  EXPECT_EQ(tresp.token_ids(0), 9707);
  v1::DetokenizeRequest dreq;
  dreq.add_token_ids(9707);
  dreq.add_token_ids(1879);
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(stub()->Detokenize(&c2, dreq, &dresp).ok());
  EXPECT_EQ(dresp.text(), "Hello world");
  v1::ModelInfo info;
  ASSERT_TRUE(stub()->GetModelInfo(&c3, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.name(), "scripted");
  EXPECT_EQ(info.max_context(), 2048);
}

TEST_F(ServerTest, GrpcGenerateStreams) {
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_text("The quick brown fox");
  req.mutable_sampling()->set_max_tokens(10);
  req.mutable_sampling()->set_logprobs(true);
  auto reader = stub()->Generate(&ctx, req);
  v1::GenerateResponse resp;
  int tokens = 0, messages = 0;
  std::string text;
  v1::GenerateResponse last;
  while (reader->Read(&resp)) {
    ++messages;
    tokens += resp.token_ids_size();
    EXPECT_EQ(resp.logprobs_size(), resp.token_ids_size());
    text += resp.text();
    last = resp;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 10);
  EXPECT_GE(messages, 2);
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.usage().completion_tokens(), 10);
  // The same prompt over HTTP gives the same text.
  HttpResult h = HttpRequest(http(), "POST", "/v1/completions",
                             R"({"prompt": "The quick brown fox", "max_tokens": 10})");
  EXPECT_EQ(h.json["choices"][0]["text"], text);
}

TEST_F(ServerTest, CancelAndDeadlineFreeTheSequence) {
  ASSERT_TRUE(WaitIdle());
  {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_text("a long story");
    req.mutable_sampling()->set_max_tokens(1500);
    auto reader = stub()->Generate(&ctx, req);
    v1::GenerateResponse resp;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&resp));
    EXPECT_EQ(Stats().running(), 1);
    ctx.TryCancel();
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(WaitIdle()) << "the cancelled sequence still holds KV blocks";
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    v1::GenerateRequest req;
    req.set_text("another long story");
    req.mutable_sampling()->set_max_tokens(1500);
    auto reader = stub()->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_TRUE(WaitIdle());
  }
  {
    // An HTTP client that hangs up mid-stream.
    SseResult s = HttpStream(http(), "/v1/completions",
                             R"({"prompt": "yet another story", "max_tokens": 1500, "stream": true})",
                             "", /*stop_after=*/3);
    EXPECT_EQ(s.chunks.size(), 3u);
    EXPECT_TRUE(WaitIdle());
  }
}

TEST_F(ServerTest, Metrics) {
  HttpRequest(http(), "POST", "/v1/completions", R"({"prompt": "metrics", "max_tokens": 4})");
  HttpResult m = HttpRequest(http(), "GET", "/metrics");
  ASSERT_EQ(m.status, 200);
  for (const char* want :
       {"moe_requests_total{api=\"http\",endpoint=\"/v1/completions\",status=\"200\"}",
        "moe_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
        "moe_inter_token_latency_seconds_count", "moe_prompt_tokens_total",
        "moe_completion_tokens_total", "moe_batch_size", "moe_queue_depth",
        "moe_expert_cache_hits_total", "moe_expert_cache_misses_total"}) {
    EXPECT_TRUE(absl::StrContains(m.body, want)) << want;
  }
  v1::Stats s = Stats();
  EXPECT_GT(s.decode_tokens(), 0u);
  EXPECT_GT(s.decode_tokens_per_second(), 0);
  EXPECT_GT(s.steps(), 0u);
}

TEST_F(ServerTest, BadInputIsRefusedNamingTheField) {
  struct Case {
    const char* path;
    std::string body;
    const char* field;
  };
  const std::string big(5 << 20, 'x');
  const std::vector<Case> cases = {
      {"/v1/completions", R"({"prompt": ""})", "prompt"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": -1})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 100000000})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 2048, "stop": ["a"]})", "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "temperature": -1})", "temperature"},
      {"/v1/completions", R"({"prompt": "x", "temperature": "NaN"})", "temperature"},
      {"/v1/completions", R"({"prompt": "x", "top_p": 0})", "top_p"},
      {"/v1/completions", R"({"prompt": "x", "top_p": 1.5})", "top_p"},
      {"/v1/completions", R"({"prompt": "x", "n": 1000})", "n"},
      {"/v1/completions", R"({"prompt": "x", "model": "gpt-9"})", "model"},
      {"/v1/completions", R"({"prompt": "x",)", "body"},
      {"/v1/completions", R"([1, 2])", "body"},
      {"/v1/completions", R"({"prompt": 5})", "prompt"},
      {"/v1/completions", R"({"prompt": [1, 99999999]})", "prompt"},
      {"/v1/completions", R"({"prompt": "x", "stream": "yes"})", "stream"},
      {"/v1/completions", absl::StrCat(R"({"prompt": ")", big, R"("})"), "body"},
      {"/v1/completions", absl::StrCat(R"({"prompt": ")", std::string(30000, 'a'), R"("})"), "prompt"},
      {"/v1/chat/completions", R"({"messages": []})", "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role"},
      {"/v1/chat/completions", R"({"messages": "hi"})", "messages"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]})",
       "tools[0].function.parameters"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": true})", "top_logprobs"},
  };
  for (const Case& c : cases) {
    HttpResult r = HttpRequest(http(), "POST", c.path, c.body);
    EXPECT_EQ(r.status, 400) << c.body.substr(0, 200) << " -> " << r.body;
    ASSERT_TRUE(r.json.is_object()) << r.body;
    const std::string message = r.json["error"]["message"];
    EXPECT_TRUE(absl::StrContains(message, c.field)) << c.field << " not in: " << message;
    EXPECT_EQ(r.json["error"]["type"], "invalid_request_error");
  }
  // A prompt plus max_tokens over the context: both numbers named.
  HttpResult over = HttpRequest(http(), "POST", "/v1/completions",
                                R"({"prompt": "one two three", "max_tokens": 2047})");
  EXPECT_EQ(over.status, 400);
  EXPECT_TRUE(absl::StrContains(over.body, "2047") && absl::StrContains(over.body, "2048")) << over.body;

  // gRPC: the same checks.
  for (auto fill : std::vector<void (*)(v1::GenerateRequest&)>{
           [](v1::GenerateRequest& r) { r.set_text(""); },
           [](v1::GenerateRequest& r) { r.set_text("x"); r.mutable_sampling()->set_max_tokens(-5); },
           [](v1::GenerateRequest& r) { r.set_text("x"); r.mutable_sampling()->set_temperature(NAN); },
           [](v1::GenerateRequest& r) { r.set_text("x"); r.mutable_sampling()->set_top_p(2); },
           [](v1::GenerateRequest& r) { r.set_text("x"); r.set_model("other"); },
           [](v1::GenerateRequest& r) { r.mutable_token_ids()->add_ids(-3); },
       }) {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    fill(req);
    auto reader = stub()->Generate(&ctx, req);
    v1::GenerateResponse resp;
    EXPECT_FALSE(reader->Read(&resp));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Still serving.
  HttpResult ok = HttpRequest(http(), "POST", "/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200);
}

TEST_F(ServerTest, ChatPageIsServed) {
  HttpResult page = HttpRequest(http(), "GET", "/");
  ASSERT_EQ(page.status, 200);
  EXPECT_TRUE(absl::StrContains(page.body, "/v1/chat/completions"));
  EXPECT_TRUE(absl::StrContains(page.body, "reasoning_content"));
}

}  // namespace
}  // namespace moe::serving::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 3) {
    fprintf(stderr, "usage: server_test SCRIPTED_SERVER TOKENIZER_DIR\n");
    return 2;
  }
  moe::serving::testing::g_binary = moe::serving::testing::Runfile(argv[1]);
  // The tokenizer.json given; its folder also holds tokenizer_config.json.
  moe::serving::testing::g_model_dir =
      std::filesystem::path(moe::serving::testing::Runfile(argv[2])).parent_path().string();
  return RUN_ALL_TESTS();
}
