// The engine loop on random in-memory models: batch independence in the deterministic mode,
// seeded sampling whatever the batch, preemption when the KV pool is too small, cancellation,
// KV block reuse, stop strings split across tokens, limits; a forward pass failing in the middle
// of a run; the fast mode against the deterministic one.
#include "engine/model_engine.h"

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/failing_forward_model.h"
#include "engine/random_model.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

ModelConfig Config() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 128;  // ASCII byte tokens of the test tokenizer
  c.hidden_size = 64;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 256;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  return c;
}

// GPT-2's byte -> printable code point map, so the test tokenizer is a plain byte-level BPE
// (no merges): token i is byte i.
std::string ByteLevelTokenizerJson() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::map<int, int> cp;
  for (int b : bs) cp[b] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (!cp.count(b)) cp[b] = 256 + n++;
  }
  auto utf8 = [](int c) {
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    return s;
  };
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    std::string tok = utf8(cp[b]);
    if (tok == "\"" || tok == "\\") tok = "\\" + tok;
    vocab += (b ? ",\"" : "\"") + tok + "\":" + std::to_string(b);
  }
  return R"({"version":"1.0","added_tokens":[],"normalizer":null,
    "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
    "post_processor":null,
    "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
    "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
      "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
      "vocab":{)" +
         vocab + R"(},"merges":[]}})";
}

std::unique_ptr<Engine> MakeEngine(ModelEngineOptions o, bool with_tokenizer = false,
                                   uint64_t seed = 7) {
  RandomModelOptions ro;
  ro.dense_dtype = DType::kBf16;
  ro.seed = seed;
  auto m = MakeRandomModel(Config(), ro);
  EXPECT_TRUE(m.ok()) << m.status();
  auto rm = std::make_shared<RandomModel>(std::move(*m));
  ModelEngineParts parts;
  parts.keepalive = rm;
  parts.weights = rm->weights.get();
  parts.banks = rm->banks;
  parts.name = "random";
  if (with_tokenizer) {
    auto tok = tokenizer::Tokenizer::FromJson(ByteLevelTokenizerJson());
    EXPECT_TRUE(tok.ok()) << tok.status();
    parts.tokenizer = std::move(*tok);
  }
  if (o.threads == 0) o.threads = 2;
  auto e = CreateModelEngineFromParts(std::move(parts), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

struct Result {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TopLogprob>> top;
  std::string text;
  std::vector<std::string> pieces;
  FinishReason reason = FinishReason::kNone;
  int finals = 0;
};

GenerationRequest Request(std::vector<int32_t> prompt, int max_tokens,
                          std::map<uint64_t, Result>* out, uint64_t* id_slot) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.logprobs = true;
  r.sampling.top_logprobs = 2;
  r.on_event = [out, id_slot](const GenerationEvent& e) {
    Result& res = (*out)[e.request_id];
    res.tokens.insert(res.tokens.end(), e.token_ids.begin(), e.token_ids.end());
    res.logprobs.insert(res.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    res.top.insert(res.top.end(), e.top_logprobs.begin(), e.top_logprobs.end());
    res.text += e.text;
    res.pieces.push_back(e.text);
    if (e.finish_reason != FinishReason::kNone) {
      res.reason = e.finish_reason;
      ++res.finals;
    }
    (void)id_slot;
  };
  return r;
}

void RunToEnd(Engine& e, int max_steps = 1000) {
  for (int i = 0; i < max_steps && e.HasWork(); ++i) ASSERT_TRUE(e.Step().ok());
  ASSERT_FALSE(e.HasWork());
}

std::vector<int32_t> Prompt(int n, int seed) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 32 + (seed * 7 + i * 13) % 90;
  return p;
}

// Runs each prompt alone on a fresh engine.
std::vector<Result> Solo(const ModelEngineOptions& o, const std::vector<GenerationRequest>& reqs) {
  std::vector<Result> out;
  for (const GenerationRequest& proto : reqs) {
    auto e = MakeEngine(o);
    std::map<uint64_t, Result> res;
    GenerationRequest r = Request(proto.prompt_ids, proto.sampling.max_tokens, &res, nullptr);
    r.sampling = proto.sampling;
    auto id = e->Submit(std::move(r));
    EXPECT_TRUE(id.ok());
    RunToEnd(*e);
    out.push_back(res[*id]);
  }
  return out;
}

std::vector<GenerationRequest> MixedRequests() {
  std::vector<GenerationRequest> reqs;
  const int lens[] = {3, 17, 9, 30};
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r;
    r.prompt_ids = Prompt(lens[i], i);
    r.sampling.max_tokens = 6 + i;
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 2;
    if (i % 2 == 1) {  // seeded sampling beside greedy
      r.sampling.temperature = 0.9f;
      r.sampling.top_p = 0.95f;
      r.sampling.has_seed = true;
      r.sampling.seed = 100 + i;
    }
    reqs.push_back(r);
  }
  return reqs;
}

