// Load on the real server binary with the real model engine: 64 concurrent streaming gRPC
// clients, several requests each, greedy, the engine in its deterministic mode with one thread.
// Every stream must complete and be token-identical to the same prompt run alone (batching never
// changes results), also with a KV pool small enough to force preemption.
//
// Arguments: //serving:server, //tools:make_tiny_model.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "serving/proto/serving.grpc.pb.h"
#include "tests/serving/test_util.h"

namespace moe::serving::testing {
namespace {

std::string g_server;
std::string g_model_dir;

constexpr int kClients = 64;
constexpr int kRequestsPerClient = 3;
constexpr int kPrompts = 24;
constexpr int kMaxTokens = 12;

// Prompt p: token ids of varied lengths (1 to 40) inside the tiny model's 256-token vocabulary.
std::vector<int32_t> Prompt(int p) {
  std::vector<int32_t> ids;
  const int len = 1 + (p * 7) % 40;
  for (int i = 0; i < len; ++i) ids.push_back(static_cast<int32_t>((p * 31 + i * 17 + 3) % 250));
  return ids;
}

// One greedy stream; returns its tokens, or a failure description in `error`.
std::vector<int32_t> Run(v1::Serving::Stub& stub, int p, std::string* error) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(50));
  v1::GenerateRequest req;
  for (int32_t id : Prompt(p)) req.mutable_token_ids()->add_ids(id);
  req.mutable_sampling()->set_max_tokens(kMaxTokens);
  req.mutable_sampling()->set_ignore_eos(true);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  std::vector<int32_t> tokens;
  bool finished = false;
  while (reader->Read(&resp)) {
    tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) finished = true;
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) {
    *error = absl::StrCat("status ", st.error_code(), ": ", st.error_message());
  } else if (!finished) {
    *error = "no finish reason";
  }
  return tokens;
}

void LoadMatchesSoloRuns(const std::vector<std::string>& extra_flags, bool expect_preemption) {
  std::vector<std::string> args = {"--model", g_model_dir, "--deterministic", "--threads", "1",
                                   "--max_batch", "64", "--max_context", "256"};
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  auto server = ServerProcess::Start(g_server, args);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->grpc_target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Serving::NewStub(channel);

  // Alone, one at a time.
  std::vector<std::vector<int32_t>> solo(kPrompts);
  for (int p = 0; p < kPrompts; ++p) {
    std::string error;
    solo[p] = Run(*stub, p, &error);
    ASSERT_TRUE(error.empty()) << error;
    ASSERT_EQ(solo[p].size(), static_cast<size_t>(kMaxTokens));
  }

  // All together.
  std::atomic<int> failures{0}, mismatches{0}, completed{0};
  std::vector<std::string> first_error(1);
  std::mutex error_mu;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto own = v1::Serving::NewStub(channel);
      for (int r = 0; r < kRequestsPerClient; ++r) {
        const int p = (c * kRequestsPerClient + r) % kPrompts;
        std::string error;
        std::vector<int32_t> tokens = Run(*own, p, &error);
        if (!error.empty()) {
          ++failures;
          std::lock_guard<std::mutex> lock(error_mu);
          if (first_error[0].empty()) first_error[0] = error;
          continue;
        }
        ++completed;
        if (tokens != solo[p]) ++mismatches;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0) << first_error[0];
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(completed.load(), kClients * kRequestsPerClient);

  // The engine publishes occupancy after the step that delivered the final tokens, so a client
  // can see its stream end a moment before the stats do: poll until they settle (a leaked
  // sequence or block never does, and fails below).
  v1::Stats stats;
  const auto settle_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    if ((stats.running() == 0 && stats.kv_blocks_used() == 0) ||
        std::chrono::steady_clock::now() > settle_by) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(stats.mean_batch_size(), 1.0) << "requests never shared a step";
  if (expect_preemption) {
    EXPECT_GT(stats.preemptions(), 0u);
  }
  EXPECT_EQ(stats.running(), 0);
  EXPECT_EQ(stats.kv_blocks_used(), 0);
  std::printf("load: %d streams, mean batch %.1f, last batch %d, preemptions %llu\n",
              completed.load(), stats.mean_batch_size(), stats.last_batch_size(),
              static_cast<unsigned long long>(stats.preemptions()));
}

TEST(LoadTest, SixtyFourStreamsMatchSoloRuns) { LoadMatchesSoloRuns({}, false); }

TEST(LoadTest, SixtyFourStreamsMatchSoloRunsUnderPreemption) {
  // 24 blocks of 16 tokens cannot hold 64 sequences of up to 52 tokens: the engine preempts.
  LoadMatchesSoloRuns({"--kv_blocks", "24"}, true);
}

}  // namespace
}  // namespace moe::serving::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 3) {
    fprintf(stderr, "usage: load_test SERVER MAKE_TINY_MODEL\n");
    return 2;
  }
  using moe::serving::testing::Runfile;
  moe::serving::testing::g_server = Runfile(argv[1]);
  moe::serving::testing::g_model_dir = absl::StrCat(getenv("TEST_TMPDIR"), "/tiny");
  const std::string make = absl::StrCat(Runfile(argv[2]), " --family qwen3_moe --out ",
                                        moe::serving::testing::g_model_dir,
                                        " --seed 5 --max_positions 512 > /dev/null");
  if (std::system(make.c_str()) != 0) {
    fprintf(stderr, "make_tiny_model failed\n");
    return 1;
  }
  return RUN_ALL_TESTS();
}
