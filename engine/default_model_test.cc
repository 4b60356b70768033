// The embedded default model (models/tiny_qwen3_moe) against what transformers computed from it
// (its REFERENCE.json): held-out perplexity on Debian's fortunes (the split of
// tools/reference/fortune_split.py, re-implemented here) within 0.5% of transformers', the greedy
// continuations token for token in the deterministic mode, and the perplexity with q4_0 experts
// within a stated margin.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/formats.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "engine/model_engine.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

namespace fs = std::filesystem;

constexpr char kFortunes[] = "/usr/share/games/fortunes";
constexpr int kWindow = 256;  // REFERENCE.json's heldout.how

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// fortune_split.py's rules 1-3: the held-out entries (i % 10 == 9) in order. Entries stay bytes
// here; the tokenizer replaces invalid UTF-8 as Python's decode('utf-8', 'replace') does.
std::vector<std::string> HeldOutEntries() {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(kFortunes)) {
    const std::string n = e.path().filename().string();
    if (n.find('.') == std::string::npos && e.is_regular_file() && !e.is_symlink()) {
      names.push_back(n);
    }
  }
  std::sort(names.begin(), names.end());  // byte-wise
  std::vector<std::string> held;
  int index = 0;
  for (const std::string& n : names) {
    std::string text = ReadFile(fs::path(kFortunes) / n);
    text.erase(std::remove(text.begin(), text.end(), '\r'), text.end());
    std::vector<std::string> lines;
    size_t start = 0;
    while (true) {
      const size_t nl = text.find('\n', start);
      lines.push_back(text.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
      if (nl == std::string::npos) break;
      start = nl + 1;
    }
    lines.push_back("%");
    std::string cur;
    bool any = false;
    for (const std::string& line : lines) {
      if (line == "%") {
        std::string entry = cur;
        while (!entry.empty() && std::string(" \t\n\v\f").find(entry.back()) != std::string::npos) {
          entry.pop_back();
        }
        if (!entry.empty()) {
          if (index % 10 == 9) held.push_back(entry);
          ++index;
        }
        cur.clear();
        any = false;
      } else {
        if (any) cur += '\n';
        cur += line;
        any = true;
      }
    }
  }
  return held;
}

class DefaultModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = DefaultModelDir();
    if (dir_.empty() || !fs::exists(fs::path(dir_) / "REFERENCE.json")) {
      GTEST_SKIP() << "the default model (models/tiny_qwen3_moe) is not present";
    }
    ref_ = nlohmann::json::parse(ReadFile(fs::path(dir_) / "REFERENCE.json"));
  }

  // Mean NLL over all full windows of the held-out stream, each from position 0.
  double MeanNll(common::WeightFormat format) {
    auto tok = tokenizer::Tokenizer::FromDirectory(dir_);
    EXPECT_TRUE(tok.ok()) << tok.status();
    const auto eot = (*tok)->TokenToId("<|endoftext|>");
    EXPECT_TRUE(eot.has_value());
    std::vector<int32_t> stream;
    for (const std::string& e : HeldOutEntries()) {
      const auto ids = (*tok)->Encode(e, false);
      stream.insert(stream.end(), ids.begin(), ids.end());
      stream.push_back(*eot);
    }
    const auto& h = ref_.at("heldout");
    EXPECT_EQ(static_cast<int64_t>(stream.size()), h.at("stream_tokens").get<int64_t>());
    int64_t sum = 0;
    for (int32_t t : stream) sum += t;
    EXPECT_EQ(sum, h.at("stream_ids_sum").get<int64_t>());
    LoadOptions lo;
    lo.expert_format = format;
    lo.dense_dtype = DType::kF32;  // bf16 weights, f32 arithmetic, as transformers ran them
    lo.progress = false;
    lo.threads = 2;
    auto w = LoadModel(dir_, lo);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return NAN;
    const ModelConfig& c = (*w)->config;
    common::ThreadPool pool(2);
    std::vector<cpu_moe::ExpertBank> banks;
    for (int i = 0; i < c.NumMoeLayers(); ++i) banks.push_back((*w)->ExpertBankFor(i));
    CpuExpertBackend backend(banks, CpuExpertBackend::DefaultOptions(false, true), &pool);
    auto model = Model::Create(w->get(), &backend, &pool, false, kWindow);
    EXPECT_TRUE(model.ok()) << model.status();
    constexpr int kBatch = 8;
    const int bs = 16;
    auto kv = KvCache::Create(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, bs,
                              kBatch * kWindow / bs);
    EXPECT_TRUE(kv.ok());
    std::vector<std::vector<int32_t>> tables(kBatch);
    for (auto& t : tables) (*kv)->Allocate(kWindow / bs, &t);
    const int windows = static_cast<int>(stream.size() / kWindow);
    EXPECT_EQ(windows, h.at("windows").get<int>());
    double total = 0;
    std::vector<float> logits;
    const int V = c.vocab_size;
    for (int w0 = 0; w0 < windows; w0 += kBatch) {
      std::vector<Model::Chunk> chunks;
      for (int b = 0; b < kBatch && w0 + b < windows; ++b) {
        chunks.push_back({absl::MakeConstSpan(stream.data() + (w0 + b) * kWindow, kWindow), 0,
                          &tables[b], Model::Logits::kAll});
      }
      logits.clear();
      EXPECT_TRUE((*model)->Forward(chunks, kv->get(), &logits).ok());
      for (size_t b = 0; b < chunks.size(); ++b) {
        for (int t = 0; t + 1 < kWindow; ++t) {
          const float* l = logits.data() + (b * kWindow + t) * static_cast<size_t>(V);
          const float m = *std::max_element(l, l + V);
          double s = 0;
          for (int v = 0; v < V; ++v) s += std::exp(static_cast<double>(l[v]) - m);
          total += m + std::log(s) - l[chunks[b].tokens[t + 1]];
        }
      }
    }
    return total / (static_cast<double>(windows) * (kWindow - 1));
  }

  std::string dir_;
  nlohmann::json ref_;
};

