// The Gated DeltaNet layers of a qwen3_5_moe model (written by //tools:make_tiny_model) on the
// CPU, beyond the reference fixtures (engine/hf_fixture_test.cc holds the model to
// transformers): over prompts that span several of the delta rule's 64-token chunks, the
// chunked prefill, a prefill cut into engine-sized chunks and token-by-token decode give the
// same logits; the state follows each sequence through the engine (batching, slots running
// out, preemption); the published multimodal layout and the text model alone load to the same
// model; the CUDA backend refuses the family with a clear error.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/gated_delta_net.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"
#include "engine/loader_test_util.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

constexpr char kFlags[] =
    "--family qwen3_5_moe --dtype f32 --layers 4 --hidden 64 --experts 8 --top_k 2 "
    "--moe_intermediate 32 --shared_intermediate 32 --heads 4 --kv_heads 2 --head_dim 32 "
    "--vocab 256 --linear_key_heads 2 --linear_value_heads 4 --linear_key_dim 32 "
    "--linear_value_dim 16 --seed 7";

// A loaded model with room for `sequences` sequences of `positions` tokens.
struct Loaded {
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<common::ThreadPool> pool;
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;
  std::unique_ptr<LinearAttentionState> state;
  std::vector<std::vector<int32_t>> tables;

  static absl::StatusOr<Loaded> Make(const std::string& dir, int sequences, int positions) {
    Loaded m;
    LoadOptions lo;
    lo.dense_dtype = DType::kF32;
    lo.progress = false;
    lo.threads = 2;
    ASSIGN_OR_RETURN(m.weights, LoadModel(dir, lo));
    const ModelConfig& c = m.weights->config;
    m.pool = std::make_unique<common::ThreadPool>(2);
    std::vector<cpu_moe::ExpertBank> banks;
    for (int i = 0; i < c.NumMoeLayers(); ++i) banks.push_back(m.weights->ExpertBankFor(i));
    m.backend = std::make_unique<CpuExpertBackend>(
        banks, CpuExpertBackend::DefaultOptions(true, true), m.pool.get());
    ASSIGN_OR_RETURN(m.model, Model::Create(m.weights.get(), m.backend.get(), m.pool.get(),
                                            /*deterministic=*/true, positions));
    const int bs = 16, per_seq = (positions + bs - 1) / bs;
    ASSIGN_OR_RETURN(m.kv, KvCache::Create(c.NumKvLayers(), c.num_key_value_heads, c.head_dim, bs,
                                           sequences * per_seq));
    ASSIGN_OR_RETURN(m.state, LinearAttentionState::Create(c, sequences));
    m.tables.resize(sequences);
    for (auto& t : m.tables) m.kv->Allocate(per_seq, &t);
    return m;
  }

  // The prompt's logits ([n, vocab]) fed to sequence `seq` in pieces of `piece` tokens.
  absl::StatusOr<std::vector<float>> Run(const std::vector<int32_t>& prompt, int seq, int piece) {
    std::vector<float> all;
    for (size_t t = 0; t < prompt.size(); t += piece) {
      const size_t n = std::min<size_t>(piece, prompt.size() - t);
      const Model::Chunk ch{absl::MakeConstSpan(prompt).subspan(t, n), static_cast<int>(t),
                            &tables[seq], Model::Logits::kAll, seq};
      RETURN_IF_ERROR(model->Forward({&ch, 1}, kv.get(), &all, state.get()));
    }
    return all;
  }
};

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return diff / scale;
}

std::vector<int32_t> Prompt(int n, int vocab, uint32_t seed) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = static_cast<int32_t>((seed >> 8) % vocab);
  }
  return p;
}

TEST(LinearAttentionTest, ChunkedPrefillAndRecurrentDecodeAgreeOverManyChunks) {
  auto dir = testing::MakeTinyModel("q35", kFlags);
  ASSERT_TRUE(dir.ok()) << dir.status();
  constexpr int kTokens = 300;  // 4 full delta-rule chunks of 64 and a partial one
  auto m = Loaded::Make(*dir, 4, kTokens + 40);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->weights->config.NumLinearAttentionLayers(), 3);
  const std::vector<int32_t> prompt = Prompt(kTokens, 256, 1);
  auto whole = m->Run(prompt, 0, kTokens);     // one chunk: the chunked delta rule
  auto engine_sized = m->Run(prompt, 1, 100);  // prefill chunks that end mid delta-rule chunk
  auto decode = m->Run(prompt, 2, 1);          // token by token: the recurrent rule
  auto odd = m->Run(prompt, 3, 2);             // two-token chunks: chunked, state every step
  ASSERT_TRUE(whole.ok() && engine_sized.ok() && decode.ok() && odd.ok());
  const double d1 = RelDiff(*engine_sized, *whole), d2 = RelDiff(*decode, *whole),
               d3 = RelDiff(*odd, *whole);
  std::printf("rel diff to one chunk: pieces of 100 %.3g, of 1 %.3g, of 2 %.3g\n", d1, d2, d3);
  EXPECT_LE(d1, 1e-5);
  EXPECT_LE(d2, 1e-5);
  EXPECT_LE(d3, 1e-5);
  // A state carried over from another sequence (the slot not reset) changes the logits: the
  // reset at a sequence's first chunk matters. Slot 0 still holds the 300-token state.
  const std::vector<int32_t> second = Prompt(40, 256, 2);
  auto fresh = m->Run(second, 1, 40);
  ASSERT_TRUE(fresh.ok());
  std::vector<float> carried;
  const Model::Chunk cont{second, kTokens, &m->tables[0], Model::Logits::kAll, 0};
  ASSERT_TRUE(m->model->Forward({&cont, 1}, m->kv.get(), &carried, m->state.get()).ok());
  EXPECT_GE(RelDiff(carried, *fresh), 1e-2);
}

