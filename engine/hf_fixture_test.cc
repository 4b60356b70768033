// The engine against Hugging Face transformers: every case folder under engine/testdata/ (an HF
// model folder plus reference.json and logits_<i>.npy, made by the reference scripts with
// transformers) is loaded with LoadModel and compared:
//   - teacher-forced logits of every prompt, all prompts in one batch of unequal lengths, within
//     1e-4 (float32 checkpoints, and cases whose reference.json asks for float32 compute) or
//     2e-2 (bfloat16) of max |logit| (max abs difference);
//   - the same logits when each prompt is fed in prefill chunks of a few tokens and then decoded
//     one token per step (all prompts in one batch per step, prefill and decode rows mixed): the
//     KV cache and, for linear-attention layers, the recurrent state carried across steps;
//   - greedy continuations, one prompt at a time and all together: token-identical for float32
//     checkpoints (bf16 ones only report their agreement; rounding flips near-ties there);
//   - for models with linear-attention layers: the longest prompt in one chunk (the chunked
//     delta rule) and token by token (the recurrent one) agree, and a state that is lost
//     half-way (a negative control) does not.
// With no case folders present the test is skipped, not passed.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/npy.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> Cases() {
  std::vector<fs::path> roots;
  for (const char* var : {"TEST_SRCDIR"}) {
    const char* v = std::getenv(var);
    if (v != nullptr) roots.push_back(fs::path(v) / "moe_offload" / "engine" / "testdata");
  }
  roots.push_back("engine/testdata");
  std::vector<fs::path> cases;
  for (const fs::path& root : roots) {
    std::error_code ec;
    if (!fs::is_directory(root, ec)) continue;
    for (const auto& entry : fs::directory_iterator(root)) {
      if (fs::exists(entry.path() / "reference.json")) cases.push_back(entry.path());
    }
    if (!cases.empty()) break;
  }
  std::sort(cases.begin(), cases.end());
  return cases;
}

nlohmann::json ReadJson(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

// Whether the case is computed (and held to the tolerance of) float32: float32 checkpoints, and
// cases whose reference.json sets "compute": "float32" (a bf16 checkpoint run with f32 dense
// weights and activations).
bool IsF32(const nlohmann::json& ref) {
  const std::string d = ref.value("compute", ref.value("dtype", ""));
  return d == "float32" || d == "torch.float32" || d == "fp32";
}

// A case's model on the CPU, with a KV cache and (for linear-attention layers) a state slot for
// each of `sequences` sequences of up to `positions` tokens.
struct CaseModel {
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<common::ThreadPool> pool;
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;
  std::unique_ptr<LinearAttentionState> state;
  std::vector<std::vector<int32_t>> tables;  // one block table per sequence
  static constexpr int kBlock = 16;

  static absl::StatusOr<CaseModel> Load(const fs::path& dir, bool f32, int sequences,
                                        int positions) {
    CaseModel m;
    LoadOptions lo;
    lo.dense_dtype = f32 ? DType::kF32 : DType::kBf16;
    lo.progress = false;
    lo.threads = 2;
    ASSIGN_OR_RETURN(m.weights, LoadModel(dir.string(), lo));
    const ModelConfig& c = m.weights->config;
    m.pool = std::make_unique<common::ThreadPool>(2);
    std::vector<cpu_moe::ExpertBank> banks;
    for (int i = 0; i < c.NumMoeLayers(); ++i) banks.push_back(m.weights->ExpertBankFor(i));
    m.backend = std::make_unique<CpuExpertBackend>(
        banks, CpuExpertBackend::DefaultOptions(true, f32), m.pool.get());
    ASSIGN_OR_RETURN(m.model, Model::Create(m.weights.get(), m.backend.get(), m.pool.get(),
                                            /*deterministic=*/false, positions));
    const int per_seq = (positions + kBlock - 1) / kBlock;
    ASSIGN_OR_RETURN(m.kv, KvCache::Create(std::max(1, c.NumKvLayers()), c.num_key_value_heads,
                                           c.head_dim, kBlock, sequences * per_seq));
    if (c.NumLinearAttentionLayers() > 0) {
      ASSIGN_OR_RETURN(m.state, LinearAttentionState::Create(c, sequences));
    }
    m.tables.resize(sequences);
    for (auto& t : m.tables) m.kv->Allocate(per_seq, &t);
    return m;
  }

  absl::Status Forward(absl::Span<const Model::Chunk> chunks, std::vector<float>* logits) {
    return model->Forward(chunks, kv.get(), logits, state.get());
  }
};

// max |a - b| / max |b| over b's elements.
double RelDiff(const float* a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t j = 0; j < b.size(); ++j) {
    diff = std::max(diff, static_cast<double>(std::abs(a[j] - b[j])));
    scale = std::max(scale, static_cast<double>(std::abs(b[j])));
  }
  return diff / scale;
}

