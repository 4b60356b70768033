// The engine loop on the CUDA backend (GPU machine; skipped without a device): ModelEngine with
// backend "cuda" on the embedded default model, deterministic mode, gives every request the same
// greedy tokens whether it runs alone or batched with the others (continuous batching, chunked
// prefill and decode through GpuModel), and reports the backend.
#include <map>
#include <vector>

#include "common/gpu_test_util.h"
#include "engine/model_engine.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

std::vector<int32_t> Prompt(int n, int seed, int vocab) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 7919 + i * 104729 + 13) % vocab;
  return t;
}

TEST(GpuEngineTest, BatchedRequestsGetTheirSoloTokens) {
  MOE_SKIP_WITHOUT_GPU();
  ModelEngineOptions eo;
  eo.backend = "cuda";
  eo.deterministic = true;
  eo.max_batch = 4;
  eo.max_context = 128;
  eo.prefill_chunk = 32;  // the longest prompt takes several steps
  eo.threads = 2;
  auto engine = CreateModelEngine(eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->model_info().backend, "cuda");
  EXPECT_GT((*engine)->Stats().memory_bytes, 0u);
  const int vocab = (*engine)->model_info().vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {Prompt(37, 1, vocab), Prompt(5, 2, vocab),
                                                     Prompt(70, 3, vocab)};
  std::map<uint64_t, std::vector<int32_t>> got;
  auto submit = [&](const std::vector<int32_t>& p) {
    GenerationRequest r;
    r.prompt_ids = p;
    r.sampling.max_tokens = 12;
    r.sampling.ignore_eos = true;
    r.on_event = [&got](const GenerationEvent& e) {
      ASSERT_TRUE(e.error.ok()) << e.error;
      auto& v = got[e.request_id];
      v.insert(v.end(), e.token_ids.begin(), e.token_ids.end());
    };
    auto id = (*engine)->Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  };
  std::vector<uint64_t> solo, together;
  for (const auto& p : prompts) {
    solo.push_back(submit(p));
    while ((*engine)->HasWork()) ASSERT_TRUE((*engine)->Step().ok());
  }
  for (const auto& p : prompts) together.push_back(submit(p));
  while ((*engine)->HasWork()) ASSERT_TRUE((*engine)->Step().ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[solo[i]].size(), 12u) << i;
    EXPECT_EQ(got[together[i]], got[solo[i]]) << "prompt " << i;
  }
  EXPECT_EQ((*engine)->Stats().kv_blocks_used, 0);
}

}  // namespace
}  // namespace moe::engine