TEST(LinearAttentionTest, DeltaRuleFormsAgreeOnRandomInputs) {
  // Kernel level, with inputs of every scale the model can produce: strong and weak decay,
  // beta near 0 and 1, keys of any length (the kernels do not assume unit keys).
  const int dk = 24, dv = 8, n = 150;
  std::vector<float> q(n * dk), k(n * dk), v(n * dv), g(n), beta(n);
  uint32_t seed = 3;
  auto uni = [&seed]() {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>((seed >> 8) & 0xFFFF) / 65536.0f;
  };
  for (float& x : q) x = 0.3f * (uni() - 0.5f);
  for (float& x : k) x = 0.4f * (uni() - 0.5f);
  for (float& x : v) x = 2.0f * (uni() - 0.5f);
  for (int t = 0; t < n; ++t) {
    g[t] = -3.0f * uni() * uni();
    beta[t] = uni();
  }
  std::vector<float> s_rec(dk * dv), s_chunk(dk * dv);
  for (size_t i = 0; i < s_rec.size(); ++i) s_rec[i] = s_chunk[i] = 0.1f * (uni() - 0.5f);
  std::vector<float> o_rec(n * dv), o_chunk(n * dv);
  DeltaRuleArgs a;
  a.n = n;
  a.key_dim = dk;
  a.value_dim = dv;
  a.q = q.data();
  a.k = k.data();
  a.qk_stride = dk;
  a.v = v.data();
  a.v_stride = dv;
  a.g = g.data();
  a.beta = beta.data();
  a.gb_stride = 1;
  a.out_stride = dv;
  a.state = s_rec.data();
  a.out = o_rec.data();
  std::vector<float> scratch(DeltaRuleChunkedScratch(kDeltaRuleChunk, dk, dv));
  DeltaRuleRecurrent(a, scratch.data());
  a.state = s_chunk.data();
  a.out = o_chunk.data();
  DeltaRuleChunked(a, kDeltaRuleChunk, scratch.data());
  EXPECT_LE(RelDiff(o_chunk, o_rec), 1e-5);
  EXPECT_LE(RelDiff(s_chunk, s_rec), 1e-5);
}

TEST(LinearAttentionTest, EngineKeepsEachSequencesStateThroughSlotsAndPreemption) {
  auto dir = testing::MakeTinyModel("q35e", kFlags);
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::vector<std::vector<int32_t>> prompts = {Prompt(90, 256, 11), Prompt(5, 256, 12),
                                               Prompt(70, 256, 13), Prompt(33, 256, 14)};
  auto run = [&](int max_batch, int kv_blocks, int prefill_chunk, bool together,
                 EngineStats* stats) {
    ModelEngineOptions o;
    o.model_dir = *dir;
    o.deterministic = true;
    o.dense_f32 = true;
    o.threads = 2;
    o.max_batch = max_batch;
    o.max_context = 128;
    o.kv_blocks = kv_blocks;
    o.prefill_chunk = prefill_chunk;
    auto engine = CreateModelEngine(o);
    EXPECT_TRUE(engine.ok()) << engine.status();
    std::map<uint64_t, std::vector<int32_t>> got;
    std::vector<uint64_t> ids;
    for (const auto& p : prompts) {
      GenerationRequest r;
      r.prompt_ids = p;
      r.sampling.max_tokens = 20;
      r.sampling.ignore_eos = true;
      r.on_event = [&got](const GenerationEvent& e) {
        auto& v = got[e.request_id];
        v.insert(v.end(), e.token_ids.begin(), e.token_ids.end());
      };
      auto id = (*engine)->Submit(std::move(r));
      EXPECT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
      if (!together) {
        while ((*engine)->HasWork()) EXPECT_TRUE((*engine)->Step().ok());
      }
    }
    while ((*engine)->HasWork()) EXPECT_TRUE((*engine)->Step().ok());
    if (stats != nullptr) *stats = (*engine)->Stats();
    std::vector<std::vector<int32_t>> out;
    for (uint64_t id : ids) out.push_back(got[id]);
    return out;
  };
  const auto alone = run(4, 0, 256, false, nullptr);
  for (const auto& o : alone) ASSERT_EQ(o.size(), 20u);
  // All at once, in prefill chunks of 16.
  EXPECT_EQ(run(4, 0, 16, true, nullptr), alone);
  // Two state slots for four sequences: the others wait for a slot.
  EXPECT_EQ(run(2, 0, 32, true, nullptr), alone);
  // A KV pool of 15 blocks of 16 tokens (one sequence needs up to 7): sequences are preempted
  // and start again from a reset state.
  EngineStats stats;
  EXPECT_EQ(run(4, 15, 64, true, &stats), alone);
  EXPECT_GT(stats.preemptions, 0u);
}