TEST_F(DefaultModelTest, HeldOutPerplexityWithinHalfAPercentOfTransformers) {
  const double nll = MeanNll(common::WeightFormat::kBf16);
  const double ppl = std::exp(nll), want = ref_["heldout"]["perplexity"].get<double>();
  std::printf("held-out perplexity: ours %.4f, transformers %.4f\n", ppl, want);
  EXPECT_NEAR(ppl, want, 0.005 * want);
}

// q4_0 experts: the stated margin is 5% of transformers' (bf16) perplexity.
TEST_F(DefaultModelTest, Q4_0PerplexityWithinFivePercent) {
  const double ppl = std::exp(MeanNll(common::WeightFormat::kQ4_0));
  const double want = ref_["heldout"]["perplexity"].get<double>();
  std::printf("held-out perplexity with q4_0 experts: %.4f (transformers, bf16: %.4f)\n", ppl,
              want);
  EXPECT_NEAR(ppl, want, 0.05 * want);
}

TEST_F(DefaultModelTest, DeterministicGreedyEqualsTransformers) {
  ModelEngineOptions o;
  o.model_dir = dir_;
  o.deterministic = true;
  o.dense_f32 = true;
  o.threads = 2;
  auto engine = CreateModelEngine(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::map<uint64_t, std::vector<int32_t>> got;
  std::vector<std::pair<uint64_t, std::vector<int32_t>>> want;
  for (const auto& g : ref_.at("greedy").at("cases")) {
    GenerationRequest r;
    r.prompt_ids = g.at("prompt_ids").get<std::vector<int32_t>>();
    const auto out = g.at("output_ids").get<std::vector<int32_t>>();
    r.sampling.max_tokens = static_cast<int>(out.size());
    r.sampling.ignore_eos = true;
    r.on_event = [&got](const GenerationEvent& e) {
      auto& v = got[e.request_id];
      v.insert(v.end(), e.token_ids.begin(), e.token_ids.end());
    };
    auto id = (*engine)->Submit(std::move(r));
    ASSERT_TRUE(id.ok()) << id.status();
    want.push_back({*id, out});
  }
  while ((*engine)->HasWork()) ASSERT_TRUE((*engine)->Step().ok());
  for (const auto& [id, out] : want) EXPECT_EQ(got[id], out) << "request " << id;
}

}  // namespace
}  // namespace moe::engine
