// Prefill benchmark: oneDNN grouped GEMM (onednn_experts.h) vs the GEMV kernels, bf16 bank,
// Qwen3-30B-A3B layer shape (E=128, H=2048, I=768, top-8).
//
//   BM_Prefill/<path>/<T>      uniform random routing (distinct experts per token), T in
//                              {128, 512, 2048}; path: gemv (Forward, oneDNN off), onednn
//                              (Forward, every expert through oneDNN, threading kAuto),
//                              onednn_seq / onednn_par (the class directly, experts one after
//                              another with oneDNN threads inside each GEMM / experts spread over
//                              the OpenMP threads).
//   BM_Crossover/<path>/<m>    balanced routing: every expert gets exactly m tokens (T = 16 m),
//                              path gemv or onednn (Forward), m in {1, 2, ..., 256}; the smallest m
//                              where onednn wins is the threshold (Options::
//                              onednn_min_tokens_per_expert).
// Counters: ms_per_step, tflops (2 * routes * 3 * H * I / time), tokens_per_expert (routes /
// unique experts), onednn_experts. Weights: one 1.2 GB bank (several times the L2s; on the 300 MiB
// L3 host most of it comes from DRAM; prefill at these sizes is compute-bound anyway).
// Flags (before Google Benchmark's own): --threads=<n> (cpu_moe pool; default physical cores).
// oneDNN's threads: OMP_NUM_THREADS (default: all logical CPUs).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/onednn_experts.h"
#include "cpu_moe/test_bank.h"

namespace moe::cpu_moe {
namespace {

constexpr int kE = 128, kH = 2048, kI = 768, kTopK = 8;

int g_threads = 0;

common::ThreadPool& Pool() {
  static common::ThreadPool* pool =
      new common::ThreadPool(g_threads > 0 ? g_threads : common::PhysicalCoreCount());
  return *pool;
}

// The oneDNN engine of the prefill path, like the pool one per process of this benchmark.
OnednnExperts& Onednn() {
  static OnednnExperts* onednn = new OnednnExperts();
  return *onednn;
}

const testing::HostBank& Bank() {
  static const testing::HostBank* bank = new testing::HostBank(
      testing::MakeRandomBank(common::WeightFormat::kBf16, kE, kH, kI, 7, false));
  return *bank;
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routing UniformRouting(int T, std::mt19937_64& rng) {
  Routing r;
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  std::vector<int> perm(kE);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < kE; ++e) perm[e] = e;
    for (int j = 0; j < kTopK; ++j) {
      std::uniform_int_distribution<int> d(j, kE - 1);
      std::swap(perm[j], perm[d(rng)]);
      r.ids.push_back(perm[j]);
      r.weights.push_back(uw(rng));
    }
  }
  return r;
}

// Every expert gets exactly m tokens: T = m * E / k, token t takes experts (t k + j) mod E.
Routing BalancedRouting(int m) {
  Routing r;
  const int T = m * kE / kTopK;
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < kTopK; ++j) {
      r.ids.push_back((t * kTopK + j) % kE);
      r.weights.push_back(0.125f);
    }
  }
  return r;
}

std::vector<float> RandomX(int T, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * kH);
  for (float& v : x) v = n(rng);
  return x;
}

enum Path { kGemv = 0, kOnednn = 1, kOnednnSeq = 2, kOnednnPar = 3 };
const char* PathName(int p) {
  static const char* names[] = {"gemv", "onednn", "onednn_seq", "onednn_par"};
  return names[p];
}

