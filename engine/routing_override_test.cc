// RoutingOverride: the ids the MoE layer receives are the trace's, in order, batch rows taking
// consecutive tokens; the weights are the router's probabilities at those ids (recomputed here in
// float64 from the hidden states the layer saw), renormalised or not as the model does; past the
// trace's end the fitted synthetic generator continues (its fit recovers known parameters, its
// hot experts are the trace's); shape mismatches are errors; the reuse-distance profile on a
// hand-worked trace.
#include "engine/routing_override.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "gtest/gtest.h"
#include "moe_cache/synthetic_trace.h"

namespace moe::engine {
namespace {

using moe_cache::Trace;

ModelConfig TinyConfig(bool qwen2) {
  ModelConfig c;
  c.model_type = qwen2 ? "qwen2_moe" : "qwen3_moe";
  c.vocab_size = 53;
  c.hidden_size = 64;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 96;
  c.num_hidden_layers = qwen2 ? 4 : 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 64;
  c.num_experts = 8;
  c.num_experts_per_tok = 3;
  c.norm_topk_prob = !qwen2;
  c.qk_norm = !qwen2;
  if (qwen2) {
    c.shared_expert_intermediate_size = 64;
    c.attention_bias = true;
    c.decoder_sparse_step = 2;  // layers 1 and 3 are MoE ...
    c.mlp_only_layers = {3};    // ... but 3 is dense: one MoE layer
  }
  return c;
}

// A trace of distinct random ids per row; row (pad_token, last layer) is all padding.
Trace RandomTrace(int tokens, int layers, int k, int experts, uint64_t seed, int pad_token) {
  std::mt19937_64 rng(seed);
  Trace t;
  t.tokens = tokens;
  t.layers = layers;
  t.k = k;
  t.ids.resize(static_cast<size_t>(tokens) * layers * k);
  for (int tok = 0; tok < tokens; ++tok) {
    for (int l = 0; l < layers; ++l) {
      std::vector<int32_t> perm(experts);
      for (int e = 0; e < experts; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < k; ++j) {
        t.ids[(static_cast<size_t>(tok) * layers + l) * k + j] =
            tok == pad_token && l == layers - 1 ? -1 : perm[j];
      }
    }
  }
  return t;
}

// Forwards to the CPU backend and records what the MoE layer handed over.
class RecordingBackend : public ExpertBackend {
 public:
  struct Call {
    int moe_layer, rows;
    std::vector<int32_t> ids;
    std::vector<float> weights, x;
  };
  RecordingBackend(ExpertBackend* inner, int hidden) : inner_(inner), hidden_(hidden) {}
  absl::Status Forward(int moe_layer, int num_tokens, int top_k, absl::Span<const int32_t> ids,
                       absl::Span<const float> weights, const float* x, float* y) override {
    calls.push_back({moe_layer, num_tokens, std::vector<int32_t>(ids.begin(), ids.end()),
                     std::vector<float>(weights.begin(), weights.end()),
                     std::vector<float>(x, x + static_cast<size_t>(num_tokens) * hidden_)});
    return inner_->Forward(moe_layer, num_tokens, top_k, ids, weights, x, y);
  }
  std::string name() const override { return "recording"; }
  std::vector<Call> calls;

 private:
  ExpertBackend* inner_;
  int hidden_;
};

struct Fixture {
  ModelConfig config;
  RandomModel rm;
  common::ThreadPool pool{2};
  std::unique_ptr<CpuExpertBackend> cpu;
  std::unique_ptr<RecordingBackend> rec;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> kv;

  explicit Fixture(const ModelConfig& c) : config(c) {
    RandomModelOptions o;
    o.dense_dtype = DType::kF32;
    o.seed = 11;
    auto m = MakeRandomModel(c, o);
    EXPECT_TRUE(m.ok()) << m.status();
    rm = std::move(*m);
    cpu = std::make_unique<CpuExpertBackend>(rm.banks,
                                             CpuExpertBackend::DefaultOptions(false, true), &pool);
    rec = std::make_unique<RecordingBackend>(cpu.get(), c.hidden_size);
    auto md = Model::Create(rm.weights.get(), rec.get(), &pool, false, c.max_position_embeddings);
    EXPECT_TRUE(md.ok()) << md.status();
    model = std::move(*md);
    auto k = KvCache::Create(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 4, 32);
    EXPECT_TRUE(k.ok()) << k.status();
    kv = std::move(*k);
  }

