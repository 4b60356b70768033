// GpuModel against the CPU engine and transformers (GPU machine; skipped without a device):
//   - logits of a batch of prompts of unequal lengths (prefill, then decode steps) against the
//     CPU Model on the same weights, within bf16 tolerance, on the embedded default model with
//     bf16 and q4_0 experts;
//   - teacher-forced logits of every HF fixture under engine/testdata against transformers and
//     against the CPU Model;
//   - greedy tokens identical across expert budgets of top_k, half and all experts per layer
//     (the cache's state never changes outputs), with misses counted;
//   - deterministic mode: batched logits bit-identical to solo ones;
//   - start-up failures: a budget or KV cache that does not fit is a clear error.
#include "engine/cuda/gpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/gpu_test_util.h"
#include "common/npy.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/forward_model.h"
#include "engine/kv_cache.h"
#include "engine/loader.h"
#include "engine/model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe::engine::gpu {
namespace {

namespace fs = std::filesystem;

constexpr int kBlock = 16;

// The embedded default model (models/tiny_qwen3_moe): $MOE_DEFAULT_MODEL_DIR, the test's
// runfiles, or the working directory.
std::string DefaultModelDir() {
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("MOE_DEFAULT_MODEL_DIR"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  }
  if (const char* v = std::getenv("TEST_SRCDIR"); v != nullptr) {
    candidates.push_back(fs::path(v) / "moe_offload" / "models" / "tiny_qwen3_moe");
  }
  candidates.push_back("models/tiny_qwen3_moe");
  std::error_code ec;
  for (const fs::path& p : candidates) {
    if (fs::exists(p / "config.json", ec)) return p.string();
  }
  return "";
}

std::unique_ptr<ModelWeights> Load(const std::string& dir, common::WeightFormat format) {
  LoadOptions lo;
  lo.expert_format = format;
  lo.dense_dtype = DType::kBf16;
  lo.progress = false;
  lo.threads = 2;
  auto w = LoadModel(dir, lo);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : nullptr;
}

GpuModelOptions SmallOptions(int max_context) {
  GpuModelOptions o;
  o.max_batch = 8;
  o.max_step_tokens = 64;
  o.max_context = max_context;
  o.kv_block_size = kBlock;
  o.kv_blocks = 8 * ((max_context + kBlock - 1) / kBlock);
  o.print_plan = false;
  return o;
}

// The CPU model over a host KV cache (the reference).
struct CpuRef {
  std::unique_ptr<common::ThreadPool> pool;
  std::vector<cpu_moe::ExpertBank> banks;
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;

  CpuRef(const ModelWeights& w, int max_context, int blocks) {
    pool = std::make_unique<common::ThreadPool>(2);
    for (int i = 0; i < w.config.NumMoeLayers(); ++i) banks.push_back(w.ExpertBankFor(i));
    backend = std::make_unique<CpuExpertBackend>(
        banks, CpuExpertBackend::DefaultOptions(false, false), pool.get());
    auto m = Model::Create(&w, backend.get(), pool.get(), false, max_context);
    EXPECT_TRUE(m.ok()) << m.status();
    model = *std::move(m);
    auto k = KvCache::Create(w.config.num_hidden_layers, w.config.num_key_value_heads,
                             w.config.head_dim, kBlock, blocks);
    EXPECT_TRUE(k.ok());
    kv = *std::move(k);
  }
};

// Max |a - b| / max |b|.
double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, s = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    s = std::max(s, static_cast<double>(std::abs(b[i])));
  }
  return s > 0 ? d / s : d;
}

bool AllFinite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

std::vector<int32_t> Prompt(int n, int seed, int vocab) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 7919 + i * 104729 + 13) % vocab;
  return t;
}

int ArgMax(const float* l, int n) { return static_cast<int>(std::max_element(l, l + n) - l); }

// Prefill of every prompt (one batch), then `steps` greedy decode steps of all sequences
// together (batched) or one sequence at a time; returns every logits row in order and the
// tokens chosen.
struct GreedyRun {
  std::vector<std::vector<float>> logits;  // per Forward call of a sequence
  std::vector<std::vector<int32_t>> tokens;
};

