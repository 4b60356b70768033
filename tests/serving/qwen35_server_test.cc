// The server on a qwen3_5_moe model (Gated DeltaNet layers with per-sequence recurrent state
// beside gated full attention), CPU backend: a tiny multimodal-layout checkpoint written by
// make_tiny_model with the embedded model's tokenizer, served in process (the real model
// engine, scheduler, gRPC and HTTP fronts over loopback). Greedy answers must equal a
// stateless reference, greedy decoding by re-running the whole sequence through the engine's
// CPU Model from position 0 for every token (no state carried between tokens, so it cannot
// share a bug with the state slots): for a request alone, for two requests running in one
// batch (each in its own state slot), and for more requests than there are slots, one after
// another and all at once (slots are given back when sequences finish or are cancelled, and
// reused). The load log names the ignored vision tower.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/failing_forward_model.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"
#include "engine/loader_test_util.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "engine/tokenizer/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "serving/proto/serving.grpc.pb.h"
#include "serving/server.h"
#include "tests/serving/test_util.h"

namespace moe::serving::testing {
namespace {

using nlohmann::json;

constexpr int kMaxTokens = 16;
constexpr int kSlots = 2;  // max_batch: the engine keeps one state slot per batch row

// Greedy decoding without carried state: every token re-runs the whole sequence from position 0
// (a fresh KV table; the model resets the state slot for a chunk at position 0).
class StatelessReference {
 public:
  absl::Status Init(const std::string& dir) {
    engine::LoadOptions lo;
    lo.expert_format = std::nullopt;  // as the server: the checkpoint's own
    lo.dense_dtype = engine::DType::kF32;
    lo.threads = 2;
    lo.progress = false;
    ASSIGN_OR_RETURN(weights_, engine::LoadModel(dir, lo));
    const engine::ModelConfig& c = weights_->config;
    for (int i = 0; i < c.NumMoeLayers(); ++i) banks_.push_back(weights_->ExpertBankFor(i));
    backend_ = std::make_unique<engine::CpuExpertBackend>(
        banks_, engine::CpuExpertBackend::DefaultOptions(/*deterministic=*/true, /*f32=*/true),
        &pool_);
    ASSIGN_OR_RETURN(model_, engine::Model::Create(weights_.get(), backend_.get(), &pool_,
                                                   /*deterministic=*/true, 256));
    ASSIGN_OR_RETURN(kv_, engine::KvCache::Create(c.NumKvLayers(), c.num_key_value_heads,
                                                  c.head_dim, 16, 16));
    ASSIGN_OR_RETURN(state_, engine::LinearAttentionState::Create(c, 1));
    return absl::OkStatus();
  }

  const engine::ModelConfig& config() const { return weights_->config; }

  // `n` greedy tokens after `prompt`; *min_gap gets the smallest top-1 / top-2 logit gap.
  std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int n, float* min_gap) {
    std::vector<int32_t> seq = prompt, out;
    *min_gap = 1e30f;
    const int V = config().vocab_size;
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> table;
      EXPECT_TRUE(kv_->Allocate((static_cast<int>(seq.size()) + 15) / 16, &table));
      engine::Model::Chunk chunk{seq, 0, &table, engine::Model::Logits::kLast, 0};
      std::vector<float> logits;
      const absl::Status st = model_->Forward({chunk}, kv_.get(), &logits, state_.get());
      EXPECT_TRUE(st.ok()) << st;
      kv_->Free(&table);
      if (!st.ok() || static_cast<int>(logits.size()) != V) return out;
      const int32_t best =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      float second = -1e30f;
      for (int v = 0; v < V; ++v) {
        if (v != best) second = std::max(second, logits[v]);
      }
      *min_gap = std::min(*min_gap, logits[best] - second);
      out.push_back(best);
      seq.push_back(best);
    }
    return out;
  }

 private:
  common::ThreadPool pool_{2};
  std::unique_ptr<engine::ModelWeights> weights_;
  std::vector<cpu_moe::ExpertBank> banks_;
  std::unique_ptr<engine::CpuExpertBackend> backend_;
  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<engine::KvCache> kv_;
  std::unique_ptr<engine::LinearAttentionState> state_;
};

