// serving_bench: the real server (gRPC front, scheduler, model engine) on loopback under 1, 8,
// 32 and 64 concurrent streaming clients: aggregate generated tok/s, p50/p99 time to first token
// and inter-token latency. Prompts are token ids, so any model folder works (with or without a
// tokenizer).
//
//   tools/bazel run --config=opt //serving:serving_bench -- [--model DIR] [--threads N]
//       [--concurrency 1,8,32,64] [--max_tokens 64] [--prompt_tokens 32] [--json_out FILE]
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/engine_flags.h"
#include "engine/model_engine.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "serving/proto/serving.grpc.pb.h"
#include "serving/server.h"

ABSL_FLAG(std::string, concurrency, "1,8,32,64", "concurrent streams to measure, comma-separated");
ABSL_FLAG(int, max_tokens, 64, "tokens generated per request (EOS ignored)");
ABSL_FLAG(int, prompt_tokens, 32, "prompt length in tokens");
ABSL_FLAG(int, requests_per_client, 2, "requests each client sends, one after another");
ABSL_FLAG(std::string, json_out, "", "write the results as JSON here");

namespace {

namespace v1 = moe::serving::v1;

struct Sample {
  double ttft = 0;
  std::vector<double> itl;
  int tokens = 0;
  bool ok = false;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

Sample RunOne(v1::Serving::Stub& stub, int seed, int vocab) {
  v1::GenerateRequest req;
  const int n = absl::GetFlag(FLAGS_prompt_tokens);
  const int range = std::min(vocab, 1000);
  for (int i = 0; i < n; ++i) req.mutable_token_ids()->add_ids((seed * 131 + i * 29 + 7) % range);
  req.mutable_sampling()->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  req.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  Sample s;
  const absl::Time start = absl::Now();
  absl::Time last = start;
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (resp.token_ids_size() == 0) continue;
    const absl::Time now = absl::Now();
    if (s.tokens == 0) {
      s.ttft = absl::ToDoubleSeconds(now - start);
    } else {
      s.itl.push_back(absl::ToDoubleSeconds(now - last));
    }
    last = now;
    s.tokens += resp.token_ids_size();
  }
  s.ok = reader->Finish().ok();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  moe::engine::ParseCommandLine(argc, argv,
                                "Measures the server under concurrent streams (see the file comment).");
  auto options = moe::engine::ModelEngineOptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "serving_bench: %s\n", std::string(options.status().message()).c_str());
    return 1;
  }
  auto engine = moe::engine::CreateModelEngine(*options);
  if (!engine.ok()) {
    std::fprintf(stderr, "serving_bench: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  const moe::engine::ModelInfo info = (*engine)->model_info();
  moe::serving::ServerOptions so;
  so.grpc_port = 0;
  so.http_port = -1;
  so.max_batch = options->max_batch;
  auto server = moe::serving::Server::Start(*std::move(engine), so);
  if (!server.ok()) {
    std::fprintf(stderr, "serving_bench: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->grpc_port()),
                                     grpc::InsecureChannelCredentials());
  {
    auto stub = v1::Serving::NewStub(channel);
    RunOne(*stub, 0, info.vocab_size);  // warm-up
  }
  std::printf("model %s (%d layers, hidden %d, %d experts top-%d, %s), %d prompt + %d output tokens\n",
              info.name.c_str(), info.num_layers, info.hidden_size, info.num_experts,
              info.experts_per_token, info.expert_format.c_str(),
              absl::GetFlag(FLAGS_prompt_tokens), absl::GetFlag(FLAGS_max_tokens));
  // The engine's own view, to tell serving overhead from model time: rows per step and the
  // share of the wall time spent inside Engine::Step.
  auto stats = [&] {
    auto stub = v1::Serving::NewStub(channel);
    grpc::ClientContext ctx;
    v1::Stats s;
    (void)stub->GetStats(&ctx, v1::GetStatsRequest(), &s);
    return s;
  };
  std::printf("%8s %10s %12s %12s %12s %12s %10s %10s %8s\n", "streams", "tok/s", "ttft_p50_ms",
              "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "rows/step", "in_step", "failed");
  nlohmann::json results = nlohmann::json::array();
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int c = 0;
    if (!absl::SimpleAtoi(part, &c) || c < 1) {
      std::fprintf(stderr, "serving_bench: --concurrency: bad value '%s'\n", std::string(part).c_str());
      return 1;
    }
    const int per_client = absl::GetFlag(FLAGS_requests_per_client);
    std::vector<std::vector<Sample>> samples(c);
    const v1::Stats before = stats();
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    for (int t = 0; t < c; ++t) {
      threads.emplace_back([&, t] {
        auto stub = v1::Serving::NewStub(channel);
        for (int r = 0; r < per_client; ++r) samples[t].push_back(RunOne(*stub, t * per_client + r + 1, info.vocab_size));
      });
    }
    for (auto& th : threads) th.join();
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    const v1::Stats after = stats();
    const double steps = static_cast<double>(after.steps() - before.steps());
    const double rows = steps > 0 ? (after.decode_tokens() - before.decode_tokens()) / steps : 0;
    // Engine step time = tokens / (tokens per second) for each kind, from the lifetime figures.
    auto busy = [](const v1::Stats& s) {
      double t = 0;
      if (s.decode_tokens_per_second() > 0) t += s.decode_tokens() / s.decode_tokens_per_second();
      if (s.prefill_tokens_per_second() > 0) t += s.prefill_tokens() / s.prefill_tokens_per_second();
      return t;
    };
    const double in_step = (busy(after) - busy(before)) / seconds;
    std::vector<double> ttft, itl;
    long tokens = 0;
    int failed = 0;
    for (const auto& v : samples) {
      for (const Sample& s : v) {
        if (!s.ok) ++failed;
        tokens += s.tokens;
        ttft.push_back(s.ttft);
        itl.insert(itl.end(), s.itl.begin(), s.itl.end());
      }
    }
    const double tps = tokens / seconds;
    std::printf("%8d %10.1f %12.1f %12.1f %12.2f %12.2f %10.1f %9.0f%% %8d\n", c, tps,
                Percentile(ttft, 0.5) * 1e3, Percentile(ttft, 0.99) * 1e3, Percentile(itl, 0.5) * 1e3,
                Percentile(itl, 0.99) * 1e3, rows, in_step * 100, failed);
    std::fflush(stdout);
    results.push_back({{"streams", c},
                       {"requests", c * per_client},
                       {"generated_tokens", tokens},
                       {"seconds", seconds},
                       {"tokens_per_second", tps},
                       {"ttft_p50_ms", Percentile(ttft, 0.5) * 1e3},
                       {"ttft_p99_ms", Percentile(ttft, 0.99) * 1e3},
                       {"itl_p50_ms", Percentile(itl, 0.5) * 1e3},
                       {"itl_p99_ms", Percentile(itl, 0.99) * 1e3},
                       {"decode_rows_per_step", rows},
                       {"engine_step_share", in_step},
                       {"failed", failed}});
  }
  (*server)->Shutdown(absl::Seconds(5));
  const std::string out = absl::GetFlag(FLAGS_json_out);
  if (!out.empty()) {
    nlohmann::json doc = {{"model", info.name},
                          {"layers", info.num_layers},
                          {"hidden", info.hidden_size},
                          {"experts", info.num_experts},
                          {"top_k", info.experts_per_token},
                          {"expert_format", info.expert_format},
                          {"threads", options->threads},
                          {"prompt_tokens", absl::GetFlag(FLAGS_prompt_tokens)},
                          {"max_tokens", absl::GetFlag(FLAGS_max_tokens)},
                          {"results", results}};
    std::ofstream(out) << doc.dump(2) << "\n";
  }
  return 0;
}