GreedyRun Greedy(ForwardModel& model, const std::vector<std::vector<int32_t>>& prompts, int steps,
           bool batched) {
  GreedyRun run;
  KvBlockAllocator alloc(model.kv_blocks(), model.kv_block_size());
  const int V = model.config().vocab_size;
  const size_t n = prompts.size();
  std::vector<std::vector<int32_t>> seqs = prompts, tables(n);
  run.tokens.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(alloc.Allocate(
        (static_cast<int>(prompts[i].size()) + steps + kBlock) / kBlock, &tables[i]));
  }
  auto step = [&](const std::vector<size_t>& which, bool prefill) {
    std::vector<ModelChunk> chunks;
    for (size_t i : which) {
      const int start = prefill ? 0 : static_cast<int>(seqs[i].size()) - 1;
      chunks.push_back({absl::MakeConstSpan(seqs[i]).subspan(start), start, &tables[i],
                        ChunkLogits::kLast});
    }
    std::vector<float> logits;
    const absl::Status st = model.Forward(chunks, &logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return;
    for (size_t j = 0; j < which.size(); ++j) {
      const float* row = logits.data() + j * V;
      run.logits.emplace_back(row, row + V);
      const int t = ArgMax(row, V);
      seqs[which[j]].push_back(t);
      run.tokens[which[j]].push_back(t);
    }
  };
  std::vector<size_t> all;
  for (size_t i = 0; i < n; ++i) all.push_back(i);
  if (batched) {
    step(all, true);
    for (int s = 0; s < steps; ++s) step(all, false);
  } else {
    for (size_t i : all) {
      step({i}, true);
      for (int s = 0; s < steps; ++s) step({i}, false);
    }
  }
  return run;
}

// A ForwardModel over the CPU reference.
class CpuForward final : public ForwardModel {
 public:
  explicit CpuForward(CpuRef* r) : r_(r) {}
  absl::Status Forward(absl::Span<const ModelChunk> chunks, std::vector<float>* logits) override {
    return r_->model->Forward(chunks, r_->kv.get(), logits);
  }
  const ModelConfig& config() const override { return r_->model->config(); }
  int max_positions() const override { return r_->model->max_positions(); }
  int kv_blocks() const override { return r_->kv->num_blocks(); }
  int kv_block_size() const override { return r_->kv->block_size(); }
  uint64_t memory_bytes() const override { return 0; }
  std::string backend() const override { return "cpu"; }
  void set_routing_override(RoutingOverride*) override {}

 private:
  CpuRef* r_;
};

const std::vector<std::vector<int32_t>> DefaultPrompts(int vocab) {
  return {Prompt(37, 1, vocab), Prompt(5, 2, vocab), Prompt(70, 3, vocab)};
}

TEST(GpuModelTest, DefaultModelLogitsMatchCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const std::string dir = DefaultModelDir();
  ASSERT_FALSE(dir.empty());
  for (auto format : {common::WeightFormat::kBf16, common::WeightFormat::kQ4_0}) {
    SCOPED_TRACE(std::string(common::WeightFormatName(format)));
    auto w = Load(dir, format);
    ASSERT_NE(w, nullptr);
    const int ctx = 128;
    auto gm = GpuModel::Create(w.get(), w->experts.get(), SmallOptions(ctx));
    ASSERT_TRUE(gm.ok()) << gm.status();
    CpuRef ref(*w, ctx, 8 * ctx / kBlock);
    CpuForward cpu(&ref);
    const auto prompts = DefaultPrompts(w->config.vocab_size);
    const GreedyRun g = Greedy(**gm, prompts, 6, true);
    const GreedyRun c = Greedy(cpu, prompts, 6, true);
    ASSERT_EQ(g.logits.size(), c.logits.size());
    // Rows are step-major (prefill, then each decode step, sequence by sequence); a row of step
    // s was computed from the same inputs on both sides while every token chosen before step s
    // agrees.
    const size_t n = prompts.size();
    size_t agree_steps = g.tokens[0].size();
    for (size_t i = 0; i < n; ++i) {
      size_t j = 0;
      while (j < g.tokens[i].size() && j < c.tokens[i].size() && g.tokens[i][j] == c.tokens[i][j]) {
        ++j;
      }
      agree_steps = std::min(agree_steps, j);
    }
    int compared = 0;
    double worst = 0;
    for (size_t i = 0; i < g.logits.size(); ++i) {
      EXPECT_TRUE(AllFinite(g.logits[i]));
      if (i / n > agree_steps) break;
      worst = std::max(worst, RelDiff(g.logits[i], c.logits[i]));
      ++compared;
    }
    std::printf("default model %s: %d logits rows, max abs diff / max |logit| = %.3g; greedy "
                "tokens %s\n",
                std::string(common::WeightFormatName(format)).c_str(), compared, worst,
                g.tokens == c.tokens ? "identical" : "differ");
    EXPECT_LE(worst, 2e-2);
    const GpuCacheStats& st = (*gm)->stats();
    EXPECT_GT(st.routes, 0);
    EXPECT_GT(st.misses, 0);  // a cold cache fetched its experts
  }
}

