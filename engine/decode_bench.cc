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
//
// --backend cuda runs the GPU model (engine/cuda/gpu_model.h) instead, once per expert budget of
// --expert_fractions (the share of each layer's experts that has a GPU slot), with the experts
// in pinned host memory (a few distinct random experts copied over the full store): prefill
// tok/s, decode tok/s per batch size, misses and GB fetched per token, and beside each the
// offload-only floor of the same run: every miss over the host link at the host-to-device
// bandwidth measured in the same process, plus the bytes read from GPU memory (dense weights,
// the distinct experts of each layer and step, the KV cache) at the device copy bandwidth
// measured likewise. Each decode case runs eagerly ("eager" rows), then replayed from the
// bucket's captured CUDA graph ("decode" rows) over the same routing.
//
// --moe_modes offload,hybrid,auto adds the hybrid modes (misses split between the host link
// and cpu_moe, engine/cuda/hybrid), graph rows only, from the same cold cache and routing. The
// bandwidth profile they split by is measured first on the store's own experts (each path alone
// and both at once); their rows add the CPU's experts and GB per token, its busy time per step,
// and a second floor: best-split, the offload run's misses of each layer and step split in whole
// experts between the link and the CPU so that both finish together (per-expert times from the
// profile's figures measured together), plus the same GPU-memory reads.
//
// --family qwen3_5_moe runs a model of Qwen3.6-35B-A3B's shape instead (40 layers: 30 Gated
// DeltaNet and 10 gated full attention of 16 q / 2 KV heads of 256; 256 experts top-8 of
// intermediate 512 and a gated shared expert; vocabulary 248320; --experts, --top_k and --vocab
// do not apply, and --layers below 40 keeps the family's rule of one full-attention layer in
// four). On the CPU each decoding sequence holds its DeltaNet state as the engine does, and the
// roofline counts that state (read and written once per step) beside the full-attention layers'
// KV. With it, on cuda:
//   --synthetic_routing_from TRACE.npy: routing from moe_cache's synthetic generator at the
//     model's own shape (40 layers x 256 experts, top-8), its popularity and reuse fitted to the
//     trace's (routing_override.h's calibration, printed);
//   --target_misses 8,28,60: expert budgets (replacing --expert_fractions) of the slots per layer
//     whose misses per token, simulated with the engine's cache policy on that routing, come
//     closest to each target; the run reports the misses it measured;
//   --context_positions 16384,122880: each decode case starts at these positions of its
//     sequences, the KV cache and DeltaNet states filled with synthetic values
//     (GpuModel::FillSyntheticContext) instead of a prompt; the KV cache and state memory at the
//     largest is printed;
//   --slots_per_layer 211,119,47: the budgets directly (what --target_misses found, printed),
//     skipping its search;
//   --warm_steps N: untimed decode steps after the cache is emptied, before the timed ones
//     (steady state rather than a cold start).
// Floors then count the DeltaNet states (read and written once per step and sequence) and the KV
// of the full-attention layers only.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/formats.h"
#include "common/membw.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/cpu_expert_backend.h"
#include "engine/cuda/gpu_model.h"
#include "engine/cuda/hybrid/hybrid_profile.h"
#include "engine/cuda/link_probe.h"
#include "engine/forward_model.h"
#include "engine/kv_cache.h"
#include "engine/linear_attention_state.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "engine/routing_override.h"
#include "moe_cache/simulator.h"
#include "moe_cache/synthetic_trace.h"
#include "moe_cache/trace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, layers, 0,
          "decoder layers; 0: the family's real depth (48 for qwen3_moe, 40 for qwen3_5_moe)");
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
ABSL_FLAG(std::string, backend, "cpu", "cpu, or cuda (the GPU model with the expert cache)");
ABSL_FLAG(std::string, expert_fractions, "0.1,0.25,0.5",
          "cuda: shares of each layer's experts that get a GPU slot, one run each");
ABSL_FLAG(std::string, moe_modes, "offload",
          "cuda: where misses are computed, comma-separated, each timed from the same cold cache: "
          "offload (every miss over the host link), hybrid (misses split with the CPU by the "
          "bandwidth profile measured in the run), auto (timed after its start-up trials); "
          "offload always runs first (its misses give both floors)");