// Prompt p: token ids of varied lengths (2 to 38), inside the tokenizer's vocabulary.
std::vector<int32_t> CandidatePrompt(int p) {
  std::vector<int32_t> ids;
  const int len = 2 + (p * 11) % 37;
  for (int i = 0; i < len; ++i) ids.push_back(static_cast<int32_t>((p * 131 + i * 37 + 5) % 4000));
  return ids;
}

class Qwen35ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Four layers, full attention every second one: two Gated DeltaNet layers, two attention.
    auto dir = engine::testing::MakeTinyModel(
        "qwen35_serve",
        "--family qwen3_5_moe --seed 21 --layers 4 --full_attention_interval 2 --vocab 4096");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = new std::string(*dir);
    const std::filesystem::path tiny = std::filesystem::path(std::getenv("TEST_SRCDIR")) /
                                       std::getenv("TEST_WORKSPACE") / "models/tiny_qwen3_moe";
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
      std::filesystem::copy_file(tiny / f, std::filesystem::path(*dir_) / f);
    }
    reference_ = new StatelessReference();
    const absl::Status st = reference_->Init(*dir_);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(reference_->config().NumLinearAttentionLayers(), 2);
    ASSERT_TRUE(reference_->config().multimodal);

    engine::ModelEngineOptions eo;
    eo.model_dir = *dir_;
    eo.max_batch = kSlots;
    eo.threads = 2;
    eo.max_context = 256;
    eo.deterministic = true;
    eo.dense_f32 = true;
    eo.wrap_model = [](std::unique_ptr<engine::ForwardModel> m) {
      auto f = std::make_unique<engine::FailingForwardModel>(std::move(m));
      delay_ = f.get();
      return std::unique_ptr<engine::ForwardModel>(std::move(f));
    };
    ::testing::internal::CaptureStderr();
    auto created = engine::CreateModelEngine(eo);
    load_log_ = new std::string(::testing::internal::GetCapturedStderr());
    ASSERT_TRUE(created.ok()) << created.status();
    ServerOptions so;
    so.grpc_port = 0;
    so.http_port = 0;
    so.max_batch = eo.max_batch;
    auto server = Server::Start(*std::move(created), so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    channel_ = new std::shared_ptr<grpc::Channel>(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->grpc_port()), grpc::InsecureChannelCredentials()));

    // Prompts away from near-ties (the server's recurrent decode and the reference's chunked
    // prefill differ by float rounding, about 1e-6 of a logit).
    prompts_ = new std::vector<std::vector<int32_t>>();
    expected_ = new std::vector<std::vector<int32_t>>();
    for (int p = 0; p < 40 && prompts_->size() < 6; ++p) {
      float gap = 0;
      std::vector<int32_t> want = reference_->Greedy(CandidatePrompt(p), kMaxTokens, &gap);
      if (gap < 1e-3f) continue;
      prompts_->push_back(CandidatePrompt(p));
      expected_->push_back(std::move(want));
    }
    ASSERT_EQ(prompts_->size(), 6u);
    for (size_t p = 0; p < prompts_->size(); ++p) {
      std::string line;
      for (int32_t t : (*expected_)[p]) absl::StrAppend(&line, t, " ");
      std::printf("prompt %zu (%zu tokens): %s\n", p, (*prompts_)[p].size(), line.c_str());
    }
  }
  static void TearDownTestSuite() {
    delete channel_;
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
    delete server_;
    delete reference_;
    delete prompts_;
    delete expected_;
    delete load_log_;
    delete dir_;
  }

  // One greedy stream of kMaxTokens; its tokens, or a failure in *error. cancel_after > 0
  // cancels the call after that many tokens.
  static std::vector<int32_t> Generate(const std::vector<int32_t>& prompt, std::string* error,
                                       int cancel_after = 0) {
    auto stub = v1::Serving::NewStub(*channel_);
    grpc::ClientContext ctx;
    // A state slot that is never given back leaves a request waiting forever: fail instead.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GenerateRequest req;
    for (int32_t id : prompt) req.mutable_token_ids()->add_ids(id);
    req.mutable_sampling()->set_max_tokens(kMaxTokens);
    req.mutable_sampling()->set_temperature(0);
    req.mutable_sampling()->set_ignore_eos(true);
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    std::vector<int32_t> tokens;
    bool finished = false;
    while (reader->Read(&resp)) {
      tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
      if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) finished = true;
      if (cancel_after > 0 && static_cast<int>(tokens.size()) >= cancel_after) ctx.TryCancel();
    }
    grpc::Status st = reader->Finish();
    if (cancel_after > 0) {
      if (st.error_code() != grpc::StatusCode::CANCELLED) {
        *error = absl::StrCat("expected CANCELLED, got ", st.error_code());
      }
    } else if (!st.ok()) {
      *error = absl::StrCat("status ", st.error_code(), ": ", st.error_message());
    } else if (!finished) {
      *error = "no finish reason";
    }
    return tokens;
  }

  // Waits until the engine holds no sequence and no KV block.
  static bool WaitIdle() {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      const engine::EngineStats s = server_->engine().Stats();
      if (s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0) return true;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return false;
  }

  static std::string* dir_;
  static std::string* load_log_;
  static StatelessReference* reference_;
  static engine::FailingForwardModel* delay_;
  static Server* server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  static std::vector<std::vector<int32_t>>* prompts_;
  static std::vector<std::vector<int32_t>>* expected_;
};