std::vector<Result> Batched(Engine& e, const std::vector<GenerationRequest>& reqs) {
  std::map<uint64_t, Result> res;
  std::vector<uint64_t> ids;
  for (const GenerationRequest& proto : reqs) {
    GenerationRequest r = Request(proto.prompt_ids, proto.sampling.max_tokens, &res, nullptr);
    r.sampling = proto.sampling;
    auto id = e.Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  RunToEnd(e);
  std::vector<Result> out;
  for (uint64_t id : ids) out.push_back(res[id]);
  return out;
}

void ExpectSame(const std::vector<Result>& a, const std::vector<Result>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i;
    EXPECT_EQ(a[i].logprobs, b[i].logprobs) << "request " << i;  // bit for bit
    EXPECT_EQ(a[i].reason, b[i].reason);
    EXPECT_EQ(a[i].finals, 1);
  }
}

ModelEngineOptions Deterministic() {
  ModelEngineOptions o;
  o.deterministic = true;
  o.prefill_chunk = 8;  // prompts take several steps, beside other sequences' decode
  return o;
}

TEST(ModelEngineTest, DeterministicBatchEqualsSoloBitForBit) {
  const auto reqs = MixedRequests();
  const auto solo = Solo(Deterministic(), reqs);
  auto e = MakeEngine(Deterministic());
  const auto batched = Batched(*e, reqs);
  ExpectSame(solo, batched);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(static_cast<int>(solo[i].tokens.size()), reqs[i].sampling.max_tokens);
  }
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
  EXPECT_EQ(e->Stats().requests_finished, reqs.size());
}

TEST(ModelEngineTest, TooSmallPoolPreemptsAndStillFinishesWithTheSameTokens) {
  const auto reqs = MixedRequests();
  const auto solo = Solo(Deterministic(), reqs);
  ModelEngineOptions o = Deterministic();
  o.max_context = 64;
  o.kv_block_size = 4;
  o.kv_blocks = 16;  // one full-length sequence, far less than the four need together
  auto e = MakeEngine(o);
  const auto batched = Batched(*e, reqs);
  ExpectSame(solo, batched);
  EXPECT_GT(e->Stats().preemptions, 0u);
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
}

TEST(ModelEngineTest, ReusedKvBlocksLeaveNoTrace) {
  ModelEngineOptions o = Deterministic();
  o.kv_block_size = 4;
  GenerationRequest a, b;
  a.prompt_ids = Prompt(21, 1);
  a.sampling.max_tokens = 5;
  b.prompt_ids = Prompt(6, 2);
  b.sampling.max_tokens = 9;
  b.sampling.logprobs = true;
  const auto fresh = Solo(o, {b});
  auto e = MakeEngine(o);
  Batched(*e, {a});                      // fills blocks, then frees them
  const auto reused = Batched(*e, {b});  // takes the same (lowest) blocks
  ExpectSame(fresh, reused);
}

