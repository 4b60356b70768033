// Bounded fuzzing of the request handling: mutated OpenAI JSON bodies through the parser and the
// prompt preparation (in process, with the real tokenizer and chat template), random
// GenerateRequest protos through their validation, then mutated bodies over the wire to a live
// server. No crash, and every answer is a result or a well-formed InvalidArgument / 400.
//
// Arguments: the scripted server binary, then Qwen3's tokenizer.json. MOE_FUZZ_SECONDS (default
// 2) bounds each phase.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "serving/grpc_service.h"
#include "serving/openai.h"
#include "tests/serving/scripted_engine.h"
#include "tests/serving/test_util.h"

namespace moe::serving::testing {
namespace {

std::string g_binary;
std::string g_model_dir;

absl::Duration Budget() {
  const char* s = std::getenv("MOE_FUZZ_SECONDS");
  return absl::Seconds(s != nullptr ? std::atof(s) : 2.0);
}

const std::vector<std::string>& Seeds() {
  static const auto* seeds = new std::vector<std::string>{
      R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stream": true})",
      R"({"prompt": [1, 2, 3], "n": 2, "seed": 4, "logprobs": 2, "stop": ["a", "b"]})",
      R"({"prompt": ["x"], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stream_options": {"include_usage": true}})",
      R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 3})",
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "weather?"}]}], "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}], "tool_choice": "required"})",
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "tool_call_id": "1", "content": "sunny"}], "chat_template_kwargs": {"enable_thinking": false}, "logprobs": true, "top_logprobs": 2})",
  };
  return *seeds;
}

// Byte-level and JSON-aware mutations.
std::string Mutate(std::string s, std::mt19937_64& rng) {
  static const char* const kTokens[] = {"null", "true", "-1", "1e999", "\"\"", "[]", "{}", "\"\\ud800\"",
                                        "NaN", "0", "1.5", "-0", "99999999999999999999", "\"\xff\"",
                                        "{\"a\":", "]", ",", ":", "\"role\"", "\"tool\""};
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = rng() % s.size();
    switch (rng() % 5) {
      case 0:
        s[at] = static_cast<char>(rng() % 256);
        break;
      case 1:
        s.erase(at, 1 + rng() % 8);
        break;
      case 2:
        s.insert(at, kTokens[rng() % (sizeof(kTokens) / sizeof(kTokens[0]))]);
        break;
      case 3: {
        // Replace a JSON value after a colon with another token.
        const size_t colon = s.find(':', at);
        if (colon != std::string::npos) {
          size_t end = s.find_first_of(",}", colon + 1);
          if (end == std::string::npos) end = s.size();
          s.replace(colon + 1, end - colon - 1,
                    kTokens[rng() % (sizeof(kTokens) / sizeof(kTokens[0]))]);
        }
        break;
      }
      default:
        s.resize(at);
        break;
    }
  }
  return s;
}

std::unique_ptr<ScriptedEngine> MakeEngine() {
  ScriptedEngineOptions o;
  auto tok = tokenizer::Tokenizer::FromDirectory(g_model_dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  o.tokenizer = *std::move(tok);
  auto tmpl = tokenizer::ChatTemplate::FromDirectory(g_model_dir);
  EXPECT_TRUE(tmpl.ok()) << tmpl.status();
  o.chat_template = *std::move(tmpl);
  o.max_context = 512;
  return std::make_unique<ScriptedEngine>(std::move(o));
}

TEST(FuzzTest, OpenAiBodies) {
  std::unique_ptr<ScriptedEngine> engine = MakeEngine();
  RequestLimits limits;
  limits.max_context = 512;
  std::mt19937_64 rng(1234);
  const absl::Time end = absl::Now() + Budget();
  int runs = 0, accepted = 0;
  while (absl::Now() < end) {
    const std::string& seed = Seeds()[rng() % Seeds().size()];
    const bool chat = seed.find("messages") != std::string::npos;
    const std::string body = Mutate(seed, rng);
    ++runs;
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, chat, "scripted", limits);
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
      ASSERT_FALSE(r.status().message().empty());
      continue;
    }
    absl::StatusOr<PreparedPrompt> p = PreparePrompt(*r, *engine, limits);
    if (!p.ok()) {
      ASSERT_TRUE(p.status().code() == absl::StatusCode::kInvalidArgument ||
                  p.status().code() == absl::StatusCode::kFailedPrecondition)
          << body << " -> " << p.status();
      continue;
    }
    ++accepted;
    ASSERT_TRUE(r->sampling.Validate().ok()) << body;
    ASSERT_LE(p->prompt_ids.size() + r->sampling.max_tokens, 512u) << body;
    // The response side with arbitrary model text.
    ChoiceBuilder b(*r, *p, engine->tokenizer());
    engine::GenerationEvent e;
    e.text = Mutate("<think>x</think><tool_call>{\"name\": \"w\", \"arguments\": {}}</tool_call>", rng);
    e.token_ids = {1, 2};
    e.logprobs = {-1.0f, -std::numeric_limits<float>::infinity()};
    e.top_logprobs = {{{3, -0.5f}}, {}};
    b.Add(0, e);
    e.finish_reason = engine::FinishReason::kStop;
    b.Add(0, e);
    const std::string out = b.Final(0).dump(-1, ' ', false, Json::error_handler_t::replace);
    ASSERT_FALSE(Json::parse(out, nullptr, false).is_discarded());
  }
  std::printf("openai bodies: %d runs, %d accepted\n", runs, accepted);
  EXPECT_GT(runs, 100);
  EXPECT_GT(accepted, 0);
}

