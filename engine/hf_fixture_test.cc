// The engine against Hugging Face transformers: every case folder under engine/testdata/ (an HF
// model folder plus reference.json and logits_<i>.npy, made by the reference scripts with
// transformers) is loaded with LoadModel and compared:
//   - teacher-forced logits of every prompt, all prompts in one batch of unequal lengths, within
//     1e-4 (float32 checkpoints) or 2e-2 (bfloat16) of max |logit| (max abs difference);
//   - greedy continuations, one prompt at a time and all together: token-identical for float32
//     checkpoints (bf16 ones only report their agreement; rounding flips near-ties there).
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

#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "common/npy.h"
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

bool IsF32(const nlohmann::json& ref) {
  const std::string d = ref.value("dtype", "");
  return d == "float32" || d == "torch.float32" || d == "fp32";
}

TEST(HfFixtureTest, TeacherForcedLogitsMatchTransformers) {
  const auto cases = Cases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    const nlohmann::json ref = ReadJson(dir / "reference.json");
    const bool f32 = IsF32(ref);
    LoadOptions lo;
    lo.dense_dtype = f32 ? DType::kF32 : DType::kBf16;
    lo.progress = false;
    lo.threads = 2;
    auto w = LoadModel(dir.string(), lo);
    ASSERT_TRUE(w.ok()) << w.status();
    const ModelConfig& c = (*w)->config;
    common::ThreadPool pool(2);
    std::vector<cpu_moe::ExpertBank> banks;
    for (int i = 0; i < c.NumMoeLayers(); ++i) banks.push_back((*w)->ExpertBankFor(i));
    CpuExpertBackend backend(banks, CpuExpertBackend::DefaultOptions(true, f32), &pool);
    std::vector<std::vector<int32_t>> prompts =
        ref.at("prompts").get<std::vector<std::vector<int32_t>>>();
    size_t longest = 1;
    for (const auto& p : prompts) longest = std::max(longest, p.size());
    auto model = Model::Create(w->get(), &backend, &pool, /*deterministic=*/false,
                               static_cast<int>(longest));
    ASSERT_TRUE(model.ok()) << model.status();
    const int bs = 16;
    auto kv = KvCache::Create(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, bs,
                              static_cast<int>(prompts.size() * ((longest + bs - 1) / bs)));
    ASSERT_TRUE(kv.ok());
    std::vector<std::vector<int32_t>> tables(prompts.size());
    std::vector<Model::Chunk> chunks;
    for (size_t i = 0; i < prompts.size(); ++i) {
      (*kv)->Allocate(static_cast<int>((prompts[i].size() + bs - 1) / bs), &tables[i]);
      chunks.push_back({prompts[i], 0, &tables[i], Model::Logits::kAll});
    }
    std::vector<float> logits;
    ASSERT_TRUE((*model)->Forward(chunks, kv->get(), &logits).ok());
    size_t row = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto npy = common::ReadNpy((dir / ("logits_" + std::to_string(i) + ".npy")).string());
      ASSERT_TRUE(npy.ok()) << npy.status();
      ASSERT_EQ(npy->dtype, common::NpyDtype::kFloat32);
      const std::vector<float>* want = &npy->f32;
      ASSERT_EQ(want->size(), prompts[i].size() * c.vocab_size);
      double diff = 0, scale = 0;
      for (size_t j = 0; j < want->size(); ++j) {
        diff = std::max(diff,
                        static_cast<double>(std::abs(logits[row * c.vocab_size + j] - (*want)[j])));
        scale = std::max(scale, static_cast<double>(std::abs((*want)[j])));
      }
      const double tol = f32 ? 1e-4 : 2e-2;
      EXPECT_LE(diff / scale, tol)
          << "prompt " << i << ": max abs diff " << diff << ", max |logit| " << scale;
      std::printf("%s prompt %zu: max abs diff / max |logit| = %.3g\n", dir.filename().c_str(), i,
                  diff / scale);
      row += prompts[i].size();
    }
  }
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