TEST(ModelEngineTest, CancelEndsTheRequestAndFreesItsBlocks) {
  auto e = MakeEngine(Deterministic());
  std::map<uint64_t, Result> res;
  auto id = e->Submit(Request(Prompt(20, 3), 50, &res, nullptr));
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e->Step().ok());
  EXPECT_GT(e->Stats().kv_blocks_used, 0);
  e->Cancel(*id);
  e->Cancel(12345);  // unknown: ignored
  ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(res[*id].reason, FinishReason::kCancelled);
  EXPECT_EQ(res[*id].finals, 1);
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
  EXPECT_FALSE(e->HasWork());
}

TEST(ModelEngineTest, RefusesBadRequests) {
  ModelEngineOptions o = Deterministic();
  o.max_context = 32;
  auto e = MakeEngine(o);
  std::map<uint64_t, Result> res;
  EXPECT_EQ(e->Submit(Request({}, 4, &res, nullptr)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Submit(Request({1, 500}, 4, &res, nullptr)).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto too_long = e->Submit(Request(Prompt(30, 1), 3, &res, nullptr));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("30"), std::string::npos);
  GenerationRequest bad = Request({1, 2}, 4, &res, nullptr);
  bad.sampling.top_p = 0.0f;
  EXPECT_EQ(e->Submit(bad).status().code(), absl::StatusCode::kInvalidArgument);
  GenerationRequest text = Request({}, 4, &res, nullptr);
  text.prompt_text = "no tokenizer here";
  EXPECT_EQ(e->Submit(text).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->HasWork());
  EXPECT_TRUE(res.empty());
}

TEST(ModelEngineTest, ForcedOutputTokensComeFirstAndCount) {
  auto e = MakeEngine(Deterministic());
  std::map<uint64_t, Result> res;
  GenerationRequest r = Request(Prompt(5, 4), 4, &res, nullptr);
  r.forced_output_ids = {40, 41};
  auto id = e->Submit(std::move(r));
  ASSERT_TRUE(id.ok());
  RunToEnd(*e);
  ASSERT_EQ(res[*id].tokens.size(), 4u);
  EXPECT_EQ(res[*id].tokens[0], 40);
  EXPECT_EQ(res[*id].tokens[1], 41);
  EXPECT_EQ(res[*id].reason, FinishReason::kLength);
}

TEST(ModelEngineTest, StopStringSplitAcrossTokensEndsTheTextBeforeIt) {
  ModelEngineOptions o = Deterministic();
  std::map<uint64_t, Result> res;
  auto e = MakeEngine(o, /*with_tokenizer=*/true);
  auto id = e->Submit(Request(Prompt(7, 5), 12, &res, nullptr));
  ASSERT_TRUE(id.ok());
  RunToEnd(*e);
  const std::string full = res[*id].text;
  ASSERT_EQ(full.size(), 12u);  // one ASCII byte per token
  // A stop string made of the 5th to 7th tokens' text: it completes only at the 7th token.
  const std::string stop = full.substr(4, 3);
  const size_t first = full.find(stop);
  auto e2 = MakeEngine(o, /*with_tokenizer=*/true);
  std::map<uint64_t, Result> res2;
  GenerationRequest r = Request(Prompt(7, 5), 12, &res2, nullptr);
  r.sampling.stop_strings = {"never appears \x01", stop};
  auto id2 = e2->Submit(std::move(r));
  ASSERT_TRUE(id2.ok());
  RunToEnd(*e2);
  EXPECT_EQ(res2[*id2].reason, FinishReason::kStop);
  EXPECT_EQ(res2[*id2].text, full.substr(0, first));
  EXPECT_EQ(res2[*id2].tokens.size(), first + 3);
}

TEST(ModelEngineTest, EosFinishesWithStopUnlessIgnored) {
  auto e = MakeEngine(Deterministic());
  std::map<uint64_t, Result> res;
  auto id = e->Submit(Request(Prompt(4, 6), 8, &res, nullptr));
  ASSERT_TRUE(id.ok());
  RunToEnd(*e);
  const std::vector<int32_t> toks = res[*id].tokens;
  ASSERT_EQ(toks.size(), 8u);
  // Make the third token a stop token: the output ends there.
  std::map<uint64_t, Result> res2;
  GenerationRequest r = Request(Prompt(4, 6), 8, &res2, nullptr);
  r.sampling.stop_token_ids = {toks[2]};
  auto e2 = MakeEngine(Deterministic());
  auto id2 = e2->Submit(std::move(r));
  ASSERT_TRUE(id2.ok());
  RunToEnd(*e2);
  size_t first = 0;
  while (toks[first] != toks[2]) ++first;
  EXPECT_EQ(res2[*id2].reason, FinishReason::kStop);
  EXPECT_EQ(res2[*id2].tokens, std::vector<int32_t>(toks.begin(), toks.begin() + first + 1));
}

// What the fault-injection tests record of each request.
struct Outcome {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::kNone;
  absl::Status error;
  int finals = 0;
};

GenerationRequest Recorded(std::vector<int32_t> prompt, int max_tokens,
                           std::map<uint64_t, Outcome>* out) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.on_event = [out](const GenerationEvent& e) {
    Outcome& o = (*out)[e.request_id];
    o.tokens.insert(o.tokens.end(), e.token_ids.begin(), e.token_ids.end());
    if (e.finish_reason != FinishReason::kNone) {
      o.reason = e.finish_reason;
      o.error = e.error;
      ++o.finals;
    }
  };
  return r;
}