std::vector<float> ReadLogits(const fs::path& dir, size_t i) {
  auto npy = common::ReadNpy((dir / ("logits_" + std::to_string(i) + ".npy")).string());
  EXPECT_TRUE(npy.ok()) << npy.status();
  if (!npy.ok()) return {};
  EXPECT_EQ(npy->dtype, common::NpyDtype::kFloat32);
  return npy->f32;
}

TEST(HfFixtureTest, TeacherForcedLogitsMatchTransformers) {
  const auto cases = Cases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = ReadJson(dir / "reference.json");
    const bool f32 = IsF32(ref);
    std::vector<std::vector<int32_t>> prompts =
        ref.at("prompts").get<std::vector<std::vector<int32_t>>>();
    size_t longest = 1;
    for (const auto& p : prompts) longest = std::max(longest, p.size());
    auto m = CaseModel::Load(dir, f32, static_cast<int>(prompts.size()), static_cast<int>(longest));
    ASSERT_TRUE(m.ok()) << m.status();
    const ModelConfig& c = m->weights->config;
    std::vector<Model::Chunk> chunks;
    for (size_t i = 0; i < prompts.size(); ++i) {
      chunks.push_back({prompts[i], 0, &m->tables[i], Model::Logits::kAll, static_cast<int>(i)});
    }
    std::vector<float> logits;
    ASSERT_TRUE(m->Forward(chunks, &logits).ok());
    size_t row = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<float> want = ReadLogits(dir, i);
      ASSERT_EQ(want.size(), prompts[i].size() * c.vocab_size);
      const double rel = RelDiff(logits.data() + row * c.vocab_size, want);
      const double tol = f32 ? 1e-4 : 2e-2;
      EXPECT_LE(rel, tol) << "prompt " << i;
      std::printf("%s prompt %zu: max abs diff / max |logit| = %.3g\n", dir.filename().c_str(), i,
                  rel);
      row += prompts[i].size();
    }
  }
}

TEST(HfFixtureTest, ChunkedPrefillThenDecodeMatchTransformers) {
  // Each prompt's first half in prefill chunks of kChunk tokens, the rest one token per step;
  // every step runs all prompts together, so prefill chunks and decode rows share batches.
  constexpr int kChunk = 7;
  const auto cases = Cases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = ReadJson(dir / "reference.json");
    const bool f32 = IsF32(ref);
    std::vector<std::vector<int32_t>> prompts =
        ref.at("prompts").get<std::vector<std::vector<int32_t>>>();
    size_t longest = 1;
    for (const auto& p : prompts) longest = std::max(longest, p.size());
    auto m = CaseModel::Load(dir, f32, static_cast<int>(prompts.size()), static_cast<int>(longest));
    ASSERT_TRUE(m.ok()) << m.status();
    const int V = m->weights->config.vocab_size;
    std::vector<std::vector<float>> got(prompts.size());
    std::vector<size_t> done(prompts.size(), 0);
    int steps = 0;
    for (bool more = true; more;) {
      std::vector<Model::Chunk> chunks;
      std::vector<size_t> which;
      for (size_t i = 0; i < prompts.size(); ++i) {
        const size_t n = prompts[i].size();
        if (done[i] == n) continue;
        const size_t take = done[i] < n / 2 ? std::min<size_t>(kChunk, n / 2 - done[i]) : 1;
        chunks.push_back({absl::MakeConstSpan(prompts[i]).subspan(done[i], take),
                          static_cast<int>(done[i]), &m->tables[i], Model::Logits::kAll,
                          static_cast<int>(i)});
        which.push_back(i);
      }
      std::vector<float> logits;
      ASSERT_TRUE(m->Forward(chunks, &logits).ok());
      ++steps;
      size_t row = 0;
      for (size_t k = 0; k < chunks.size(); ++k) {
        const size_t n = chunks[k].tokens.size();
        got[which[k]].insert(got[which[k]].end(), logits.begin() + row * V,
                             logits.begin() + (row + n) * V);
        done[which[k]] += n;
        row += n;
      }
      more = false;
      for (size_t i = 0; i < prompts.size(); ++i) more |= done[i] < prompts[i].size();
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<float> want = ReadLogits(dir, i);
      ASSERT_EQ(got[i].size(), want.size());
      const double rel = RelDiff(got[i].data(), want);
      EXPECT_LE(rel, f32 ? 1e-4 : 2e-2) << "prompt " << i;
      std::printf("%s prompt %zu, chunks of %d then decode (%d steps): rel diff %.3g\n",
                  dir.filename().c_str(), i, kChunk, steps, rel);
    }
  }
}

