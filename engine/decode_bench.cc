// decode_bench: prefill and decode speed of the CPU engine's forward pass on a model of
// Qwen3-30B-A3B's shape with random weights (48 layers, hidden 2048, 128 experts top-8, expert
// intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151936), made in memory and filled
// fast (a few random experts copied over the rest), with experts in bf16 and q4_0.
//
// Beside each figure: the DRAM roofline, i.e. the DRAM read bandwidth measured in the same run
// (common/membw.h, read beside each case) divided by the bytes one token touches (dense weights,
// the LM head, the distinct experts the routes touched (counted per call), the KV cache read),
// and the fraction of it reached.
//
// --routing-trace FILE.npy (int [tokens, 48 MoE layers, k], moe_cache/trace.h) replaces the
// random router's choice of experts with recorded routing (engine/routing_override.h; the
// calibration of its synthetic continuation is printed first). Each case starts a new pass at
// the trace's first token: the prefill case's prompt token i takes trace token i (both runs);
// a decode case's context prompts are routed by the model's own router (untimed), then its timed
// steps take the trace in order with the batch rows interleaved: step s, row b takes trace token
// s * B + b. The random model's top-k must be the trace's: --top_k 6 for
// /work/shared/traces/qwen3_30b_a3b_top6_expert_ids.npy.
//
//   decode_bench [--layers 48] [--top_k 8] [--formats bf16,q4_0] [--batches 1,8,32]
//                [--threads 0] [--prefill_tokens 512] [--decode_steps 16] [--context 128]
//                [--routing_trace FILE.npy] [--json FILE]
// Dashed spellings (--routing-trace) are accepted too.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/formats.h"
#include "common/membw.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "engine/routing_override.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, layers, 48, "decoder layers (48: the real depth)");
ABSL_FLAG(int, experts, 128, "routed experts per layer");
ABSL_FLAG(int, top_k, 8, "experts per token (num_experts_per_tok); must match --routing_trace's k");
ABSL_FLAG(std::string, routing_trace, "",
          "recorded routing (.npy int [tokens, MoE layers, k]) forced at the router, one pass, "
          "continued past its end by the fitted synthetic generator; empty: the random router");
ABSL_FLAG(int, vocab, 151936, "vocabulary size");
ABSL_FLAG(std::string, formats, "bf16,q4_0", "expert formats to run, comma-separated");
ABSL_FLAG(std::string, batches, "1,8,32", "decode batch sizes");
ABSL_FLAG(int, threads, 0, "worker threads; 0: physical cores");
ABSL_FLAG(int, prefill_tokens, 512, "prompt tokens of the prefill case");
ABSL_FLAG(int, decode_steps, 16, "timed decode steps per batch size");
ABSL_FLAG(int, context, 128, "prompt tokens of each decoding sequence (not timed)");
ABSL_FLAG(int, membw_mib, 1024, "buffer of the DRAM bandwidth probe");
ABSL_FLAG(std::string, json, "", "also write the results here");

namespace moe::engine {
namespace {

using Clock = std::chrono::steady_clock;

ModelConfig Qwen3_30B_A3B(int layers, int experts, int top_k, int vocab) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = vocab;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = 40960;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  c.tie_word_embeddings = false;
  return c;
}

uint64_t TensorBytes(const Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * (t.dtype == DType::kF32 ? 4 : 2);
}

// Dense weights every token reads (all but the embedding table, of which it reads one row).
uint64_t DenseBytes(const ModelWeights& w) {
  uint64_t b = TensorBytes(w.lm_head.empty() ? w.embed_tokens : w.lm_head);
  for (const LayerWeights& l : w.layers) {
    for (const Tensor* t :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.router, &l.shared_gate_proj,
          &l.shared_up_proj, &l.shared_down_proj, &l.shared_expert_gate, &l.mlp_gate_proj,
          &l.mlp_up_proj, &l.mlp_down_proj}) {
      b += TensorBytes(*t);
    }
  }
  return b;
}

struct Case {
  std::string format, kind;
  int batch = 0, tokens = 0;
  double seconds = 0, tok_s = 0, bytes_per_token = 0, dram_gbps = 0, roofline_tok_s = 0,
         fraction = 0, unique_experts_per_layer = 0;
  int64_t trace_tokens = 0, synthetic_tokens = 0;  // routing taken from the trace / generator
};

int ArgMax(const float* l, int n) { return static_cast<int>(std::max_element(l, l + n) - l); }

void Print(const Case& c) {
  std::printf(
      "%-5s %-7s batch %3d  %9.2f tok/s  roofline %9.2f tok/s (%.1f MB/token at %.1f "
      "GB/s)  fraction %.2f  experts/layer %.1f\n",
      c.format.c_str(), c.kind.c_str(), c.batch, c.tok_s, c.roofline_tok_s, c.bytes_per_token / 1e6,
      c.dram_gbps, c.fraction, c.unique_experts_per_layer);
  if (c.trace_tokens + c.synthetic_tokens > 0) {
    std::printf("      routing: %lld tokens from the trace, %lld synthetic\n",
                static_cast<long long>(c.trace_tokens), static_cast<long long>(c.synthetic_tokens));
  }
  std::fflush(stdout);
}