TEST(FuzzTest, GenerateProtos) {
  std::unique_ptr<ScriptedEngine> engine = MakeEngine();
  std::mt19937_64 rng(99);
  const float specials[] = {0.0f, -1.0f, 1.0f, 0.5f, 2.0f, 1e30f, -1e30f, NAN, INFINITY, -INFINITY};
  auto f = [&] { return rng() % 3 == 0 ? specials[rng() % 10] : static_cast<float>(rng() % 1000) / 300.0f; };
  auto i32 = [&] {
    switch (rng() % 4) {
      case 0: return static_cast<int32_t>(rng());
      case 1: return -static_cast<int32_t>(rng() % 10);
      default: return static_cast<int32_t>(rng() % 600);
    }
  };
  const absl::Time end = absl::Now() + Budget();
  int runs = 0, accepted = 0;
  while (absl::Now() < end) {
    v1::GenerateRequest req;
    switch (rng() % 3) {
      case 0: req.set_text(Mutate("Hello there, how are you?", rng)); break;
      case 1: for (int k = 0, n = rng() % 6; k < n; ++k) req.mutable_token_ids()->add_ids(i32()); break;
      default: break;
    }
    if (rng() % 4 == 0) req.set_model(rng() % 2 ? "scripted" : "other");
    v1::SamplingParams* s = req.mutable_sampling();
    // Each field is set a third of the time, so that some requests pass.
    auto maybe = [&] { return rng() % 3 == 0; };
    if (maybe()) s->set_temperature(f());
    if (maybe()) s->set_top_p(f());
    if (maybe()) s->set_top_k(i32());
    if (maybe()) s->set_min_p(f());
    if (maybe()) s->set_repetition_penalty(f());
    if (maybe()) s->set_presence_penalty(f());
    if (maybe()) s->set_frequency_penalty(f());
    if (maybe()) s->set_max_tokens(i32());
    if (maybe()) s->set_top_logprobs(i32());
    if (rng() % 3 == 0) s->add_stop(rng() % 2 ? "" : "x");
    if (rng() % 3 == 0) s->add_stop_token_ids(i32());
    if (rng() % 2) s->set_seed(rng());
    ++runs;
    absl::StatusOr<engine::GenerationRequest> r = ToEngineRequest(req, *engine);
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << req.DebugString();
      continue;
    }
    ++accepted;
    ASSERT_TRUE(r->sampling.Validate().ok());
    ASSERT_TRUE(engine->Submit(*r).ok()) << req.DebugString();
  }
  std::printf("generate protos: %d runs, %d accepted\n", runs, accepted);
  EXPECT_GT(accepted, 0);
}

TEST(FuzzTest, OverTheWire) {
  auto server = ServerProcess::Start(g_binary, {"--model", g_model_dir, "--step_ms", "0",
                                                "--max_context", "512"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->http_port();
  std::mt19937_64 rng(7);
  const absl::Time end = absl::Now() + Budget();
  int runs = 0;
  while (absl::Now() < end) {
    const std::string& seed = Seeds()[rng() % Seeds().size()];
    const bool chat = seed.find("messages") != std::string::npos;
    std::string body = Mutate(seed, rng);
    // Streams are read whole here; keep them short.
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    HttpResult r = HttpRequest(port, "POST", path, body);
    ++runs;
    ASSERT_TRUE(r.status == 200 || r.status == 400) << r.status << " for " << body;
    if (r.status == 400) {
      ASSERT_TRUE(r.json.is_object() && r.json["error"]["message"].is_string()) << r.body;
    } else if (r.body.rfind("data: ", 0) == 0) {
      ASSERT_NE(r.body.find("data: [DONE]\n\n"), std::string::npos) << r.body;
    } else {
      ASSERT_TRUE(r.json.is_object() && r.json["choices"].is_array()) << r.body;
    }
  }
  std::printf("over the wire: %d requests\n", runs);
  EXPECT_EQ(HttpRequest(port, "GET", "/health").status, 200);
}

}  // namespace
}  // namespace moe::serving::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 3) {
    fprintf(stderr, "usage: fuzz_test SCRIPTED_SERVER TOKENIZER_JSON\n");
    return 2;
  }
  moe::serving::testing::g_binary = moe::serving::testing::Runfile(argv[1]);
  moe::serving::testing::g_model_dir =
      std::filesystem::path(moe::serving::testing::Runfile(argv[2])).parent_path().string();
  return RUN_ALL_TESTS();
}
