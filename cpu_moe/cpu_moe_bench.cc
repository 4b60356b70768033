// cpu_moe decode benchmark: the seed-003 sweep with weights read from DRAM.
//
//   BM_CpuMoe/<format>/<E>/<T>/<dedup 0|1>, E in {256 (seed 003's rig), 128 (Qwen3-30B-A3B)},
//   H=2048, I=768, top-k 8, T in {1, 4, 8, 16, 32, 64}, uniform random routing drawn fresh per
//   step (distinct experts per token).
//
// Weights come from DRAM: every step uses the next of several identical-shape expert banks (a
// "layer" each), so the weights of one format total --total_gb (default: max(2 GB, 8 x the
// last-level cache)), far more than the LLC. The machine's DRAM read bandwidth is measured in
// the same process with all workers, once, and every case reports:
//   ms_per_step, unique_bytes (bytes of the distinct experts a step touches), gbps (unique_bytes /
//   time), dram_gbps, bw_fraction (gbps / dram_gbps), reuse (routes / unique experts), routes,
//   model_ms (what the traffic model predicts: bytes this mode reads / dram_gbps, i.e. unique
//   bytes with dedup, route bytes without).
// Flags (before Google Benchmark's own): --total_gb=<GB> (or env MOE_BENCH_TOTAL_GB),
// --threads=<n> (default: physical cores). Env MOE_CPU_MAX_TARGET caps the ISA as in the library.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "common/membw.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/test_bank.h"

