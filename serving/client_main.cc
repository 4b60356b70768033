// client: streams one completion from a moe-offload server over gRPC and prints the text as it
// arrives, then the token counts, time to first token and decode tok/s.
//
//   tools/bazel run //serving:client -- --prompt "Once upon a time" --max_tokens 64
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "serving/proto/serving.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "the server's gRPC address");
ABSL_FLAG(std::string, prompt, "Once upon a time", "prompt text");
ABSL_FLAG(int, max_tokens, 64, "tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "0: greedy");
ABSL_FLAG(double, top_p, 1.0, "nucleus sampling threshold, (0, 1]");
ABSL_FLAG(int64_t, seed, -1, "sampling seed; -1: none");
ABSL_FLAG(std::string, api_key, "", "sent as `authorization: Bearer KEY` (or set MOE_API_KEY)");
ABSL_FLAG(double, timeout_s, 300, "deadline of the call in seconds");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Streams a completion from a moe-offload server over gRPC and prints text and tok/s.\n"
      "  client [--target 127.0.0.1:50051] [--prompt TEXT] [--max_tokens N] [--temperature T]");
  absl::ParseCommandLine(argc, argv);
  namespace v1 = moe::serving::v1;
  auto stub = v1::Serving::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  std::string key = absl::GetFlag(FLAGS_api_key);
  if (key.empty() && std::getenv("MOE_API_KEY") != nullptr) key = std::getenv("MOE_API_KEY");
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_s) * 1000)));
  v1::GenerateRequest req;
  req.set_text(absl::GetFlag(FLAGS_prompt));
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  s->set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  s->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  if (absl::GetFlag(FLAGS_seed) >= 0) s->set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));

  const absl::Time start = absl::Now();
  absl::Time first = absl::InfinitePast();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  int tokens = 0;
  v1::GenerateResponse last;
  std::printf("%s", req.text().c_str());
  while (reader->Read(&resp)) {
    if (resp.token_ids_size() > 0 && first == absl::InfinitePast()) first = absl::Now();
    tokens += resp.token_ids_size();
    std::printf("%s", resp.text().c_str());
    std::fflush(stdout);
    last = resp;
  }
  const absl::Time end = absl::Now();
  grpc::Status status = reader->Finish();
  std::printf("\n");
  if (!status.ok()) {
    std::fprintf(stderr, "client: %s (code %d)\n", status.error_message().c_str(),
                 static_cast<int>(status.error_code()));
    return 1;
  }
  const char* reason = last.finish_reason() == v1::FINISH_REASON_STOP     ? "stop"
                       : last.finish_reason() == v1::FINISH_REASON_LENGTH ? "length"
                                                                          : "?";
  const double ttft = first == absl::InfinitePast() ? 0 : absl::ToDoubleSeconds(first - start);
  const double decode = first == absl::InfinitePast() ? 0 : absl::ToDoubleSeconds(end - first);
  std::fprintf(stderr,
               "-- %d prompt + %d generated tokens (%s); first token after %.1f ms; "
               "%.1f tok/s after it\n",
               last.usage().prompt_tokens(), tokens, reason, ttft * 1000,
               tokens > 1 && decode > 0 ? (tokens - 1) / decode : 0.0);
  return 0;
}