std::vector<fs::path> FixtureCases() {
  std::vector<fs::path> roots;
  const char* v = std::getenv("TEST_SRCDIR");
  if (v != nullptr) roots.push_back(fs::path(v) / "moe_offload" / "engine" / "testdata");
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

TEST(GpuModelTest, HfFixturesMatchTransformersAndCpu) {
  MOE_SKIP_WITHOUT_GPU();
  const auto cases = FixtureCases();
  if (cases.empty()) GTEST_SKIP() << "no cases under engine/testdata";
  for (const fs::path& dir : cases) {
    SCOPED_TRACE(dir.filename().string());
    std::ifstream f(dir / "reference.json");
    std::stringstream ss;
    ss << f.rdbuf();
    const nlohmann::json ref = nlohmann::json::parse(ss.str());
    auto w = Load(dir.string(), common::WeightFormat::kBf16);
    ASSERT_NE(w, nullptr);
    const ModelConfig& c = w->config;
    const auto prompts = ref.at("prompts").get<std::vector<std::vector<int32_t>>>();
    int longest = 1;
    for (const auto& p : prompts) longest = std::max<int>(longest, p.size());
    const int ctx = (longest + kBlock - 1) / kBlock * kBlock;
    GpuModelOptions o = SmallOptions(ctx);
    o.max_batch = static_cast<int>(prompts.size());
    o.kv_blocks = static_cast<int>(prompts.size()) * ctx / kBlock;
    auto gm = GpuModel::Create(w.get(), w->experts.get(), o);
    ASSERT_TRUE(gm.ok()) << gm.status();
    CpuRef cpu(*w, ctx, o.kv_blocks);
    KvBlockAllocator alloc(o.kv_blocks, kBlock);
    std::vector<std::vector<int32_t>> tables(prompts.size());
    std::vector<ModelChunk> chunks;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(alloc.Allocate((static_cast<int>(prompts[i].size()) + kBlock - 1) / kBlock,
                                 &tables[i]));
      chunks.push_back({prompts[i], 0, &tables[i], ChunkLogits::kAll});
    }
    std::vector<float> got, want_cpu;
    ASSERT_TRUE((*gm)->Forward(chunks, &got).ok());
    ASSERT_TRUE(cpu.model->Forward(chunks, cpu.kv.get(), &want_cpu).ok());
    EXPECT_TRUE(AllFinite(got));
    size_t row = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto npy = common::ReadNpy((dir / ("logits_" + std::to_string(i) + ".npy")).string());
      ASSERT_TRUE(npy.ok()) << npy.status();
      const size_t n = prompts[i].size() * c.vocab_size;
      ASSERT_EQ(npy->f32.size(), n);
      const std::vector<float> g(got.begin() + row, got.begin() + row + n);
      const std::vector<float> cw(want_cpu.begin() + row, want_cpu.begin() + row + n);
      const double vs_hf = RelDiff(g, npy->f32), vs_cpu = RelDiff(g, cw);
      std::printf("%s prompt %zu: GPU vs transformers %.3g, GPU vs CPU (bf16 dense) %.3g\n",
                  dir.filename().c_str(), i, vs_hf, vs_cpu);
      // bf16 weights and activations on the GPU, whatever the checkpoint's dtype.
      EXPECT_LE(vs_hf, 3e-2) << "prompt " << i;
      EXPECT_LE(vs_cpu, 2e-2) << "prompt " << i;
      row += n;
    }
  }
}

TEST(GpuModelTest, GreedyTokensIdenticalAcrossExpertBudgets) {
  MOE_SKIP_WITHOUT_GPU();
  const std::string dir = DefaultModelDir();
  ASSERT_FALSE(dir.empty());
  auto w = Load(dir, common::WeightFormat::kBf16);
  ASSERT_NE(w, nullptr);
  const ModelConfig& c = w->config;
  const int K = c.num_experts_per_tok, E = c.num_experts, M = c.NumMoeLayers();
  const uint64_t slot_bytes = w->experts->layout().padded_bytes_per_expert();
  const auto prompts = DefaultPrompts(c.vocab_size);
  std::vector<std::vector<int32_t>> reference;
  for (int slots : {K, E / 2, E}) {
    SCOPED_TRACE(slots);
    GpuModelOptions o = SmallOptions(128);
    o.expert_budget_gib = static_cast<double>(static_cast<uint64_t>(slots) * M * slot_bytes) /
                          static_cast<double>(uint64_t{1} << 30);
    auto gm = GpuModel::Create(w.get(), w->experts.get(), o);
    ASSERT_TRUE(gm.ok()) << gm.status();
    ASSERT_EQ((*gm)->plan().slots_per_layer, slots);
    const GreedyRun r = Greedy(**gm, prompts, 24, /*batched=*/true);
    const GpuCacheStats& st = (*gm)->stats();
    std::printf("slots/layer %d: %lld routes, %lld misses (%.1f%%), %lld ensure calls\n", slots,
                static_cast<long long>(st.routes), static_cast<long long>(st.misses),
                100.0 * st.misses / std::max<int64_t>(1, st.routes),
                static_cast<long long>(st.ensure_calls));
    if (slots < E) {
      // The small cache really evicted: more misses than cold ones.
      EXPECT_GT(st.misses, static_cast<int64_t>(M) * E) << "slots " << slots;
    } else {
      EXPECT_LE(st.misses, static_cast<int64_t>(M) * E);
    }
    if (reference.empty()) {
      reference = r.tokens;
    } else {
      EXPECT_EQ(r.tokens, reference) << "slots per layer " << slots;
    }
  }
}