// Options whose model fails on demand; *failing is set when the engine is built.
ModelEngineOptions WithFaults(ModelEngineOptions o, FailingForwardModel** failing) {
  o.wrap_model = [failing](std::unique_ptr<ForwardModel> m) {
    auto f = std::make_unique<FailingForwardModel>(std::move(m));
    *failing = f.get();
    return std::unique_ptr<ForwardModel>(std::move(f));
  };
  return o;
}

// A forward pass failing in the middle of a run (device memory running out, injected here): the
// requests of that batch end with its error and give their blocks back; Step reports it; the
// engine goes on, and a request that waited behind the batch, or came after the failure, gets
// exactly the tokens it gets alone.
TEST(ModelEngineTest, ForwardFailureEndsTheBatchAndTheEngineGoesOn) {
  ModelEngineOptions o = Deterministic();
  o.max_batch = 2;  // a and b run, c waits
  FailingForwardModel* failing = nullptr;
  auto e = MakeEngine(WithFaults(o, &failing));
  ASSERT_NE(failing, nullptr);
  std::map<uint64_t, Outcome> out;
  auto a = e->Submit(Recorded(Prompt(9, 1), 30, &out));
  auto b = e->Submit(Recorded(Prompt(5, 2), 30, &out));
  auto c = e->Submit(Recorded(Prompt(11, 3), 7, &out));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(e->Step().ok());
  ASSERT_FALSE(out[*a].tokens.empty());
  ASSERT_FALSE(out[*b].tokens.empty());
  ASSERT_TRUE(out[*c].tokens.empty());
  ASSERT_EQ(e->Stats().running, 2);
  ASSERT_GT(e->Stats().kv_blocks_used, 0);

  const absl::Status injected =
      absl::ResourceExhaustedError("GPU memory: 64 MiB of activations do not fit (injected)");
  failing->FailNext(injected);
  EXPECT_EQ(e->Step(), injected);
  for (uint64_t id : {*a, *b}) {
    EXPECT_EQ(out[id].reason, FinishReason::kError) << id;
    EXPECT_EQ(out[id].error, injected) << id;
    EXPECT_EQ(out[id].finals, 1) << id;
  }
  EXPECT_EQ(out[*c].finals, 0);
  EngineStats stats = e->Stats();
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 1);
  EXPECT_TRUE(e->HasWork());

  auto d = e->Submit(Recorded(Prompt(6, 4), 9, &out));
  ASSERT_TRUE(d.ok());
  RunToEnd(*e);
  for (const auto& [id, prompt, n] :
       {std::tuple(*c, Prompt(11, 3), 7), std::tuple(*d, Prompt(6, 4), 9)}) {
    std::map<uint64_t, Outcome> alone;
    auto solo = MakeEngine(o);
    auto sid = solo->Submit(Recorded(prompt, n, &alone));
    ASSERT_TRUE(sid.ok());
    RunToEnd(*solo);
    EXPECT_EQ(out[id].reason, FinishReason::kLength) << id;
    EXPECT_TRUE(out[id].error.ok()) << out[id].error;
    EXPECT_EQ(out[id].finals, 1);
    EXPECT_EQ(out[id].tokens, alone[*sid].tokens) << id;
  }
  stats = e->Stats();
  EXPECT_EQ(stats.kv_blocks_used, 0);
  EXPECT_EQ(stats.requests_finished, 4u);
  EXPECT_EQ(failing->failed_calls(), 1);
}