int Run() {
  const int threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : common::PhysicalCoreCount();
  common::ThreadPool pool(threads, /*pin_to_cores=*/true);
  common::DramProbe probe(pool, static_cast<size_t>(absl::GetFlag(FLAGS_membw_mib)) << 20);
  std::vector<int> batches;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int b;
    if (!absl::SimpleAtoi(s, &b) || b < 1) {
      std::fprintf(stderr, "bad --batches entry '%s'\n", std::string(s).c_str());
      return 2;
    }
    batches.push_back(b);
  }
  const ModelConfig cfg = Qwen3_30B_A3B(absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_experts),
                                        absl::GetFlag(FLAGS_top_k), absl::GetFlag(FLAGS_vocab));
  std::unique_ptr<RoutingOverride> routing;
  const std::string trace_path = absl::GetFlag(FLAGS_routing_trace);
  if (!trace_path.empty()) {
    auto r = RoutingOverride::FromFile(trace_path, cfg, {});
    if (!r.ok()) {
      std::fprintf(stderr,
                   "%s\n(the random model's shape comes from --layers, --experts and --top_k)\n",
                   r.status().ToString().c_str());
      return 2;
    }
    routing = *std::move(r);
    const moe_cache::Trace& t = routing->trace();
    std::printf(
        "routing: %s, %d tokens x %d MoE layers x top-%d of %d experts, forced at the "
        "router; %s\n",
        trace_path.c_str(), t.tokens, t.layers, t.k, cfg.num_experts,
        routing->calibration().Summary().c_str());
    std::fflush(stdout);
  }
  const int P = absl::GetFlag(FLAGS_prefill_tokens), S = absl::GetFlag(FLAGS_decode_steps),
            C = absl::GetFlag(FLAGS_context);
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  std::vector<Case> cases;
  nlohmann::json out;
  out["threads"] = threads;
  out["layers"] = cfg.num_hidden_layers;
  out["top_k"] = cfg.num_experts_per_tok;
  out["routing"] = routing ? trace_path : "router";
  if (routing) out["routing_calibration"] = routing->calibration().Summary();
  out["cpu_moe_targets"] = cpu_moe::AvailableTargets();
  for (absl::string_view fname : absl::StrSplit(absl::GetFlag(FLAGS_formats), ',')) {
    auto format = common::ParseWeightFormat(std::string_view(fname.data(), fname.size()));
    if (!format.ok()) {
      std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
      return 2;
    }
    RandomModelOptions ro;
    ro.dense_dtype = DType::kBf16;
    ro.expert_format = *format;
    ro.fast_fill = true;
    ro.pool = &pool;
    const auto t0 = Clock::now();
    auto rm = MakeRandomModel(cfg, ro);
    if (!rm.ok()) {
      std::fprintf(stderr, "%s\n", rm.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "%s model made in %.1f s\n", std::string(fname).c_str(),
                 std::chrono::duration<double>(Clock::now() - t0).count());
    CpuExpertBackend backend(rm->banks, CpuExpertBackend::DefaultOptions(false, false), &pool);
    const int max_pos = std::max(P, C + S) + 1;
    auto model = Model::Create(rm->weights.get(), &backend, &pool, false, max_pos);
    const int bs = 16;
    auto kv = KvCache::Create(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                              (max_batch + 1) * ((max_pos + bs - 1) / bs));
    if (!model.ok() || !kv.ok()) {
      std::fprintf(stderr, "setup failed\n");
      return 1;
    }
    const uint64_t dense = DenseBytes(*rm->weights);
    const uint64_t expert_bytes = rm->banks[0].BytesPerExpert();
    const int moe_layers = cfg.NumMoeLayers();
    const uint64_t kv_token_bytes =
        2ull * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * sizeof(float);
    auto tokens = [&](int n, int seed) {
      std::vector<int32_t> t(n);
      for (int i = 0; i < n; ++i) t[i] = (seed * 7919 + i * 104729) % cfg.vocab_size;
      return t;
    };

    // Prefill: one sequence of P tokens in one chunk (run twice; the second is timed).
    {
      std::vector<int32_t> table;
      (*kv)->Allocate((P + bs - 1) / bs, &table);
      const std::vector<int32_t> prompt = tokens(P, 1);
      Model::Chunk ch{prompt, 0, &table, Model::Logits::kLast};
      std::vector<float> logits;
      (*model)->set_routing_override(routing.get());
      if (routing) routing->Rewind();
      if (!(*model)->Forward({&ch, 1}, kv->get(), &logits).ok()) return 1;
      const uint64_t u0 = backend.total_unique_experts();
      const double gbps = probe.Measure(3);
      if (routing) routing->Rewind();
      const auto t1 = Clock::now();
      logits.clear();
      if (!(*model)->Forward({&ch, 1}, kv->get(), &logits).ok()) return 1;
      Case c;
      c.format = std::string(fname);
      c.kind = "prefill";
      c.batch = 1;
      c.tokens = P;
      c.seconds = std::chrono::duration<double>(Clock::now() - t1).count();
      const double unique = static_cast<double>(backend.total_unique_experts() - u0);
      c.unique_experts_per_layer = unique / moe_layers;
      c.bytes_per_token = (dense + unique * expert_bytes + kv_token_bytes * P / 2.0) / P;
      c.dram_gbps = gbps;
      c.tok_s = P / c.seconds;
      c.roofline_tok_s = gbps * 1e9 / c.bytes_per_token;
      c.fraction = c.tok_s / c.roofline_tok_s;
      if (routing) {
        c.trace_tokens = routing->trace_tokens_served();
        c.synthetic_tokens = routing->synthetic_tokens_served();
      }
      Print(c);
      cases.push_back(c);
      (*kv)->Free(&table);
      (*model)->set_routing_override(nullptr);
    }
    // Decode at each batch size: B sequences of C prompt tokens, then S timed steps.
    for (int B : batches) {
      std::vector<std::vector<int32_t>> tables(B), seqs(B);
      std::vector<Model::Chunk> chunks;
      for (int b = 0; b < B; ++b) {
        (*kv)->Allocate((C + S + 1 + bs - 1) / bs, &tables[b]);
        seqs[b] = tokens(C, 100 + b);
        chunks.push_back({seqs[b], 0, &tables[b], Model::Logits::kLast});
      }
      std::vector<float> logits;
      if (!(*model)->Forward(chunks, kv->get(), &logits).ok()) return 1;
      std::vector<int32_t> next(B);
      for (int b = 0; b < B; ++b) {
        next[b] = ArgMax(logits.data() + static_cast<size_t>(b) * cfg.vocab_size, cfg.vocab_size);
      }
      const double gbps = probe.Measure(3);
      const uint64_t u0 = backend.total_unique_experts();
      double kv_bytes = 0;
      // Row b of step s is trace token s * B + b (Forward takes rows in chunk order).
      (*model)->set_routing_override(routing.get());
      if (routing) routing->Rewind();
      const auto t1 = Clock::now();
      for (int step = 0; step < S; ++step) {
        chunks.clear();
        for (int b = 0; b < B; ++b) {
          chunks.push_back(
              {absl::MakeConstSpan(&next[b], 1), C + step, &tables[b], Model::Logits::kLast});
          kv_bytes += static_cast<double>(kv_token_bytes) * (C + step + 1);
        }
        logits.clear();
        if (!(*model)->Forward(chunks, kv->get(), &logits).ok()) return 1;
        for (int b = 0; b < B; ++b) {
          next[b] = ArgMax(logits.data() + static_cast<size_t>(b) * cfg.vocab_size, cfg.vocab_size);
        }
      }
      Case c;
      c.format = std::string(fname);
      c.kind = "decode";
      c.batch = B;
      c.tokens = B * S;
      c.seconds = std::chrono::duration<double>(Clock::now() - t1).count();
      const double unique = static_cast<double>(backend.total_unique_experts() - u0);
      c.unique_experts_per_layer = unique / S / moe_layers;
      c.bytes_per_token = (static_cast<double>(dense) * S + unique * expert_bytes + kv_bytes) /
                          (static_cast<double>(B) * S);
      c.dram_gbps = gbps;
      c.tok_s = c.tokens / c.seconds;
      c.roofline_tok_s = gbps * 1e9 / c.bytes_per_token;
      c.fraction = c.tok_s / c.roofline_tok_s;
      if (routing) {
        c.trace_tokens = routing->trace_tokens_served();
        c.synthetic_tokens = routing->synthetic_tokens_served();
      }
      (*model)->set_routing_override(nullptr);
      Print(c);
      cases.push_back(c);
      for (auto& t : tables) (*kv)->Free(&t);
    }
  }
  for (const Case& c : cases) {
    out["cases"].push_back({{"format", c.format},
                            {"kind", c.kind},
                            {"batch", c.batch},
                            {"tokens", c.tokens},
                            {"seconds", c.seconds},
                            {"tok_s", c.tok_s},
                            {"bytes_per_token", c.bytes_per_token},
                            {"dram_read_gbps", c.dram_gbps},
                            {"roofline_tok_s", c.roofline_tok_s},
                            {"fraction_of_roofline", c.fraction},
                            {"distinct_experts_per_layer", c.unique_experts_per_layer},
                            {"trace_tokens", c.trace_tokens},
                            {"synthetic_tokens", c.synthetic_tokens}});
  }
  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) std::ofstream(path) << out.dump(2) << "\n";
  return 0;
}

}  // namespace
}  // namespace moe::engine

int main(int argc, char** argv) {
  // Accept dashed flag names (--routing-trace): '-' becomes '_' in the name part.
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> argp;
  bool after_dashdash = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string& a = args[i];
    after_dashdash |= i > 0 && a == "--";
    if (i > 0 && !after_dashdash && a.size() > 2 && a[0] == '-') {
      const size_t end = std::min(a.find('='), a.size());
      for (size_t j = a[1] == '-' ? 2 : 1; j < end; ++j) {
        if (a[j] == '-') a[j] = '_';
      }
    }
    argp.push_back(a.data());
  }
  absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  return moe::engine::Run();
}