TEST(GpuModelTest, DeterministicBatchedEqualsSolo) {
  MOE_SKIP_WITHOUT_GPU();
  const std::string dir = DefaultModelDir();
  ASSERT_FALSE(dir.empty());
  auto w = Load(dir, common::WeightFormat::kBf16);
  ASSERT_NE(w, nullptr);
  GpuModelOptions o = SmallOptions(128);
  o.deterministic = true;
  auto gm = GpuModel::Create(w.get(), w->experts.get(), o);
  ASSERT_TRUE(gm.ok()) << gm.status();
  const auto prompts = DefaultPrompts(w->config.vocab_size);
  const int steps = 8;
  const GreedyRun batched = Greedy(**gm, prompts, steps, true);
  const GreedyRun solo = Greedy(**gm, prompts, steps, false);
  ASSERT_EQ(batched.tokens, solo.tokens);
  // Rows: batched is step-major, solo sequence-major.
  const size_t n = prompts.size();
  ASSERT_EQ(batched.logits.size(), n * (steps + 1));
  ASSERT_EQ(solo.logits.size(), n * (steps + 1));
  int differing = 0;
  for (size_t i = 0; i < n; ++i) {
    for (int s = 0; s <= steps; ++s) {
      const auto& a = batched.logits[s * n + i];
      const auto& b = solo.logits[i * (steps + 1) + s];
      if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) ++differing;
    }
  }
  EXPECT_EQ(differing, 0) << "logits rows that differ between batched and solo";
}

TEST(GpuModelTest, StartFailuresAreClearErrors) {
  MOE_SKIP_WITHOUT_GPU();
  auto w = Load(DefaultModelDir(), common::WeightFormat::kBf16);
  ASSERT_NE(w, nullptr);
  // A KV cache far beyond the device: ResourceExhausted naming the KV cache.
  GpuModelOptions o = SmallOptions(2048);
  o.max_batch = 1 << 20;
  o.kv_blocks = 0;
  auto a = GpuModel::Create(w.get(), w->experts.get(), o);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  EXPECT_NE(a.status().message().find("KV cache"), std::string::npos) << a.status();
  // An expert budget below top_k slots per layer: InvalidArgument naming the flag.
  o = SmallOptions(128);
  o.expert_budget_gib = 1e-9;
  auto b = GpuModel::Create(w.get(), w->experts.get(), o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("gpu-expert-budget-gb"), std::string::npos) << b.status();
  // Bad input to Forward: InvalidArgument, and the model keeps working.
  auto gm = GpuModel::Create(w.get(), w->experts.get(), SmallOptions(128));
  ASSERT_TRUE(gm.ok()) << gm.status();
  std::vector<int32_t> table = {0};
  const std::vector<int32_t> bad_token = {w->config.vocab_size};
  std::vector<float> logits;
  ModelChunk ch{bad_token, 0, &table, ChunkLogits::kLast};
  EXPECT_EQ((*gm)->Forward({&ch, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> ok_token = {1};
  ch = {ok_token, 200, &table, ChunkLogits::kLast};
  EXPECT_EQ((*gm)->Forward({&ch, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad_table = {1 << 30};
  ch = {ok_token, 0, &bad_table, ChunkLogits::kLast};
  EXPECT_EQ((*gm)->Forward({&ch, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
  ch = {ok_token, 0, &table, ChunkLogits::kLast};
  ASSERT_TRUE((*gm)->Forward({&ch, 1}, &logits).ok());
  EXPECT_EQ(logits.size(), static_cast<size_t>(w->config.vocab_size));
  EXPECT_TRUE(AllFinite(logits));
}

}  // namespace
}  // namespace moe::engine::gpu