std::string* Qwen35ServerTest::dir_ = nullptr;
std::string* Qwen35ServerTest::load_log_ = nullptr;
StatelessReference* Qwen35ServerTest::reference_ = nullptr;
engine::FailingForwardModel* Qwen35ServerTest::delay_ = nullptr;
Server* Qwen35ServerTest::server_ = nullptr;
std::shared_ptr<grpc::Channel>* Qwen35ServerTest::channel_ = nullptr;
std::vector<std::vector<int32_t>>* Qwen35ServerTest::prompts_ = nullptr;
std::vector<std::vector<int32_t>>* Qwen35ServerTest::expected_ = nullptr;

TEST_F(Qwen35ServerTest, LoadLogSaysTheVisionTowerIsIgnored) {
  EXPECT_TRUE(absl::StrContains(*load_log_, "the text model of a multimodal checkpoint"))
      << *load_log_;
  EXPECT_TRUE(absl::StrContains(*load_log_, "ignoring its vision tower (")) << *load_log_;
  EXPECT_FALSE(absl::StrContains(*load_log_, "vision tower (0 tensors)")) << *load_log_;
  EXPECT_TRUE(absl::StrContains(*load_log_, "expert format auto: bf16")) << *load_log_;
  const engine::ModelInfo& info = server_->engine().model_info();
  EXPECT_EQ(info.family, "qwen3_5_moe");
  EXPECT_EQ(info.expert_format, "bf16");
}

TEST_F(Qwen35ServerTest, GreedyAloneMatchesTheStatelessReference) {
  for (size_t p = 0; p < prompts_->size(); ++p) {
    std::string error;
    const std::vector<int32_t> got = Generate((*prompts_)[p], &error);
    ASSERT_TRUE(error.empty()) << error;
    EXPECT_EQ(got, (*expected_)[p]) << "prompt " << p;
  }
  EXPECT_TRUE(WaitIdle());
}