TEST(HfFixtureTest, RecurrentDecodeMatchesChunkedPrefill) {
  const auto cases = Cases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  int tested = 0;
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = ReadJson(dir / "reference.json");
    const bool f32 = IsF32(ref);
    std::vector<std::vector<int32_t>> prompts =
        ref.at("prompts").get<std::vector<std::vector<int32_t>>>();
    std::vector<int32_t> prompt;
    for (const auto& p : prompts) {
      if (p.size() > prompt.size()) prompt = p;
    }
    const int n = static_cast<int>(prompt.size());
    auto m = CaseModel::Load(dir, f32, 3, n);
    ASSERT_TRUE(m.ok()) << m.status();
    if (m->weights->config.NumLinearAttentionLayers() == 0) continue;
    ++tested;
    const int V = m->weights->config.vocab_size;
    // Slot 0: the whole prompt in one chunk (the chunked delta rule over its 64-token chunks).
    std::vector<float> chunked;
    const Model::Chunk whole{prompt, 0, &m->tables[0], Model::Logits::kAll, 0};
    ASSERT_TRUE(m->Forward({&whole, 1}, &chunked).ok());
    // Slot 1: token by token (the recurrent rule); slot 2 likewise, but its recurrent state is
    // lost half-way (a negative control: the state must matter).
    std::vector<float> recurrent, lost;
    for (int t = 0; t < n; ++t) {
      if (t == n / 2) {
        const int layers = m->state->num_layers();
        const auto& la = m->weights->config.linear;
        for (int l = 0; l < layers; ++l) {
          float* s = m->state->recurrent(l, 2);
          std::fill(
              s, s + static_cast<size_t>(la.num_value_heads) * la.key_head_dim * la.value_head_dim,
              0.0f);
        }
      }
      const Model::Chunk one{absl::MakeConstSpan(prompt).subspan(t, 1), t, &m->tables[1],
                             Model::Logits::kAll, 1};
      const Model::Chunk other{absl::MakeConstSpan(prompt).subspan(t, 1), t, &m->tables[2],
                               Model::Logits::kAll, 2};
      std::vector<float> logits;
      ASSERT_TRUE(m->Forward({one, other}, &logits).ok());
      recurrent.insert(recurrent.end(), logits.begin(), logits.begin() + V);
      lost.insert(lost.end(), logits.begin() + V, logits.end());
    }
    const double agree = RelDiff(recurrent.data(), chunked);
    const double control = RelDiff(lost.data(), chunked);
    std::printf("%s: %d tokens, recurrent vs chunked rel diff %.3g; state lost half-way %.3g\n",
                dir.filename().c_str(), n, agree, control);
    EXPECT_LE(agree, f32 ? 1e-5 : 2e-2);
    EXPECT_GE(control, 1e-2);
  }
  if (tested == 0) GTEST_SKIP() << "no case with linear-attention layers";
}

TEST(HfFixtureTest, GreedyContinuationsMatchTransformers) {
  const auto cases = Cases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = ReadJson(dir / "reference.json");
    if (!ref.contains("greedy")) continue;
    const bool f32 = IsF32(ref);
    ModelEngineOptions o;
    o.model_dir = dir.string();
    o.deterministic = true;
    o.dense_f32 = f32;
    o.threads = 2;
    o.max_batch = 16;
    auto engine = CreateModelEngine(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (bool together : {false, true}) {
      std::map<uint64_t, std::vector<int32_t>> got;
      std::vector<std::pair<uint64_t, std::vector<int32_t>>> want;
      for (const auto& g : ref.at("greedy")) {
        GenerationRequest r;
        r.prompt_ids = g.at("prompt").get<std::vector<int32_t>>();
        const auto out = g.at("output").get<std::vector<int32_t>>();
        r.sampling.max_tokens = std::max<int>(1, out.size());
        r.on_event = [&got](const GenerationEvent& e) {
          auto& v = got[e.request_id];
          v.insert(v.end(), e.token_ids.begin(), e.token_ids.end());
        };
        auto id = (*engine)->Submit(std::move(r));
        ASSERT_TRUE(id.ok()) << id.status();
        want.push_back({*id, out});
        if (!together) {
          while ((*engine)->HasWork()) ASSERT_TRUE((*engine)->Step().ok());
        }
      }
      while ((*engine)->HasWork()) ASSERT_TRUE((*engine)->Step().ok());
      for (const auto& [id, out] : want) {
        size_t agree = 0;
        while (agree < out.size() && agree < got[id].size() && got[id][agree] == out[agree]) {
          ++agree;
        }
        std::printf("%s greedy (%s): %zu of %zu tokens agree\n", dir.filename().c_str(),
                    together ? "batched" : "alone", agree, out.size());
        if (f32) {
          EXPECT_EQ(got[id], out) << (together ? "batched" : "alone");
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe::engine