namespace moe::cpu_moe {
namespace {

using common::WeightFormat;

constexpr int kH = 2048, kI = 768, kTopK = 8;

double g_total_gb = 0.0;  // 0: default
int g_threads = 0;

common::ThreadPool& Pool() {
  static common::ThreadPool* pool =
      new common::ThreadPool(g_threads > 0 ? g_threads : common::PhysicalCoreCount());
  return *pool;
}

double DramGBps() {
  static const double gbps = [] {
    const size_t bytes = std::max<size_t>(size_t{1} << 30, 4 * common::LastLevelCacheBytes());
    const double v = common::MeasureDramReadGBps(Pool(), bytes, 5);
    std::fprintf(stderr, "DRAM read bandwidth, %d workers, %.2f GB buffer: %.2f GB/s\n",
                 Pool().num_workers(), bytes / 1e9, v);
    return v;
  }();
  return gbps;
}

// Banks of one (format, E), all views into one buffer of `copies` experts' worth per matrix;
// rebuilt when a case needs another (format, E) so that only one format's weights live at once.
struct Banks {
  WeightFormat format;
  int num_experts = 0;
  std::unique_ptr<common::AlignedBuffer<uint8_t>> gu_w, gu_s, dn_w, dn_s;
  std::vector<float> gu_g, dn_g;
  std::vector<ExpertBank> banks;
};

std::unique_ptr<Banks> g_banks;

// Copies one quantized template expert over every expert of n_banks banks.
Banks& GetBanks(WeightFormat format, int num_experts) {
  if (g_banks && g_banks->format == format && g_banks->num_experts == num_experts) return *g_banks;
  g_banks.reset();
  auto b = std::make_unique<Banks>();
  b->format = format;
  b->num_experts = num_experts;
  const testing::HostBank tmpl = testing::MakeRandomBank(format, 1, kH, kI, 42, false);
  const size_t per_expert = tmpl.bank.BytesPerExpert();
  const double llc = static_cast<double>(common::LastLevelCacheBytes());
  const double total = g_total_gb > 0 ? g_total_gb * 1e9 : std::max(2e9, 8 * llc);
  const size_t n_banks = std::max<size_t>(
      1, static_cast<size_t>(std::ceil(total / (static_cast<double>(per_expert) * num_experts))));
  const size_t n = n_banks * num_experts;
  auto fill = [n](const std::vector<uint8_t>& src) {
    auto buf = std::make_unique<common::AlignedBuffer<uint8_t>>(std::max<size_t>(1, src.size() * n));
    for (size_t i = 0; i < n; ++i) std::memcpy(buf->data() + i * src.size(), src.data(), src.size());
    return buf;
  };
  b->gu_w = fill(tmpl.gate_up_w);
  b->gu_s = fill(tmpl.gate_up_s);
  b->dn_w = fill(tmpl.down_w);
  b->dn_s = fill(tmpl.down_s);
  b->gu_g.assign(n, tmpl.gate_up_g.empty() ? 1.0f : tmpl.gate_up_g[0]);
  b->dn_g.assign(n, tmpl.down_g.empty() ? 1.0f : tmpl.down_g[0]);
  for (size_t k = 0; k < n_banks; ++k) {
    const size_t e0 = k * num_experts;
    ExpertBank eb = tmpl.bank;
    eb.num_experts = num_experts;
    eb.gate_up_weights = b->gu_w->data() + e0 * tmpl.gate_up_w.size();
    eb.gate_up_scales = tmpl.gate_up_s.empty() ? nullptr : b->gu_s->data() + e0 * tmpl.gate_up_s.size();
    eb.gate_up_global_scales = b->gu_g.data() + e0;
    eb.down_weights = b->dn_w->data() + e0 * tmpl.down_w.size();
    eb.down_scales = tmpl.down_s.empty() ? nullptr : b->dn_s->data() + e0 * tmpl.down_s.size();
    eb.down_global_scales = b->dn_g.data() + e0;
    b->banks.push_back(eb);
  }
  std::fprintf(stderr, "%s E=%d: %zu banks x %.1f MB = %.2f GB of weights (LLC %.0f MiB)\n",
               std::string(common::WeightFormatName(format)).c_str(), num_experts, n_banks,
               per_expert * num_experts / 1e6, per_expert * n / 1e9, llc / (1 << 20));
  g_banks = std::move(b);
  return *g_banks;
}

void BM_CpuMoe(benchmark::State& state, WeightFormat format, int num_experts, int T, bool dedup) {
  const double dram = DramGBps();
  Banks& banks = GetBanks(format, num_experts);
  const size_t per_expert = banks.banks[0].BytesPerExpert();
  std::mt19937_64 rng(1000 + T);
  // Fresh routing per step: a pool of routings much longer than the bank rotation.
  constexpr int kRoutings = 257;
  std::vector<std::vector<int32_t>> ids(kRoutings);
  std::vector<int> unique(kRoutings);
  std::vector<int> perm(num_experts);
  for (int s = 0; s < kRoutings; ++s) {
    std::vector<char> seen(num_experts, 0);
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < num_experts; ++e) perm[e] = e;
      for (int j = 0; j < kTopK; ++j) {
        std::uniform_int_distribution<int> d(j, num_experts - 1);
        std::swap(perm[j], perm[d(rng)]);
        ids[s].push_back(perm[j]);
        unique[s] += !seen[perm[j]];
        seen[perm[j]] = 1;
      }
    }
  }
  std::vector<float> w(T * kTopK, 1.0f / kTopK);
  std::vector<float> x(static_cast<size_t>(T) * kH), y(x.size());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : x) v = nd(rng);
  Options opt = Options::FromEnv();
  opt.dedup = dedup;
  opt.debug = false;

  size_t step = 0;
  double seconds = 0.0, unique_sum = 0.0;
  for (auto _ : state) {
    const ExpertBank& bank = banks.banks[step % banks.banks.size()];
    const int s = static_cast<int>(step % kRoutings);
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status st = Forward(bank, T, kTopK, ids[s], w, x, absl::MakeSpan(y), opt, Pool());
    const auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    seconds += std::chrono::duration<double>(t1 - t0).count();
    unique_sum += unique[s];
    ++step;
  }
  const double steps = static_cast<double>(step);
  const double ms = 1e3 * seconds / steps;
  const double ub = unique_sum / steps * per_expert;
  const double routes = static_cast<double>(T) * kTopK;
  const double reuse = routes / (unique_sum / steps);
  state.counters["ms_per_step"] = ms;
  state.counters["unique_bytes"] = ub;
  state.counters["gbps"] = ub / (ms * 1e-3) / 1e9;
  state.counters["dram_gbps"] = dram;
  state.counters["bw_fraction"] = ub / (ms * 1e-3) / 1e9 / dram;
  state.counters["reuse"] = reuse;
  state.counters["routes"] = routes;
  state.counters["model_ms"] = (dedup ? ub : routes * per_expert) / (dram * 1e9) * 1e3;
  state.SetLabel(absl::StrCat("threads=", Pool().num_workers()));
}