ABSL_FLAG(bool, eager, true, "cuda: also time offload decode with eager launches");
ABSL_FLAG(std::string, family, "qwen3_moe",
          "qwen3_moe (Qwen3-30B-A3B's shape) or qwen3_5_moe (Qwen3.6-35B-A3B's)");
ABSL_FLAG(std::string, synthetic_routing_from, "",
          "route by the synthetic generator at the model's shape, fitted to this trace");
ABSL_FLAG(std::string, target_misses, "",
          "cuda: expert budgets giving about these misses per token (needs "
          "--synthetic_routing_from or --routing_trace); replaces --expert_fractions");
ABSL_FLAG(std::string, context_positions, "",
          "cuda: decode from these positions over a synthetic KV cache and states instead of "
          "a prompt of --context tokens");
ABSL_FLAG(std::string, slots_per_layer, "",
          "cuda: expert budgets as GPU slots per MoE layer (replaces --target_misses' search, "
          "which takes minutes at 256 experts; the misses per token simulated for each are "
          "still printed)");
ABSL_FLAG(int, warm_steps, 0, "cuda: untimed decode steps before the timed ones");

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

std::vector<int> ParseInts(const std::string& list, const char* flag) {
  std::vector<int> v;
  for (absl::string_view s : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int x;
    if (!absl::SimpleAtoi(s, &x) || x < 0) {
      std::fprintf(stderr, "bad --%s entry '%s'\n", flag, std::string(s).c_str());
      std::exit(2);
    }
    v.push_back(x);
  }
  return v;
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
          &l.mlp_up_proj, &l.mlp_down_proj, &l.in_proj_qkv, &l.in_proj_z, &l.in_proj_b,
          &l.in_proj_a, &l.out_proj}) {
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

// The CUDA backend's cases (see the file comment).
int RunCuda(const ModelConfig& cfg, RoutingOverride* routing, const std::vector<int>& batches,
            common::ThreadPool& pool, nlohmann::json& out) {
  const std::vector<int> positions =
      ParseInts(absl::GetFlag(FLAGS_context_positions), "context_positions");
  const std::vector<int> targets = ParseInts(absl::GetFlag(FLAGS_target_misses), "target_misses");
  const int warm = absl::GetFlag(FLAGS_warm_steps);
  // Expert budgets: slots per layer from --target_misses (simulated on the routing) or from
  // --expert_fractions.
  std::vector<int> budgets =
      ParseInts(absl::GetFlag(FLAGS_slots_per_layer), "slots_per_layer");
  if ((!targets.empty() || !budgets.empty()) && routing == nullptr) {
    std::fprintf(stderr, "--target_misses and --slots_per_layer need --synthetic_routing_from "
                         "or --routing_trace\n");
    return 2;
  }
  const int M = cfg.NumMoeLayers();
  moe_cache::SimOptions so;
  so.experts = cfg.num_experts;
  // Misses per token of the routing's trace with `slots` per layer under the engine's policy.
  auto misses = [&](int slots) {
    auto r = moe_cache::Simulate(routing->trace(), moe_cache::SimPolicy::kScored, slots * M, so);
    return r.ok() ? r->misses_per_token() : -1.0;
  };
  for (const int slots : budgets) {
    const double m = misses(slots);
    std::printf("%d slots per layer: %.1f misses/token simulated with the scored policy over %d "
                "tokens\n",
                slots, m, routing->trace().tokens);
    out["budgets"].push_back({{"slots_per_layer", slots}, {"simulated_misses_per_token", m}});
  }
  if (budgets.empty() && !targets.empty()) {
    for (int target : targets) {
      // Misses per token fall as slots grow: bisect on slots per layer.
      int lo = cfg.num_experts_per_tok, hi = cfg.num_experts;
      double lo_m = misses(lo), hi_m = misses(hi);
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        const double m = misses(mid);
        if (m < 0) return 1;
        if (m > target) {
          lo = mid;
          lo_m = m;
        } else {
          hi = mid;
          hi_m = m;
        }
      }
      const int slots = std::abs(lo_m - target) < std::abs(hi_m - target) ? lo : hi;
      std::printf("target %d misses/token: %d slots per layer (%.1f misses/token simulated with "
                  "the scored policy over %d tokens)\n",
                  target, slots, slots == lo ? lo_m : hi_m, routing->trace().tokens);
      budgets.push_back(slots);
      out["budgets"].push_back({{"target_misses_per_token", target},
                                {"slots_per_layer", slots},
                                {"simulated_misses_per_token", slots == lo ? lo_m : hi_m}});
    }
  }
  auto bw = gpu::MeasureLinkBandwidth();
  if (!bw.ok()) {
    std::fprintf(stderr, "%s\n", bw.status().ToString().c_str());
    return 1;
  }
  std::printf("host -> device %.1f GB/s, device copy %.0f GB/s (measured in this run)\n",
              bw->host_to_device_gbps, bw->device_gbps);
  out["host_to_device_gbps"] = bw->host_to_device_gbps;
  out["device_copy_gbps"] = bw->device_gbps;
  std::vector<double> fractions;
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_expert_fractions), ',')) {
    double v;
    if (!absl::SimpleAtod(f, &v) || v <= 0 || v > 1) {
      std::fprintf(stderr, "bad --expert_fractions entry '%s'\n", std::string(f).c_str());
      return 2;
    }
    fractions.push_back(v);
  }
  if (budgets.empty()) {
    for (double frac : fractions) {
      budgets.push_back(std::max(cfg.num_experts_per_tok,
                                 static_cast<int>(frac * cfg.num_experts + 0.5)));
    }
  }
  const int P = absl::GetFlag(FLAGS_prefill_tokens), S = absl::GetFlag(FLAGS_decode_steps),
            C = absl::GetFlag(FLAGS_context);
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
  std::vector<std::string> modes = {"offload"};
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_moe_modes), ',')) {
    if (m == "offload") continue;
    if (m != "hybrid" && m != "auto") {
      std::fprintf(stderr, "bad --moe_modes entry '%s' (offload, hybrid, auto)\n",
                   std::string(m).c_str());
      return 2;
    }
    modes.emplace_back(m);
  }
  const int V = cfg.vocab_size, bs = 16;
  for (absl::string_view fname : absl::StrSplit(absl::GetFlag(FLAGS_formats), ',')) {
    auto format = common::ParseWeightFormat(std::string_view(fname.data(), fname.size()));
    if (!format.ok()) {
      std::fprintf(stderr, "%s\n", format.status().ToString().c_str());
      return 2;
    }
    const auto t0 = Clock::now();
    // Dense weights from a model whose experts are tiny (they are not used); the routed experts
    // from a one-layer model of the real expert shape, a few distinct ones copied over the
    // whole store.
    ModelConfig dense_cfg = cfg;
    dense_cfg.moe_intermediate_size = 32;
    RandomModelOptions ro;
    ro.dense_dtype = DType::kBf16;
    ro.expert_format = *format;
    ro.fast_fill = true;
    ro.pool = &pool;
    auto dense = MakeRandomModel(dense_cfg, ro);
    ModelConfig expert_cfg = cfg;
    expert_cfg.num_hidden_layers = 1;
    if (!expert_cfg.layer_types.empty()) expert_cfg.layer_types.resize(1);
    expert_cfg.vocab_size = 64;
    expert_cfg.num_experts = std::max(16, K);
    if (!dense.ok()) {
      std::fprintf(stderr, "%s\n", dense.status().ToString().c_str());
      return 1;
    }
    auto experts = MakeRandomModel(expert_cfg, ro);
    if (!experts.ok()) {
      std::fprintf(stderr, "%s\n", experts.status().ToString().c_str());
      return 1;
    }
    auto store = gpu::ExpertStoreFromBanks(experts->banks, M, E);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      return 1;
    }
    ModelWeights& w = *dense->weights;
    w.config.moe_intermediate_size = cfg.moe_intermediate_size;
    w.expert_format = *format;
    const uint64_t expert_bytes = (*store)->bytes_per_expert();
    const uint64_t slot_bytes = (*store)->layout().padded_bytes_per_expert();
    std::fprintf(stderr, "%s model made in %.1f s (%.1f GB of experts in %s host memory)\n",
                 std::string(fname).c_str(),
                 std::chrono::duration<double>(Clock::now() - t0).count(),
                 (*store)->total_bytes() / 1e9,
                 (*store)->memory_kind() == moe_cache::HostMemoryKind::kPinnedMapped
                     ? "pinned"
                     : "pageable");
    const uint64_t dense_bytes = DenseBytes(w);
    // Hybrid modes: the CPU's banks (the store's memory, read in place) and the bandwidth
    // profile measured on them, both paths alone and together.
    hybrid::HybridProfileMeasurement hp;
    std::vector<std::vector<uint8_t>> dense_scales;  // fp8 scale rows the store pads
    if (modes.size() > 1) {
      auto cpu_banks = gpu::CpuBanksFromStore(**store, *format, M, E, cfg.hidden_size,
                                              cfg.moe_intermediate_size, &dense_scales);
      if (!cpu_banks.ok()) {
        std::fprintf(stderr, "%s\n", cpu_banks.status().ToString().c_str());
        return 1;
      }
      auto m = hybrid::MeasureHybridProfile(**store, *cpu_banks, K, cpu_moe::Options(), pool, 2.0);
      if (!m.ok()) {
        std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
        return 1;
      }
      hp = *m;
      std::printf("%s hybrid profile (this run, %.1f MB per expert): host link %.1f GB/s alone, "
                  "%.1f beside the CPU; CPU experts %.1f GB/s alone, %.1f beside the link\n",
                  std::string(fname).c_str(), hp.bytes_per_expert / 1e6, hp.link_alone_gbps,
                  hp.link_both_gbps, hp.cpu_alone_gbps, hp.cpu_both_gbps);
      out["hybrid_profile"][std::string(fname)] = {{"link_alone_gbps", hp.link_alone_gbps},
                                                   {"link_both_gbps", hp.link_both_gbps},
                                                   {"cpu_alone_gbps", hp.cpu_alone_gbps},
                                                   {"cpu_both_gbps", hp.cpu_both_gbps},
                                                   {"bytes_per_expert", hp.bytes_per_expert}};
    }
    // Seconds per expert on each path with both busy: the best-split floor's unit costs.
    const double t_link = hp.link_both_gbps > 0 ? expert_bytes / (hp.link_both_gbps * 1e9) : 0;
    const double t_cpu = hp.cpu_both_gbps > 0 ? expert_bytes / (hp.cpu_both_gbps * 1e9) : 0;
    // The best whole-expert split of n misses between the link and the CPU.
    auto best_split = [&](int n) {
      double best = n * t_link;
      for (int f = 0; f < n; ++f) best = std::min(best, std::max(f * t_link, (n - f) * t_cpu));
      return best;
    };
    const uint64_t kv_token_bytes =
        2ull * cfg.NumKvLayers() * cfg.num_key_value_heads * cfg.head_dim * 2;  // bf16
    // DeltaNet states: read and written once per decode step and sequence.
    const uint64_t state_bytes = LinearAttentionState::BytesPerSequence(cfg);
    const int max_position = positions.empty() ? 0 : *std::max_element(positions.begin(),
                                                                        positions.end());
    auto tokens = [&](int n, int seed) {
      std::vector<int32_t> t(n);
      for (int i = 0; i < n; ++i) t[i] = (seed * 7919 + i * 104729) % V;
      return t;
    };
    for (const int slots : budgets) {
     // Per batch size, the offload run's floors (seconds for its timed steps): offload-only and
     // best-split.
     std::map<int, std::pair<double, double>> floors;
     for (const std::string& mode : modes) {
      gpu::GpuModelOptions go;
      go.print_plan = mode == "offload";
      if (mode != "offload") {
        go.hybrid = true;
        go.hybrid_auto = mode == "auto";
        go.hybrid_profile = hp.profile();
        go.hybrid_max_rows = max_batch;
      }
      go.max_batch = max_batch;
      go.max_step_tokens = std::max(P, max_batch);
      go.max_context =
          (std::max(P, std::max(C, max_position) + 2 * S + warm + 2) + 1 + bs - 1) / bs * bs;
      go.kv_block_size = bs;
      go.expert_budget_gib = static_cast<double>(static_cast<uint64_t>(slots) * M * slot_bytes) /
                             static_cast<double>(uint64_t{1} << 30);
      auto model = gpu::GpuModel::Create(&w, store->get(), go);
      if (!model.ok()) {
        std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
        return 1;
      }
      gpu::GpuModel& gm = **model;
      KvBlockAllocator alloc(gm.kv_blocks(), bs);
      if (mode == "offload" && max_position > 0) {
        std::printf("memory at position %d: KV cache %.2f GB per sequence (%d full-attention "
                    "layers), linear-attention states %.1f MB per sequence (%d layers); %.2f GB "
                    "for batch %d\n",
                    max_position, kv_token_bytes * (max_position + 1.0) / 1e9, cfg.NumKvLayers(),
                    state_bytes / 1e6, cfg.NumLinearAttentionLayers(),
                    (kv_token_bytes * (max_position + 1.0) + state_bytes) * max_batch / 1e9,
                    max_batch);
        out["memory_at_position"] = {{"position", max_position},
                                     {"kv_bytes_per_sequence", kv_token_bytes * (max_position + 1.0)},
                                     {"state_bytes_per_sequence", state_bytes}};
      }
      int case_position = 0;
      auto report = [&](const char* kind, int B, int steps, int n_tokens, double secs,
                        double floor_s, const gpu::GpuCacheStats& st, double split_floor_s) {
        const double tok_s = n_tokens / secs;
        const double floor_tok_s = n_tokens / floor_s;
        std::printf(
            "%-5s %-7s %-7s slots %3d/%d (%2.0f%%)  batch %2d  pos %6d  %9.2f tok/s  floor %9.2f "
            "tok/s (%.2f of it)  misses/token %6.1f  GB fetched/token %.3f  %.2f ms/step above "
            "floor\n",
            std::string(fname).c_str(), mode.c_str(), kind, slots, E, 100.0 * slots / E, B,
            case_position, tok_s,
            floor_tok_s, tok_s / floor_tok_s, static_cast<double>(st.misses) / n_tokens,
            st.bytes_fetched / 1e9 / n_tokens, (secs - floor_s) * 1e3 / steps);
        if (split_floor_s > 0) {
          std::printf("      best-split floor %9.2f tok/s (%.2f of it, %.2f ms/step above)  CPU: "
                      "%.1f experts/token, GB/token %.3f, busy %.2f ms/step, %lld handoffs\n",
                      n_tokens / split_floor_s, tok_s * split_floor_s / n_tokens,
                      (secs - split_floor_s) * 1e3 / steps,
                      static_cast<double>(st.cpu_experts) / n_tokens, st.bytes_cpu / 1e9 / n_tokens,
                      st.cpu_seconds * 1e3 / steps, static_cast<long long>(st.handoffs));
        }
        std::fflush(stdout);
        out["cases"].push_back({{"backend", "cuda"},
                                {"format", std::string(fname)},
                                {"moe_mode", mode},
                                {"best_split_floor_tok_s",
                                 split_floor_s > 0 ? n_tokens / split_floor_s : 0.0},
                                {"fraction_of_best_split_floor",
                                 split_floor_s > 0 ? tok_s * split_floor_s / n_tokens : 0.0},
                                {"cpu_experts_per_token",
                                 static_cast<double>(st.cpu_experts) / n_tokens},
                                {"gb_cpu_per_token", st.bytes_cpu / 1e9 / n_tokens},
                                {"cpu_busy_ms_per_step", st.cpu_seconds * 1e3 / steps},
                                {"handoffs", st.handoffs},
                                {"kind", kind},
                                {"position", case_position},
                                {"warm_steps", warm},
                                {"slots_per_layer", slots},
                                {"experts_per_layer", E},
                                {"batch", B},
                                {"tokens", n_tokens},
                                {"seconds", secs},
                                {"tok_s", tok_s},
                                {"floor_tok_s", floor_tok_s},
                                {"fraction_of_floor", tok_s / floor_tok_s},
                                {"ms_per_step_above_floor", (secs - floor_s) * 1e3 / steps},
                                {"misses_per_token", static_cast<double>(st.misses) / n_tokens},
                                {"gb_fetched_per_token", st.bytes_fetched / 1e9 / n_tokens},
                                {"distinct_experts_per_layer_step",
                                 static_cast<double>(st.distinct_experts) / M}});
      };
      // Floor of what the stats say was moved and read.
      auto floor_seconds = [&](const gpu::GpuCacheStats& st, int steps, double kv_bytes) {
        return st.bytes_fetched / (bw->host_to_device_gbps * 1e9) +
               (static_cast<double>(dense_bytes) * steps +
                static_cast<double>(st.distinct_experts) * expert_bytes + kv_bytes) /
                   (bw->device_gbps * 1e9);
      };
      // Prefill: one sequence of P tokens, run twice, the second timed.
      if (P > 0 && mode == "offload") {
        std::vector<int32_t> table;
        alloc.Allocate((P + bs - 1) / bs, &table);
        const std::vector<int32_t> prompt = tokens(P, 1);
        ModelChunk ch{prompt, 0, &table, ChunkLogits::kLast};
        std::vector<float> logits;
        gm.set_routing_override(routing);
        if (routing) routing->Rewind();
        if (!gm.Forward({&ch, 1}, &logits).ok()) return 1;
        if (routing) routing->Rewind();
        gm.ResetStats();
        logits.clear();
        const auto t1 = Clock::now();
        const absl::Status st = gm.Forward({&ch, 1}, &logits);
        const double secs = std::chrono::duration<double>(Clock::now() - t1).count();
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
        report("prefill", 1, 1, P, secs,
               floor_seconds(gm.stats(), 1, static_cast<double>(kv_token_bytes) * P / 2.0),
               gm.stats(), 0.0);
        alloc.Free(&table);
        gm.set_routing_override(nullptr);
      }
      const std::vector<int> starts = positions.empty() ? std::vector<int>{-1} : positions;
      for (int B : batches) {
       for (const int start_pos : starts) {
        const int ctx = start_pos >= 0 ? start_pos : C;
        case_position = ctx;
        std::vector<std::vector<int32_t>> tables(B), seqs(B);
        std::vector<ModelChunk> chunks;
        const bool linear = gm.state_slots() > 0;
        for (int b = 0; b < B; ++b) {
          alloc.Allocate((ctx + 2 * S + warm + 3 + bs - 1) / bs, &tables[b]);
          seqs[b] = tokens(start_pos >= 0 ? 1 : C, 100 + b);
          chunks.push_back({seqs[b], start_pos >= 0 ? start_pos : 0, &tables[b],
                            ChunkLogits::kLast, linear ? b : -1});
        }
        std::vector<float> logits;
        absl::Status st = start_pos >= 0 ? gm.FillSyntheticContext(1) : absl::OkStatus();
        // The context: a prompt, or one token at the synthetic context's end.
        if (st.ok()) st = gm.Forward(chunks, &logits);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
        std::vector<int32_t> next(B);
        for (int b = 0; b < B; ++b) next[b] = ArgMax(logits.data() + static_cast<size_t>(b) * V, V);
        gm.set_routing_override(routing);
        // Eager launches, then graph replays, each over the same routing (the trace rewound) from
        // an empty expert cache.
        int pos = start_pos >= 0 ? start_pos + 1 : C;
        std::vector<bool> graph_modes = {true};
        if (mode == "offload" && absl::GetFlag(FLAGS_eager)) graph_modes = {false, true};
        for (bool graphs : graph_modes) {
          gm.set_graphs(graphs);
          if (routing) routing->Rewind();
          double split_s = 0;  // the best-split floor's link/CPU part of the timed steps
          auto decode_step = [&]() -> absl::Status {
            chunks.clear();
            for (int b = 0; b < B; ++b) {
              chunks.push_back({absl::MakeConstSpan(&next[b], 1), pos, &tables[b],
                                ChunkLogits::kLast, linear ? b : -1});
            }
            ++pos;
            logits.clear();
            RETURN_IF_ERROR(gm.Forward(chunks, &logits));
            for (int32_t n : gm.last_pass_fetches()) split_s += best_split(n);
            for (int b = 0; b < B; ++b) {
              next[b] = ArgMax(logits.data() + static_cast<size_t>(b) * V, V);
            }
            return absl::OkStatus();
          };
          // An untimed step (the graph's capture; auto: the start-up trials of both modes), then
          // every mode from the same cold cache.
          st = decode_step();
          for (int i = 1; mode == "auto" && i < 8 && st.ok(); ++i) st = decode_step();
          if (routing) routing->Rewind();
          if (st.ok()) st = gm.ResetExpertCache();
          for (int i = 0; i < warm && st.ok(); ++i) st = decode_step();
          gm.ResetStats();
          split_s = 0;
          double kv_bytes = 0;
          const auto t1 = Clock::now();
          for (int step = 0; step < S && st.ok(); ++step) {
            kv_bytes += (static_cast<double>(kv_token_bytes) * (pos + 1) + 2.0 * state_bytes) * B;
            st = decode_step();
          }
          if (!st.ok()) {
            std::fprintf(stderr, "%s\n", st.ToString().c_str());
            return 1;
          }
          const double secs = std::chrono::duration<double>(Clock::now() - t1).count();
          double floor_s = floor_seconds(gm.stats(), S, kv_bytes);
          // The best split of the offload run's misses, plus what every mode reads from GPU
          // memory (the offload run's floor minus its link part).
          double split_floor_s = 0;
          if (mode == "offload" && graphs) {
            const double link_s = gm.stats().bytes_fetched / (bw->host_to_device_gbps * 1e9);
            if (t_cpu > 0) split_floor_s = floor_s - link_s + split_s;
            floors[B] = {floor_s, split_floor_s};
          } else if (mode != "offload" && floors.count(B)) {
            floor_s = floors[B].first;
            split_floor_s = floors[B].second;
          }
          report(graphs ? "decode" : "eager", B, S, B * S, secs, floor_s, gm.stats(),
                 split_floor_s);
        }
        gm.set_routing_override(nullptr);
        for (auto& t : tables) alloc.Free(&t);
       }
      }
     }
    }
  }
  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) std::ofstream(path) << out.dump(2) << "\n";
  return 0;
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
  const std::string family = absl::GetFlag(FLAGS_family);
  if (family != "qwen3_moe" && family != "qwen3_5_moe") {
    std::fprintf(stderr, "--family must be qwen3_moe or qwen3_5_moe, not '%s'\n", family.c_str());
    return 2;
  }
  const bool qwen35 = family == "qwen3_5_moe";
  const int layers = absl::GetFlag(FLAGS_layers) > 0 ? absl::GetFlag(FLAGS_layers) : qwen35 ? 40 : 48;
  const ModelConfig cfg =
      qwen35 ? Qwen36_35B_A3B(layers)
             : Qwen3_30B_A3B(layers, absl::GetFlag(FLAGS_experts), absl::GetFlag(FLAGS_top_k),
                             absl::GetFlag(FLAGS_vocab));
  std::unique_ptr<RoutingOverride> routing;
  std::string trace_path = absl::GetFlag(FLAGS_routing_trace);
  const std::string synthetic_from = absl::GetFlag(FLAGS_synthetic_routing_from);
  if (!synthetic_from.empty()) {
    // Fit the generator's popularity and reuse to the trace at the trace's own shape, then
    // generate routing at the model's.
    auto trace = moe_cache::ReadNpyTrace(synthetic_from);
    if (!trace.ok()) {
      std::fprintf(stderr, "%s\n", trace.status().ToString().c_str());
      return 2;
    }
    ModelConfig tc = cfg;
    tc.model_type = "qwen3_moe";
    tc.layer_types.clear();
    tc.num_hidden_layers = trace->layers;
    tc.num_experts = trace->MaxId() + 1;
    tc.num_experts_per_tok = trace->k;
    auto fit = RoutingOverride::Create(*trace, tc, {});
    if (!fit.ok()) {
      std::fprintf(stderr, "%s\n", fit.status().ToString().c_str());
      return 2;
    }
    moe_cache::SyntheticTraceConfig sc;
    sc.layers = cfg.NumMoeLayers();
    sc.experts = cfg.num_experts;
    sc.k = cfg.num_experts_per_tok;
    sc.tokens = 4096;
    sc.zipf = (*fit)->calibration().zipf;
    sc.reuse = (*fit)->calibration().reuse;
    auto syn = moe_cache::GenerateSyntheticTrace(sc);
    if (!syn.ok()) {
      std::fprintf(stderr, "%s\n", syn.status().ToString().c_str());
      return 2;
    }
    std::printf("routing: synthetic, %d MoE layers x top-%d of %d experts, zipf %.3f and reuse "
                "%.3f fitted to %s (%s)\n",
                sc.layers, sc.k, sc.experts, sc.zipf, sc.reuse, synthetic_from.c_str(),
                (*fit)->calibration().Summary().c_str());
    // The generated trace continues with its own parameters (no second fit).
    RoutingOverride::Options gen_opt;
    gen_opt.zipf = sc.zipf;
    gen_opt.reuse = sc.reuse;
    auto r = RoutingOverride::Create(*std::move(syn), cfg, gen_opt);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 2;
    }
    routing = *std::move(r);
    trace_path = absl::StrCat("synthetic, fitted to ", synthetic_from);
  } else if (!trace_path.empty()) {
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
  out["family"] = family;
  out["layers"] = cfg.num_hidden_layers;
  out["top_k"] = cfg.num_experts_per_tok;
  out["routing"] = routing ? trace_path : "router";
  if (routing) out["routing_calibration"] = routing->calibration().Summary();
  out["cpu_moe_targets"] = cpu_moe::AvailableTargets();
  const std::string backend = absl::GetFlag(FLAGS_backend);
  out["backend"] = backend;
  if (backend == "cuda") return RunCuda(cfg, routing.get(), batches, pool, out);
  if (backend != "cpu") {
    std::fprintf(stderr, "--backend must be cpu or cuda, not '%s'\n", backend.c_str());
    return 2;
  }
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
    auto kv = KvCache::Create(cfg.NumKvLayers(), cfg.num_key_value_heads, cfg.head_dim, bs,
                              (max_batch + 1) * ((max_pos + bs - 1) / bs));
    if (!model.ok() || !kv.ok()) {
      std::fprintf(stderr, "setup failed: %s\n",
                   (!model.ok() ? model.status() : kv.status()).ToString().c_str());
      return 1;
    }
    // DeltaNet states: slot 0 for the prefill case, slots 0..B-1 for a decode case.
    std::unique_ptr<LinearAttentionState> state;
    if (cfg.NumLinearAttentionLayers() > 0) {
      auto st = LinearAttentionState::Create(cfg, max_batch);
      if (!st.ok()) {
        std::fprintf(stderr, "setup failed: %s\n", st.status().ToString().c_str());
        return 1;
      }
      state = *std::move(st);
    }
    const double state_bytes = static_cast<double>(LinearAttentionState::BytesPerSequence(cfg));
    auto forward = [&](absl::Span<const Model::Chunk> chunks, std::vector<float>* logits) {
      const absl::Status st = (*model)->Forward(chunks, kv->get(), logits, state.get());
      if (!st.ok()) std::fprintf(stderr, "forward failed: %s\n", st.ToString().c_str());
      return st.ok();
    };
    const uint64_t dense = DenseBytes(*rm->weights);
    const uint64_t expert_bytes = rm->banks[0].BytesPerExpert();
    const int moe_layers = cfg.NumMoeLayers();
    const uint64_t kv_token_bytes =
        2ull * cfg.NumKvLayers() * cfg.num_key_value_heads * cfg.head_dim * sizeof(float);
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
      Model::Chunk ch{prompt, 0, &table, Model::Logits::kLast, state ? 0 : -1};
      std::vector<float> logits;
      (*model)->set_routing_override(routing.get());
      if (routing) routing->Rewind();
      if (!forward({&ch, 1}, &logits)) return 1;
      const uint64_t u0 = backend.total_unique_experts();
      const double gbps = probe.Measure(3);
      if (routing) routing->Rewind();
      const auto t1 = Clock::now();
      logits.clear();
      if (!forward({&ch, 1}, &logits)) return 1;
      Case c;
      c.format = std::string(fname);
      c.kind = "prefill";
      c.batch = 1;
      c.tokens = P;
      c.seconds = std::chrono::duration<double>(Clock::now() - t1).count();
      const double unique = static_cast<double>(backend.total_unique_experts() - u0);
      c.unique_experts_per_layer = unique / moe_layers;
      c.bytes_per_token =
          (dense + unique * expert_bytes + kv_token_bytes * P / 2.0 + 2 * state_bytes) / P;
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
        chunks.push_back({seqs[b], 0, &tables[b], Model::Logits::kLast, state ? b : -1});
      }
      std::vector<float> logits;
      if (!forward(chunks, &logits)) return 1;
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
          chunks.push_back({absl::MakeConstSpan(&next[b], 1), C + step, &tables[b],
                            Model::Logits::kLast, state ? b : -1});
          kv_bytes += static_cast<double>(kv_token_bytes) * (C + step + 1) + 2 * state_bytes;
        }
        logits.clear();
        if (!forward(chunks, &logits)) return 1;
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