// Runs `routings` in rotation through `path`; reports the counters.
void RunCase(benchmark::State& state, int path, int T, const std::vector<Routing>& routings) {
  const testing::HostBank& hb = Bank();
  std::mt19937_64 rng(T);
  const std::vector<float> x = RandomX(T, rng);
  std::vector<float> y(x.size());
  Options o;
  o.onednn_min_tokens_per_expert = path == kGemv ? 0 : 1;
  o.onednn_min_experts = 1;  // measure the oneDNN path itself, whatever the expert count
  // Routes grouped by expert for the direct class calls.
  struct Grouped {
    std::vector<int> experts, begin, token;
    std::vector<float> weight;
  };
  std::vector<Grouped> grouped(routings.size());
  for (size_t i = 0; i < routings.size(); ++i) {
    Grouped& g = grouped[i];
    std::vector<std::vector<int>> by(kE);
    for (size_t k = 0; k < routings[i].ids.size(); ++k) by[routings[i].ids[k]].push_back(k);
    g.begin.push_back(0);
    for (int e = 0; e < kE; ++e) {
      if (by[e].empty()) continue;
      g.experts.push_back(e);
      for (int k : by[e]) {
        g.token.push_back(k / kTopK);
        g.weight.push_back(routings[i].weights[k]);
      }
      g.begin.push_back(static_cast<int>(g.token.size()));
    }
  }
  ForwardStats st;
  size_t step = 0;
  double unique_sum = 0;
  auto run_once = [&]() {
    const size_t i = step++ % routings.size();
    if (path == kGemv || path == kOnednn) {
      const absl::Status s = Forward(hb.bank, T, kTopK, routings[i].ids, routings[i].weights, x,
                                     absl::MakeSpan(y), o, Pool(), &st, &Onednn());
      if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
      unique_sum += st.unique_experts;
    } else {
      OnednnExpertsWork w;
      w.hidden = kH;
      w.intermediate = kI;
      w.gate_up = reinterpret_cast<const uint16_t*>(hb.gate_up_w.data());
      w.down = reinterpret_cast<const uint16_t*>(hb.down_w.data());
      w.x = x.data();
      w.experts = grouped[i].experts;
      w.group_begin = grouped[i].begin;
      w.route_token = grouped[i].token;
      w.route_weight = grouped[i].weight;
      w.y = y.data();
      w.threading = path == kOnednnSeq ? OnednnThreading::kExpertsSequential
                                       : OnednnThreading::kExpertsParallel;
      const absl::Status s = Onednn().Run(w);
      if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
      unique_sum += grouped[i].experts.size();
    }
  };
  // Warm-up: creates the oneDNN primitives for every routing's shapes (one-time cost).
  for (size_t i = 0; i < routings.size(); ++i) run_once();
  step = 0;
  unique_sum = 0;
  for (auto _ : state) run_once();
  const double steps = static_cast<double>(state.iterations());
  const double routes = static_cast<double>(T) * kTopK;
  state.counters["ms_per_step"] =
      benchmark::Counter(steps / 1e3, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["tflops"] = benchmark::Counter(2.0 * routes * 3 * kH * kI * steps / 1e12,
                                                benchmark::Counter::kIsRate);
  state.counters["tokens_per_expert"] = routes / (unique_sum / steps);
  state.counters["onednn_experts"] = path == kGemv ? 0 : unique_sum / steps;
}

void BM_Prefill(benchmark::State& state, int path, int T) {
  std::mt19937_64 rng(1000 + T);
  std::vector<Routing> routings;
  for (int i = 0; i < 4; ++i) routings.push_back(UniformRouting(T, rng));
  RunCase(state, path, T, routings);
}

void BM_Crossover(benchmark::State& state, int path, int m) {
  RunCase(state, path, m * kE / kTopK, {BalancedRouting(m)});
}

void Register() {
  for (int T : {128, 512, 2048}) {
    for (int p : {kGemv, kOnednn, kOnednnSeq, kOnednnPar}) {
      benchmark::RegisterBenchmark(absl::StrCat("BM_Prefill/", PathName(p), "/", T).c_str(),
                                   BM_Prefill, p, T)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(0.5);
    }
  }
  for (int m : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    for (int p : {kGemv, kOnednn}) {
      benchmark::RegisterBenchmark(absl::StrCat("BM_Crossover/", PathName(p), "/", m).c_str(),
                                   BM_Crossover, p, m)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(0.5);
    }
  }
}

}  // namespace
}  // namespace moe::cpu_moe

int main(int argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--threads=", 0) == 0) {
      if (!absl::SimpleAtoi(a.substr(10), &moe::cpu_moe::g_threads)) {
        std::fprintf(stderr, "bad %s\n", a.c_str());
        return 1;
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  std::fprintf(stderr, "oneDNN %s, effective ISA %s, %d OpenMP threads; cpu_moe pool %d workers\n",
               moe::cpu_moe::OnednnExperts::Version().c_str(),
               moe::cpu_moe::OnednnExperts::CpuIsa().c_str(),
               moe::cpu_moe::OnednnExperts::MaxThreads(), moe::cpu_moe::Pool().num_workers());
  moe::cpu_moe::Register();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