// Cache-hot kernel throughput (not a DRAM figure): one bank of 8 experts (all routed by every
// token; T=4 / 8: 4 / 8 routes per expert), reused every step, so the weights come from L2/L3. gbps_hot = weight bytes per step /
// time. Run with --threads=1 to see one core's decode + dot rate, which must exceed the per-core
// DRAM share of the target machine for the DRAM cases to be memory-bound.
void BM_CpuMoeHot(benchmark::State& state, WeightFormat format, int T) {
  constexpr int kE = 8;
  static std::unique_ptr<testing::HostBank> hb;
  static WeightFormat hb_format;
  if (!hb || hb_format != format) {
    hb = std::make_unique<testing::HostBank>(testing::MakeRandomBank(format, kE, kH, kI, 7, false));
    hb_format = format;
  }
  std::vector<int32_t> ids;
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < kTopK; ++j) ids.push_back((j + t) % kE);
  }
  std::vector<float> w(T * kTopK, 1.0f / kTopK);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * kH), y(x.size());
  for (float& v : x) v = nd(rng);
  Options opt = Options::FromEnv();
  opt.debug = false;
  for (auto _ : state) {
    const absl::Status st = Forward(hb->bank, T, kTopK, ids, w, x, absl::MakeSpan(y), opt, Pool());
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
  }
  state.counters["gbps_hot"] = benchmark::Counter(
      static_cast<double>(hb->bank.BytesPerExpert()) * kE * 1e-9 * state.iterations(),
      benchmark::Counter::kIsRate);
}

void RegisterAll() {
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8Block, WeightFormat::kQ4_0,
                         WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (int T : {1, 4, 8}) {
      const std::string name =
          absl::StrCat("BM_CpuMoeHot/", std::string(common::WeightFormatName(f)), "/", T);
      benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoeHot, f, T)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.3);
    }
  }
  const WeightFormat formats[] = {WeightFormat::kBf16, WeightFormat::kFp8Block,
                                  WeightFormat::kQ4_0, WeightFormat::kNvfp4,
                                  WeightFormat::kMxfp4};
  for (WeightFormat f : formats) {
    for (int E : {256, 128}) {
      for (int T : {1, 4, 8, 16, 32, 64}) {
        for (int dedup : {0, 1}) {
          const std::string name = absl::StrCat("BM_CpuMoe/", std::string(common::WeightFormatName(f)), "/", E,
                                                "/", T, "/", dedup);
          benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoe, f, E, T, dedup != 0)
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(0.3);
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe::cpu_moe

int main(int argc, char** argv) {
  using moe::cpu_moe::g_threads;
  using moe::cpu_moe::g_total_gb;
  if (const char* e = std::getenv("MOE_BENCH_TOTAL_GB"); e != nullptr) {
    (void)absl::SimpleAtod(e, &g_total_gb);
  }
  // Take our flags out before Google Benchmark sees argv.
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--total_gb=", 0) == 0) {
      if (!absl::SimpleAtod(a.substr(11), &g_total_gb)) {
        std::fprintf(stderr, "bad %s\n", a.c_str());
        return 2;
      }
    } else if (a.rfind("--threads=", 0) == 0) {
      if (!absl::SimpleAtoi(a.substr(10), &g_threads)) {
        std::fprintf(stderr, "bad %s\n", a.c_str());
        return 2;
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  benchmark::AddCustomContext("cpu_moe_targets",
                              [] {
                                std::string s;
                                for (const auto& t : moe::cpu_moe::AvailableTargets()) {
                                  s += (s.empty() ? "" : ",") + t;
                                }
                                return s;
                              }());
  {
    // The memory-system tuning in effect (MOE_CPU_PREFETCH_BYTES / _PASS1_ROWS / _PASS2_ROWS), so
    // each JSON of a sweep says which setting it measured.
    const moe::cpu_moe::Options o = moe::cpu_moe::Options::FromEnv();
    benchmark::AddCustomContext("cpu_moe_tuning",
                                absl::StrCat("prefetch_bytes=", o.prefetch_bytes,
                                             " pass1_rows=", o.pass1_rows,
                                             " pass2_rows=", o.pass2_rows));
  }
  moe::cpu_moe::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