TEST(LinearAttentionTest, MultimodalLayoutAndTextModelLoadTheSameModel) {
  auto wrapped = testing::MakeTinyModel("q35w", kFlags);
  auto text = testing::MakeTinyModel("q35t", absl::StrCat(kFlags, " --text_only"));
  ASSERT_TRUE(wrapped.ok() && text.ok());
  auto a = Loaded::Make(*wrapped, 1, 80);
  auto b = Loaded::Make(*text, 1, 80);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(a->weights->config.multimodal);
  EXPECT_FALSE(b->weights->config.multimodal);
  const std::vector<int32_t> prompt = Prompt(80, 256, 5);
  auto la = a->Run(prompt, 0, 80);
  auto lb = b->Run(prompt, 0, 80);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(*la, *lb);
  // The norms are applied as 1 + w: the loaded multipliers sit near 1 (the file holds w near 0).
  EXPECT_NEAR(a->weights->final_norm.f32()[0], 1.0f, 0.11f);
}

TEST(LinearAttentionTest, BrokenCheckpointsFailNamingTheTensor) {
  struct Case {
    const char* what;
    std::function<void(std::vector<testing::OwnedTensor>&)> edit;
    const char* needle;
  } cases[] = {
      {"A_log missing",
       [](std::vector<testing::OwnedTensor>& all) {
         all.erase(std::remove_if(all.begin(), all.end(),
                                  [](const auto& t) {
                                    return t.name ==
                                           "model.language_model.layers.1.linear_attn.A_log";
                                  }),
                   all.end());
       },
       "layers.1.linear_attn.A_log\" is missing"},
      {"conv1d of the wrong kernel",
       [](std::vector<testing::OwnedTensor>& all) {
         for (auto& t : all) {
           if (t.name == "model.language_model.layers.0.linear_attn.conv1d.weight") {
             t.shape = {t.shape[0], 2, t.shape[2] / 2};
           }
         }
       },
       "layers.0.linear_attn.conv1d.weight\" has shape"},
      {"q_proj without the gate rows",
       [](std::vector<testing::OwnedTensor>& all) {
         for (auto& t : all) {
           if (t.name == "model.language_model.layers.3.self_attn.q_proj.weight") {
             t.shape[0] /= 2;
             t.bytes.resize(t.bytes.size() / 2);
           }
         }
       },
       "layers.3.self_attn.q_proj.weight\" has shape"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    auto dir = testing::MakeTinyModel("q35bad", kFlags);
    ASSERT_TRUE(dir.ok()) << dir.status();
    ASSERT_TRUE(testing::RewriteTensors(*dir + "/model.safetensors", k.edit).ok());
    LoadOptions lo;
    lo.progress = false;
    lo.threads = 2;
    auto w = LoadModel(*dir, lo);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(w.status().message()).find(k.needle), std::string::npos) << w.status();
  }
}

TEST(LinearAttentionTest, CudaBackendRefusesTheFamily) {
  auto dir = testing::MakeTinyModel("q35c", kFlags);
  ASSERT_TRUE(dir.ok()) << dir.status();
  ModelEngineOptions o;
  o.model_dir = *dir;
  o.backend = "cuda";
  o.threads = 2;
  auto engine = CreateModelEngine(o);
  ASSERT_FALSE(engine.ok());
  if (engine.status().code() == absl::StatusCode::kUnavailable) {
    GTEST_SKIP() << "built without CUDA: " << engine.status();
  }
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kUnimplemented) << engine.status();
  EXPECT_NE(std::string(engine.status().message()).find("qwen3_5_moe"), std::string::npos);
}

}  // namespace
}  // namespace moe::engine