// The OpenAI front with a text prompt: the tokenizer's ids, the same greedy continuation.
TEST_F(Qwen35ServerTest, HttpCompletionMatchesTheStatelessReference) {
  const tokenizer::Tokenizer* tok = server_->engine().tokenizer();
  ASSERT_NE(tok, nullptr);
  const std::string prompt = "Once upon a time";
  float gap = 0;
  const std::vector<int32_t> want = reference_->Greedy(tok->Encode(prompt), kMaxTokens, &gap);
  ASSERT_GT(gap, 1e-4f) << "a near-tie: pick another prompt";
  const json req = {{"prompt", prompt},
                    {"max_tokens", kMaxTokens},
                    {"temperature", 0},
                    {"ignore_eos", true}};
  HttpResult r = HttpRequest(server_->http_port(), "POST", "/v1/completions", req.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["usage"]["completion_tokens"], kMaxTokens);
  EXPECT_EQ(r.json["choices"][0]["text"].get<std::string>(), tok->Decode(want));
}

// Two requests in one batch, each in its own state slot, get what each gets alone.
TEST_F(Qwen35ServerTest, ConcurrentSequencesKeepTheirOwnState) {
  // Slow steps so that both are surely running together.
  delay_->SetDelay(absl::Milliseconds(3));
  const int a = 0, b = 1;
  ASSERT_NE((*prompts_)[a].size(), (*prompts_)[b].size());
  std::vector<int32_t> got_a, got_b;
  std::string err_a, err_b;
  std::atomic<bool> done{false};
  int max_running = 0;
  std::thread watcher([&] {
    while (!done.load()) {
      max_running = std::max(max_running, server_->engine().Stats().running);
      absl::SleepFor(absl::Microseconds(500));
    }
  });
  std::thread ta([&] { got_a = Generate((*prompts_)[a], &err_a); });
  std::thread tb([&] { got_b = Generate((*prompts_)[b], &err_b); });
  ta.join();
  tb.join();
  done = true;
  watcher.join();
  delay_->SetDelay(absl::ZeroDuration());
  ASSERT_TRUE(err_a.empty()) << err_a;
  ASSERT_TRUE(err_b.empty()) << err_b;
  EXPECT_EQ(max_running, 2) << "the two requests never ran in one batch";
  EXPECT_EQ(got_a, (*expected_)[a]);
  EXPECT_EQ(got_b, (*expected_)[b]);
  EXPECT_TRUE(WaitIdle());
}

// More sequences than state slots: one after another (each finished sequence must give its slot
// back, or the third would wait forever), after cancellations, and all at once (queued, each
// admitted into a slot another one left).
TEST_F(Qwen35ServerTest, StateSlotsAreGivenBackAndReused) {
  for (int round = 0; round < 2; ++round) {
    for (size_t p = 0; p < prompts_->size(); ++p) {
      std::string error;
      const std::vector<int32_t> got = Generate((*prompts_)[p], &error);
      ASSERT_TRUE(error.empty()) << "round " << round << ", prompt " << p << ": " << error;
      EXPECT_EQ(got, (*expected_)[p]) << "round " << round << ", prompt " << p;
    }
  }
  // Cancelled mid-answer, more times than there are slots.
  delay_->SetDelay(absl::Milliseconds(2));
  for (int i = 0; i < 2 * kSlots + 1; ++i) {
    std::string error;
    Generate((*prompts_)[i % prompts_->size()], &error, /*cancel_after=*/3);
    ASSERT_TRUE(error.empty()) << error;
  }
  delay_->SetDelay(absl::ZeroDuration());
  ASSERT_TRUE(WaitIdle());
  {
    std::string error;
    EXPECT_EQ(Generate((*prompts_)[2], &error), (*expected_)[2]);
    ASSERT_TRUE(error.empty()) << error;
  }
  // All at once: three times the slots.
  const int n = static_cast<int>(prompts_->size());
  std::vector<std::vector<int32_t>> got(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] { got[p] = Generate((*prompts_)[p], &errors[p]); });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < n; ++p) {
    ASSERT_TRUE(errors[p].empty()) << "prompt " << p << ": " << errors[p];
    EXPECT_EQ(got[p], (*expected_)[p]) << "prompt " << p;
  }
  EXPECT_TRUE(WaitIdle());
  // This test's uncancelled requests at least.
  EXPECT_GE(server_->engine().Stats().requests_finished, 3u * n + 1);
}

}  // namespace
}  // namespace moe::serving::testing