// A model that keeps failing ends every request (each with the error) instead of leaving any
// waiting forever.
TEST(ModelEngineTest, PersistentForwardFailureEndsEveryRequest) {
  ModelEngineOptions o = Deterministic();
  o.max_batch = 2;
  FailingForwardModel* failing = nullptr;
  auto e = MakeEngine(WithFaults(o, &failing));
  const absl::Status injected =
      absl::InternalError("CUDA error: an illegal memory access (injected)");
  failing->FailNext(injected, 1000);
  std::map<uint64_t, Outcome> out;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    auto id = e->Submit(Recorded(Prompt(4 + i, i), 5, &out));
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  int steps = 0;
  for (; steps < 10 && e->HasWork(); ++steps) EXPECT_EQ(e->Step(), injected);
  EXPECT_FALSE(e->HasWork());
  EXPECT_EQ(steps, 3);  // two, two, then one
  for (uint64_t id : ids) {
    EXPECT_EQ(out[id].reason, FinishReason::kError) << id;
    EXPECT_EQ(out[id].error, injected) << id;
    EXPECT_EQ(out[id].finals, 1) << id;
  }
  EXPECT_EQ(e->Stats().kv_blocks_used, 0);
  EXPECT_EQ(e->Stats().requests_finished, ids.size());
}

// The fast mode (batched oneDNN dense layers, cpu_moe's batch-dependent paths) differs from the
// deterministic one only by rounding: greedy tokens agree wherever the top-1 margin is clear.
TEST(ModelEngineTest, FastModeMatchesDeterministicGreedyWhereTheMarginIsClear) {
  std::vector<GenerationRequest> reqs = MixedRequests();
  for (auto& r : reqs) {
    r.sampling.temperature = 0.0f;
    r.sampling.max_tokens = 10;
  }
  ModelEngineOptions fast = Deterministic();
  fast.deterministic = false;
  auto ed = MakeEngine(Deterministic());
  auto ef = MakeEngine(fast);
  const auto det = Batched(*ed, reqs);
  const auto fst = Batched(*ef, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    for (size_t t = 0; t < det[i].tokens.size(); ++t) {
      ASSERT_EQ(det[i].top[t].size(), 2u);
      const float margin = det[i].top[t][0].logprob - det[i].top[t][1].logprob;
      if (det[i].tokens[t] != fst[i].tokens[t]) {
        EXPECT_LT(margin, 0.05f) << "request " << i << " token " << t;
        break;  // the continuations diverge from here
      }
    }
  }
}

}  // namespace
}  // namespace moe::engine