  // The router's softmax probabilities for hidden state x, in float64.
  std::vector<double> Probs(int moe_layer, const float* x) const {
    const LayerWeights* lw = nullptr;
    for (const LayerWeights& l : rm.weights->layers) {
      if (l.moe_index == moe_layer) lw = &l;
    }
    const int E = config.num_experts, H = config.hidden_size;
    std::vector<double> p(E);
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int e = 0; e < E; ++e) {
      double acc = 0;
      for (int h = 0; h < H; ++h) acc += static_cast<double>(lw->router.At(e, h)) * x[h];
      p[e] = acc;
      mx = std::max(mx, acc);
    }
    for (double& v : p) sum += (v = std::exp(v - mx));
    for (double& v : p) v /= sum;
    return p;
  }
};

// Runs a prefill step (chunks of 3 and 2 tokens) then two decode steps of 2 rows with `routing`
// set: 9 rows in all, in order.
void RunSteps(Fixture& f, RoutingOverride* routing) {
  f.model->set_routing_override(routing);
  const std::vector<int32_t> a = {1, 7, 9}, b = {4, 2};
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(f.kv->Allocate(2, &ta) && f.kv->Allocate(2, &tb));
  std::vector<float> logits;
  std::vector<Model::Chunk> chunks = {{a, 0, &ta, Model::Logits::kLast},
                                      {b, 0, &tb, Model::Logits::kLast}};
  ASSERT_TRUE(f.model->Forward(chunks, f.kv.get(), &logits).ok());
  for (int step = 0; step < 2; ++step) {
    const std::vector<int32_t> na = {static_cast<int32_t>(5 + step)}, nb = {8};
    chunks = {{na, 3 + step, &ta, Model::Logits::kLast}, {nb, 2 + step, &tb, Model::Logits::kLast}};
    logits.clear();
    ASSERT_TRUE(f.model->Forward(chunks, f.kv.get(), &logits).ok());
  }
}

// The ids of every call match `expected` (token-major over all calls of one layer, in order) and
// the weights are the float64 router probabilities at them.
void CheckForcedRouting(const ModelConfig& c) {
  Fixture f(c);
  const int L = c.NumMoeLayers(), k = c.num_experts_per_tok, E = c.num_experts;
  const int trace_tokens = 7;  // 9 rows run: 7 from the trace, 2 from the continuation
  Trace trace = RandomTrace(trace_tokens, L, k, E, 5, /*pad_token=*/4);
  RoutingOverride::Options o;
  o.continuation_chunk = 16;
  auto routing = RoutingOverride::Create(trace, c, o);
  ASSERT_TRUE(routing.ok()) << routing.status();
  // What the continuation holds: an identical override's ids past the trace's end.
  auto twin = RoutingOverride::Create(trace, c, o);
  ASSERT_TRUE(twin.ok());
  std::vector<int32_t> all(static_cast<size_t>(L) * 9 * k);
  ASSERT_TRUE((*twin)->Next(9, absl::MakeSpan(all)).ok());

  RunSteps(f, routing->get());
  ASSERT_EQ(f.rec->calls.size(), 3u * L);
  EXPECT_EQ((*routing)->tokens_served(), 9);
  EXPECT_EQ((*routing)->trace_tokens_served(), trace_tokens);
  EXPECT_EQ((*routing)->synthetic_tokens_served(), 2);
  std::vector<int> token_of_layer(L, 0);
  int padded_rows = 0;
  for (const RecordingBackend::Call& call : f.rec->calls) {
    const int l = call.moe_layer;
    for (int r = 0; r < call.rows; ++r) {
      const int tok = token_of_layer[l]++;
      const int32_t* got = call.ids.data() + static_cast<size_t>(r) * k;
      const int32_t* want = tok < trace_tokens
                                ? trace.Row(tok, l)
                                : all.data() + (static_cast<size_t>(l) * 9 + tok) * k;
      std::vector<double> p = f.Probs(l, call.x.data() + static_cast<size_t>(r) * c.hidden_size);
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += want[j] >= 0 ? p[want[j]] : 0.0;
      bool padded = true;
      for (int j = 0; j < k; ++j) {
        ASSERT_EQ(got[j], want[j]) << "layer " << l << " token " << tok << " slot " << j;
        const float w = call.weights[static_cast<size_t>(r) * k + j];
        if (want[j] < 0) {
          EXPECT_EQ(w, 0.0f);
          continue;
        }
        padded = false;
        EXPECT_GE(want[j], 0);
        EXPECT_LT(want[j], E);
        const double ref = c.norm_topk_prob ? p[want[j]] / sum : p[want[j]];
        // f32 router GEMV over 64 terms and an f32 softmax: far under 1e-5.
        EXPECT_NEAR(w, ref, 1e-5) << "layer " << l << " token " << tok << " slot " << j;
      }
      padded_rows += padded;
      if (tok >= trace_tokens) {  // the continuation: k distinct real experts
        EXPECT_EQ(std::set<int32_t>(got, got + k).size(), static_cast<size_t>(k));
        EXPECT_FALSE(padded);
      }
    }
  }
  for (int l = 0; l < L; ++l) EXPECT_EQ(token_of_layer[l], 9);
  EXPECT_EQ(padded_rows, 1);  // the trace's one padded row reached the layer as padding

  // Without the override the same steps route by the router's top-k again.
  Fixture g(c);
  RunSteps(g, nullptr);
  bool differs = false;
  for (size_t i = 0; i < g.rec->calls.size(); ++i)
    differs |= g.rec->calls[i].ids != f.rec->calls[i].ids;
  EXPECT_TRUE(differs);
}

TEST(RoutingOverrideTest, Qwen3ForcedIdsReachTheMoeLayerWithRenormalisedWeights) {
  CheckForcedRouting(TinyConfig(false));
}

TEST(RoutingOverrideTest, Qwen2DenseLayersSkippedAndWeightsNotRenormalised) {
  CheckForcedRouting(TinyConfig(true));
}

TEST(RoutingOverrideTest, ForcedRouteWeightsWritesEverySlot) {
  const std::vector<float> probs = {0.1f, 0.2f, 0.3f, 0.4f};
  std::vector<float> w(3, std::numeric_limits<float>::quiet_NaN());
  const std::vector<int32_t> ids = {3, -1, 1};
  ASSERT_TRUE(ForcedRouteWeights(probs, ids, true, absl::MakeSpan(w)).ok());
  EXPECT_FLOAT_EQ(w[0], 0.4f / 0.6f);
  EXPECT_EQ(w[1], 0.0f);
  EXPECT_FLOAT_EQ(w[2], 0.2f / 0.6f);
  std::fill(w.begin(), w.end(), std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(ForcedRouteWeights(probs, ids, false, absl::MakeSpan(w)).ok());
  EXPECT_FLOAT_EQ(w[0], 0.4f);
  EXPECT_EQ(w[1], 0.0f);
  EXPECT_FLOAT_EQ(w[2], 0.2f);
  const std::vector<int32_t> pad = {-1, -1, -1};
  std::fill(w.begin(), w.end(), std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(ForcedRouteWeights(probs, pad, true, absl::MakeSpan(w)).ok());
  for (float v : w) EXPECT_EQ(v, 0.0f);
  const std::vector<int32_t> bad = {0, 4, 1};
  EXPECT_EQ(ForcedRouteWeights(probs, bad, true, absl::MakeSpan(w)).code(),
            absl::StatusCode::kInvalidArgument);
}

// Hand-worked: one layer, k = 1, ids 0 1 0 2 1 0 0. Distances: inf inf 1 inf 2 2 0.
TEST(RoutingOverrideTest, ReuseProfileOfAHandWorkedTrace) {
  Trace t;
  t.tokens = 7;
  t.layers = 1;
  t.k = 1;
  t.ids = {0, 1, 0, 2, 1, 0, 0};
  const std::vector<int32_t> slots = {1, 2, 3};
  const ReuseProfile p = MeasureReuseProfile(t, 4, slots);
  EXPECT_DOUBLE_EQ(p.hit_rate[0], 1.0 / 7);
  EXPECT_DOUBLE_EQ(p.hit_rate[1], 2.0 / 7);
  EXPECT_DOUBLE_EQ(p.hit_rate[2], 4.0 / 7);
  EXPECT_DOUBLE_EQ(p.previous_token_reuse, 1.0 / 6);
  EXPECT_DOUBLE_EQ(p.top_eighth_share, 4.0 / 7);  // expert 0: 4 of 7
  // Padding is neither counted nor breaks the distances.
  t.tokens = 8;
  t.ids = {0, 1, 0, -1, 2, 1, 0, 0};
  const ReuseProfile q = MeasureReuseProfile(t, 4, slots);
  EXPECT_DOUBLE_EQ(q.hit_rate[2], 4.0 / 7);
}

// A trace drawn from the generator itself: the fit recovers its parameters, the continuation's
// statistics are the generator's, and its hot experts are the trace's.
TEST(RoutingOverrideTest, ContinuationFitsAndKeepsTheTracesHotExperts) {
  moe_cache::SyntheticTraceConfig sc;
  sc.layers = 4;
  sc.experts = 32;
  sc.k = 4;
  sc.tokens = 400;
  sc.zipf = 1.2;
  sc.reuse = 0.5;
  sc.seed = 77;
  auto trace = moe_cache::GenerateSyntheticTrace(sc);
  ASSERT_TRUE(trace.ok());
  ModelConfig c = TinyConfig(false);
  c.num_hidden_layers = 4;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  RoutingOverride::Options o;
  o.continuation_chunk = 300;  // the 400 continuation tokens below cross a chunk boundary
  auto routing = RoutingOverride::Create(*trace, c, o);
  ASSERT_TRUE(routing.ok()) << routing.status();
  const RoutingCalibration& cal = (*routing)->calibration();
  std::printf("%s\n", cal.Summary().c_str());
  EXPECT_NEAR(cal.zipf, 1.2, 0.25);
  EXPECT_NEAR(cal.reuse, 0.5, 0.1);
  for (size_t i = 0; i < cal.trace.hit_rate.size(); ++i) {
    EXPECT_NEAR(cal.generator.hit_rate[i], cal.trace.hit_rate[i], 0.03) << cal.trace.slots[i];
  }
  // Without relabelling the generator's hot experts would land on the trace's top eighth by
  // chance (about 1/8 of the ids); relabelled they carry the trace's share.
  EXPECT_GT(cal.trace.top_eighth_share, 0.4);
  EXPECT_NEAR(cal.continuation_top_eighth_share, cal.trace.top_eighth_share, 0.1);

  // Serve the trace and 400 tokens past it, in steps of 7 rows.
  const int L = 4, k = 4, total = 800;
  std::vector<int32_t> served;  // token-major [total, L, k]
  served.reserve(static_cast<size_t>(total) * L * k);
  for (int done = 0; done < total;) {
    const int rows = std::min(7, total - done);
    std::vector<int32_t> ids(static_cast<size_t>(L) * rows * k);
    ASSERT_TRUE((*routing)->Next(rows, absl::MakeSpan(ids)).ok());
    for (int r = 0; r < rows; ++r) {
      for (int l = 0; l < L; ++l) {
        for (int j = 0; j < k; ++j)
          served.push_back(ids[(static_cast<size_t>(l) * rows + r) * k + j]);
      }
    }
    done += rows;
  }
  for (size_t i = 0; i < trace->ids.size(); ++i) ASSERT_EQ(served[i], trace->ids[i]) << i;
  Trace cont;
  cont.tokens = 400;
  cont.layers = L;
  cont.k = k;
  cont.ids.assign(served.begin() + trace->ids.size(), served.end());
  // Never a loop of the trace.
  int same_rows = 0;
  for (int t = 0; t < 400; ++t) {
    for (int l = 0; l < L; ++l) {
      same_rows += std::equal(cont.Row(t, l), cont.Row(t, l) + k, trace->Row(t, l));
    }
  }
  EXPECT_LT(same_rows, 400 * L / 10);
  // Its reuse-distance profile is the fitted generator's (same length; sampling noise only).
  const ReuseProfile p = MeasureReuseProfile(cont, 32, cal.trace.slots);
  for (size_t i = 0; i < p.hit_rate.size(); ++i) {
    EXPECT_NEAR(p.hit_rate[i], cal.generator.hit_rate[i], 0.05) << cal.trace.slots[i];
  }
  EXPECT_NEAR(p.previous_token_reuse, cal.generator.previous_token_reuse, 0.05);
  // Rewind: the same pass again, continuation included.
  (*routing)->Rewind();
  std::vector<int32_t> again(static_cast<size_t>(L) * total * k);
  ASSERT_TRUE((*routing)->Next(total, absl::MakeSpan(again)).ok());
  for (int t = 0; t < total; ++t) {
    for (int l = 0; l < L; ++l) {
      for (int j = 0; j < k; ++j) {
        ASSERT_EQ(again[(static_cast<size_t>(l) * total + t) * k + j],
                  served[(static_cast<size_t>(t) * L + l) * k + j]);
      }
    }
  }
}

TEST(RoutingOverrideTest, GivenParametersSkipTheFit) {
  moe_cache::SyntheticTraceConfig sc;
  sc.layers = 4;
  sc.experts = 32;
  sc.k = 4;
  sc.tokens = 50;
  sc.zipf = 1.2;
  sc.reuse = 0.5;
  auto trace = moe_cache::GenerateSyntheticTrace(sc);
  ASSERT_TRUE(trace.ok());
  ModelConfig c = TinyConfig(false);
  c.num_hidden_layers = 4;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  RoutingOverride::Options o;
  o.zipf = 0.7;
  o.reuse = 0.25;
  auto routing = RoutingOverride::Create(*trace, c, o);
  ASSERT_TRUE(routing.ok()) << routing.status();
  const RoutingCalibration& cal = (*routing)->calibration();
  EXPECT_EQ(cal.zipf, 0.7);
  EXPECT_EQ(cal.reuse, 0.25);
  EXPECT_TRUE(cal.generator.hit_rate.empty());
  EXPECT_NE(cal.Summary().find("as given"), std::string::npos) << cal.Summary();
  // The trace, then the continuation: valid, distinct ids per row.
  std::vector<int32_t> ids(4 * 80 * 4);
  ASSERT_TRUE((*routing)->Next(80, absl::MakeSpan(ids)).ok());
  for (int row = 0; row < 4 * 80; ++row) {
    std::set<int32_t> seen(ids.begin() + 4 * row, ids.begin() + 4 * row + 4);
    EXPECT_EQ(seen.size(), 4u);
    for (int32_t id : seen) EXPECT_TRUE(id >= 0 && id < 32);
  }
  EXPECT_EQ((*routing)->synthetic_tokens_served(), 30);
}

TEST(RoutingOverrideTest, ShapeMismatchesAreClearErrors) {
  const ModelConfig c = TinyConfig(false);  // 3 MoE layers, top-3 of 8
  auto message = [&](const Trace& t) {
    auto r = RoutingOverride::Create(t, c, {});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  EXPECT_NE(message(RandomTrace(4, 2, 3, 8, 1, -1)).find("2 MoE layers, the model 3"),
            std::string::npos);
  EXPECT_NE(message(RandomTrace(4, 3, 2, 8, 1, -1)).find("routes 2 experts per token"),
            std::string::npos);
  Trace wide = RandomTrace(4, 3, 3, 8, 1, -1);
  wide.ids[0] = 8;
  EXPECT_NE(message(wide).find("routes expert 8, the model has 8 experts"), std::string::npos);
  Trace dup = RandomTrace(4, 3, 3, 8, 1, -1);
  dup.ids[3 * 5 + 1] = dup.ids[3 * 5];
  EXPECT_NE(message(dup).find("twice"), std::string::npos);
  EXPECT_NE(message(Trace{}).find("no tokens"), std::string::npos);
  auto missing = RoutingOverride::FromFile("/nonexistent/trace.npy", c, {});
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/trace.npy"), std::string::npos);

  // An override made for another model's shape is refused by Forward.
  ModelConfig other = c;
  other.num_experts_per_tok = 2;
  auto routing = RoutingOverride::Create(RandomTrace(4, 3, 2, 8, 1, -1), other, {});
  ASSERT_TRUE(routing.ok()) << routing.status();
  Fixture f(c);
  f.model->set_routing_override(routing->get());
  std::vector<int32_t> table, tokens = {1, 2};
  ASSERT_TRUE(f.kv->Allocate(1, &table));
  std::vector<float> logits;
  Model::Chunk chunk{tokens, 0, &table, Model::Logits::kLast};
  EXPECT_EQ(f.model->Forward({&chunk, 1}, f.kv.get(), &logits).code(),
            absl::StatusCode::kInvalidArgument);
  // A span of the wrong size.
  std::vector<int32_t> ids(5);
  EXPECT_EQ((*routing)->Next(1, absl::MakeSpan(ids)).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::engine
