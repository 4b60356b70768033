// cpu_moe decode benchmark: every format, expert count and batch, with weights read from DRAM.
//
//   BM_CpuMoe/<format>/<E>/<T>/<dedup 0|1>, E in {256 (a large-E layer), 128 (Qwen3-30B-A3B)},
//   H=2048, I=768, top-k 8, T in {1, 4, 8, 16, 32, 64}, uniform random routing drawn fresh per
//   step (distinct experts per token).
//
// Weights come from DRAM: every step uses the next of several identical-shape expert banks (a
// "layer" each), so the weights of one format total --total_gb (default: max(2 GB, 8 x the
// last-level cache)), far more than the LLC. The machine's DRAM read bandwidth is measured in
// the same process with all workers, just before and just after each case (the higher reading
// is the case's limit: a VM's bandwidth drifts), and every case reports:
//   ms_per_step, unique_bytes (bytes of the distinct experts a step touches), gbps (unique_bytes /
//   time), dram_gbps, bw_fraction (gbps / dram_gbps), reuse (routes / unique experts), routes,
//   model_ms (what the traffic model predicts: bytes this mode reads / dram_gbps, i.e. unique
//   bytes with dedup, route bytes without).
// Flags (before Google Benchmark's own): --total_gb=<GB> (or env MOE_BENCH_TOTAL_GB),
// --threads=<n> (default: physical cores), --probe_rounds=<n> (DRAM probe rounds per reading,
// default 3; 1 on a slow machine, where one reading of the 4 x LLC buffer takes a second),
// --hugepages=0 (weights on 4 KiB pages; by default they
// are advised onto transparent huge pages like the probe's buffer), --layout=panels|row (q4_0,
// mxfp4 and nvfp4 banks in 16-row panels as PackPanels makes them, the default, or row-major;
// env MOE_BENCH_LAYOUT, which --ab variants can set; the counter `panels` says which ran). Env
// MOE_CPU_MAX_TARGET caps the ISA as in the library, MOE_CPU_BF16_DOT=0 turns bf16's dot product
// off (the counter bf16_dot says whether it ran).
//   BM_CpuMoeSpeedup/<format>/<E>/<T>: dedup on and off alternated step by step in one case, so
//   that the speedup (off / on) and its fraction of the reuse factor come from arms that share
//   the machine's state (see BM_CpuMoeSpeedup).
//   BM_CpuMoeTrace/<format>/<T> (with --trace=<.npy>): the same on real routing, T tokens of one
//   layer of a recorded trace per step (see BM_CpuMoeTrace).
//   BM_CpuMoePrefillPark/bf16/128/<T>: a prefill-sized call (T tokens, every expert through
//   oneDNN) with the pool parked while oneDNN runs and not, alternating call by call (see
//   BM_CpuMoePrefillPark); OMP_NUM_THREADS and OMP_WAIT_POLICY apply as to any libgomp program.
// Also reported: prep_ms, pass1_ms, pass2_ms, other_ms (where a step's time goes) and
// pass1_bw_fraction / pass2_bw_fraction (each pass's bytes over its own time, against DRAM).
// --ab=... runs variants of the env switches side by side instead (see RunAb below), e.g.
//   cpu_moe_bench --ab=q4_0/256/1/1 --variant=pf1k:MOE_CPU_PREFETCH_BYTES=1024
//                 --variant=pf2k:MOE_CPU_PREFETCH_BYTES=2048
#include <sys/resource.h>

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

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"
#include "benchmark/benchmark.h"
#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "common/membw.h"
#include "common/npy.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/onednn_experts.h"
#include "cpu_moe/internal/tuning.h"
#include "cpu_moe/test_bank.h"

namespace moe::cpu_moe {
namespace {

using common::WeightFormat;

constexpr int kH = 2048, kI = 768, kTopK = 8;
// Every weight format, in the order the benchmark families and --ab list them.
constexpr WeightFormat kFormats[] = {WeightFormat::kBf16, WeightFormat::kFp8Block,
                                     WeightFormat::kQ4_0, WeightFormat::kNvfp4,
                                     WeightFormat::kMxfp4};

double g_total_gb = 0.0;  // 0: default
int g_threads = 0;
int g_hugepages = 1;
int g_probe_rounds = 3;

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

// The same with the pool left unparked while oneDNN runs (BM_CpuMoePrefillPark's other arm).
OnednnExperts& OnednnUnparked() {
  static OnednnExperts* onednn = [] {
    OnednnConfig c;
    c.park_pool = false;
    return new OnednnExperts(c);
  }();
  return *onednn;
}

// DRAM read bandwidth now (median of --probe_rounds rounds over a buffer 4x the LLC, at least
// 1 GiB, all workers). Read beside every case: the GPU machine's host, a VM, gave 120-175 GB/s in
// successive processes, so one start-up reading made fractions swing by 30%.
double DramNow() {
  static common::DramProbe* probe = [] {
    const size_t bytes = std::max<size_t>(size_t{1} << 30, 4 * common::LastLevelCacheBytes());
    auto* p = new common::DramProbe(Pool(), bytes);
    std::fprintf(stderr, "DRAM probe: %d workers, %.2f GB buffer, first reading %.2f GB/s\n",
                 Pool().num_workers(), bytes / 1e9, p->Measure(3));
    return p;
  }();
  return probe->Measure(g_probe_rounds);
}

// Minor page faults of the process so far (getrusage).
long MinorFaults() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// The process's AnonHugePages line of /proc/self/smaps_rollup ("?" where unreadable): how much
// of the memory transparent huge pages back.
std::string AnonHugePages() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return "?";
  char line[256];
  std::string v = "?";
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "AnonHugePages:", 14) == 0) {
      v = std::string(absl::StripAsciiWhitespace(line + 14));
    }
  }
  std::fclose(f);
  return v;
}

// Banks of one (format, E), all views into one buffer of `copies` experts' worth per matrix;
// rebuilt when a case needs another (format, E) so that only one format's weights live at once.
// The int8 formats' banks are also held in panels (Layout::kPanels, what PackPanels makes and
// an engine would load), built the first time a case wants them.
struct Banks {
  WeightFormat format;
  int num_experts = 0;
  std::unique_ptr<common::AlignedBuffer<uint8_t>> gu_w, gu_s, dn_w, dn_s;
  std::vector<float> gu_g, dn_g;
  std::vector<ExpertBank> banks;
  std::unique_ptr<PanelBank> panel_template;  // one expert
  std::unique_ptr<common::AlignedBuffer<uint8_t>> gu_p, dn_p;
  std::vector<ExpertBank> panel_banks;
};

// --layout / env MOE_BENCH_LAYOUT (read at every use, so that --ab variants can set it): "panels"
// (the default) runs q4_0, mxfp4 and nvfp4 on banks in panels, "row" on the row-major banks.
bool g_layout_panels = true;
bool UsePanels(WeightFormat f) {
  if (f != WeightFormat::kQ4_0 && f != WeightFormat::kMxfp4 && f != WeightFormat::kNvfp4) {
    return false;
  }
  const char* v = std::getenv("MOE_BENCH_LAYOUT");
  if (v != nullptr && *v != '\0') return std::strcmp(v, "row") != 0;
  return g_layout_panels;
}

// A buffer of n copies of src's bytes, on transparent huge pages unless --hugepages=0, filled
// by the pool's workers (first-touching gigabytes from one thread takes seconds).
std::unique_ptr<common::AlignedBuffer<uint8_t>> Replicate(const uint8_t* src, size_t size,
                                                          size_t n);

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
  auto fill = [n](const std::vector<uint8_t>& src) { return Replicate(src.data(), src.size(), n); };
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
    eb.gate_up_scales =
        tmpl.gate_up_s.empty() ? nullptr : b->gu_s->data() + e0 * tmpl.gate_up_s.size();
    eb.gate_up_global_scales = b->gu_g.data() + e0;
    eb.down_weights = b->dn_w->data() + e0 * tmpl.down_w.size();
    eb.down_scales = tmpl.down_s.empty() ? nullptr : b->dn_s->data() + e0 * tmpl.down_s.size();
    eb.down_global_scales = b->dn_g.data() + e0;
    b->banks.push_back(eb);
  }
  std::fprintf(stderr,
               "%s E=%d: %zu banks x %.1f MB = %.2f GB of weights (LLC %.0f MiB); process "
               "AnonHugePages %s\n",
               std::string(common::WeightFormatName(format)).c_str(), num_experts, n_banks,
               per_expert * num_experts / 1e6, per_expert * n / 1e9, llc / (1 << 20),
               AnonHugePages().c_str());
  g_banks = std::move(b);
  return *g_banks;
}

std::unique_ptr<common::AlignedBuffer<uint8_t>> Replicate(const uint8_t* src, size_t size,
                                                          size_t n) {
  const size_t bytes = std::max<size_t>(1, size * n);
  // Transparent huge pages where the kernel allows them, as for the DRAM probe's buffer (and as
  // an engine should hold its host-resident experts): with 4 KiB pages every 4 KiB of weights
  // costs a TLB miss, and the kernels would be held against a probe that paid none.
  auto buf = std::make_unique<common::AlignedBuffer<uint8_t>>(
      bytes, common::AlignedBuffer<uint8_t>::kHugePageBytes);
  if (g_hugepages) common::AdviseHugePages(buf->data(), bytes);
  Pool().ParallelFor(n, [&](uint64_t i, int) { std::memcpy(buf->data() + i * size, src, size); });
  return buf;
}

// The banks a case runs on: b's row-major banks, or (UsePanels) the same experts in panels.
const std::vector<ExpertBank>& BankList(Banks& b) {
  if (!UsePanels(b.format)) return b.banks;
  if (b.panel_banks.empty()) {
    const testing::HostBank tmpl = testing::MakeRandomBank(b.format, 1, kH, kI, 42, false);
    absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(tmpl.bank);
    if (!pb.ok()) {
      std::fprintf(stderr, "PackPanels: %s\n", pb.status().ToString().c_str());
      std::exit(1);
    }
    b.panel_template = std::move(*pb);
    const PanelBank& t = *b.panel_template;
    const size_t n = b.banks.size() * b.num_experts;
    b.gu_p = Replicate(t.gate_up.data(), t.gate_up.size(), n);
    b.dn_p = Replicate(t.down.data(), t.down.size(), n);
    for (size_t k = 0; k < b.banks.size(); ++k) {
      ExpertBank eb = b.banks[k];
      const size_t e0 = k * b.num_experts;
      eb.layout = Layout::kPanels;
      eb.gate_up_weights = b.gu_p->data() + e0 * t.gate_up.size();
      eb.down_weights = b.dn_p->data() + e0 * t.down.size();
      eb.gate_up_scales = nullptr;
      eb.down_scales = nullptr;
      b.panel_banks.push_back(eb);
    }
    std::fprintf(stderr, "%s E=%d: the same %zu banks in panels\n",
                 std::string(common::WeightFormatName(b.format)).c_str(), b.num_experts,
                 b.banks.size());
  }
  return b.panel_banks;
}

// Fresh routing per step: a pool of routings much longer than the bank rotation, uniform random
// over the experts with distinct experts per token.
struct Routings {
  static constexpr int kCount = 257;
  std::vector<std::vector<int32_t>> ids;
  std::vector<int> unique;
};

Routings MakeRoutings(int num_experts, int T, std::mt19937_64& rng) {
  Routings r;
  r.ids.resize(Routings::kCount);
  r.unique.resize(Routings::kCount);
  std::vector<int> perm(num_experts);
  for (int s = 0; s < Routings::kCount; ++s) {
    std::vector<char> seen(num_experts, 0);
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < num_experts; ++e) perm[e] = e;
      for (int j = 0; j < kTopK; ++j) {
        std::uniform_int_distribution<int> d(j, num_experts - 1);
        std::swap(perm[j], perm[d(rng)]);
        r.ids[s].push_back(perm[j]);
        r.unique[s] += !seen[perm[j]];
        seen[perm[j]] = 1;
      }
    }
  }
  return r;
}

// Balanced routing (--ab cases bal:<format>/<E>/<T>): every expert has exactly 8T / E routes
// (E must divide 8T), under a fresh random relabelling of the experts each step: token t takes
// experts perm[(8t + j) mod E], j < 8. Set against the uniform routing of the same T, it shows
// what the spread of routes per expert costs.
Routings MakeBalancedRoutings(int num_experts, int T, std::mt19937_64& rng) {
  Routings r;
  r.ids.resize(Routings::kCount);
  r.unique.resize(Routings::kCount);
  std::vector<int> perm(num_experts);
  for (int s = 0; s < Routings::kCount; ++s) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < kTopK; ++j) r.ids[s].push_back(perm[(kTopK * t + j) % num_experts]);
    }
    r.unique[s] = std::min(num_experts, kTopK * T);
  }
  return r;
}

// Equal routing weights and x drawn from N(0, 1) for T tokens of top_k routes, and y to match.
struct StepInputs {
  std::vector<float> w, x, y;
  StepInputs(int T, int top_k, std::mt19937_64& rng)
      : w(static_cast<size_t>(T) * top_k, 1.0f / top_k),
        x(static_cast<size_t>(T) * kH),
        y(x.size()) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x) v = nd(rng);
  }
};

void BM_CpuMoe(benchmark::State& state, WeightFormat format, int num_experts, int T, bool dedup) {
  const std::vector<ExpertBank>& bank_list = BankList(GetBanks(format, num_experts));
  const double dram_before = DramNow();
  const size_t per_expert = bank_list[0].BytesPerExpert();
  std::mt19937_64 rng(1000 + T);
  const Routings routings = MakeRoutings(num_experts, T, rng);
  const auto& ids = routings.ids;
  const auto& unique = routings.unique;
  constexpr int kRoutings = Routings::kCount;
  StepInputs in(T, kTopK, rng);
  Options opt = Options::FromEnv();
  opt.dedup = dedup;
  opt.debug = false;
  const internal::Tuning tuning = internal::Tuning::FromEnv();

  size_t step = 0;
  double seconds = 0.0, unique_sum = 0.0;
  double phase[4] = {0, 0, 0, 0};
  ForwardStats fs;
  const long faults_before = MinorFaults();
  for (auto _ : state) {
    const ExpertBank& bank = bank_list[step % bank_list.size()];
    const int s = static_cast<int>(step % kRoutings);
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status st =
        internal::Forward(bank, T, kTopK, ids[s], in.w, in.x, absl::MakeSpan(in.y), opt, tuning,
                          Pool(), &fs, &Onednn());
    const auto t1 = std::chrono::steady_clock::now();
    phase[0] += fs.prep_x_seconds;
    phase[1] += fs.pass1_seconds;
    phase[2] += fs.prep_h_seconds;
    phase[3] += fs.pass2_seconds;
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    seconds += std::chrono::duration<double>(t1 - t0).count();
    unique_sum += unique[s];
    ++step;
  }
  const long faults = MinorFaults() - faults_before;
  // The physical limit: the higher of the readings just before and just after the case.
  const double dram = std::max(dram_before, DramNow());
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
  state.counters["bf16_dot"] = fs.bf16_dot_product ? 1 : 0;
  state.counters["fp8_fp16"] = fs.fp8_fp16 ? 1 : 0;
  // Page faults the process took per step (the kernel zeroing pages that a call's scratch got
  // back from the allocator); 0 when every call reuses memory that is already mapped.
  state.counters["faults_per_step"] = faults / steps;
  // Where the time goes: each phase's ms per step, the rest of the call (planning, allocation)
  // as other_ms, and the two passes' own read rates against DRAM (pass 1 reads gate_up, pass 2
  // down; with dedup each unique expert once, without it once per route).
  const double p1_ms = 1e3 * phase[1] / steps, p2_ms = 1e3 * phase[3] / steps;
  state.counters["prep_ms"] = 1e3 * (phase[0] + phase[2]) / steps;
  state.counters["pass1_ms"] = p1_ms;
  state.counters["pass2_ms"] = p2_ms;
  state.counters["other_ms"] = ms - 1e3 * (phase[0] + phase[1] + phase[2] + phase[3]) / steps;
  const ExpertBank& b0 = bank_list[0];
  const double experts_read = dedup ? unique_sum / steps : routes;
  state.counters["pass1_bw_fraction"] =
      experts_read * b0.GateUpBytesPerExpert() / (p1_ms * 1e-3) / 1e9 / dram;
  state.counters["pass2_bw_fraction"] =
      experts_read * b0.DownBytesPerExpert() / (p2_ms * 1e-3) / 1e9 / dram;
  state.counters["panels"] = b0.layout == Layout::kPanels ? 1 : 0;
  state.SetLabel(absl::StrCat("threads=", Pool().num_workers()));
}

// Dedup's speedup measured side by side: every iteration runs one step with dedup on and one
// with it off, on the same fresh routing (each step on the next bank, so neither arm finds the
// other's experts in the LLC), the order of the two alternating between iterations. The
// separate BM_CpuMoe cases of the two arms run seconds or minutes apart, and the host's DRAM
// bandwidth moves by 10-20% over that (readings of 143 and 165 GB/s in one sweep), which their
// ratio inherits; here both arms share the machine's state.
//   on_ms / off_ms, speedup = off_ms / on_ms, reuse (routes / unique experts),
//   speedup_over_reuse (the target: >= 0.9), dram_gbps (as in BM_CpuMoe),
//   on_bw_fraction (unique bytes / on time / DRAM), off_bw_fraction (bytes the off arm reads,
//   one expert per route, / off time / DRAM: above 1 its repeated experts partly came from the
//   LLC, which caps the speedup any dedup kernel can show below the reuse factor).
// The body of BM_CpuMoeSpeedup and BM_CpuMoeTrace: T tokens of top_k routes each, drawn in turn
// from `routings`.
void SpeedupCase(benchmark::State& state, WeightFormat format, int num_experts, int T, int top_k,
                 const Routings& routings, std::mt19937_64& rng) {
  const std::vector<ExpertBank>& bank_list = BankList(GetBanks(format, num_experts));
  const double dram_before = DramNow();
  const size_t per_expert = bank_list[0].BytesPerExpert();
  StepInputs in(T, top_k, rng);
  Options opt = Options::FromEnv();
  opt.debug = false;
  const internal::Tuning tuning = internal::Tuning::FromEnv();
  size_t step = 0, pairs = 0;
  double seconds[2] = {0.0, 0.0};  // [dedup]
  double unique_sum = 0.0;
  for (auto _ : state) {
    const size_t s = pairs % routings.ids.size();
    for (int i = 0; i < 2; ++i) {
      const int dedup = (i + static_cast<int>(pairs)) % 2;
      opt.dedup = dedup != 0;
      const ExpertBank& bank = bank_list[step % bank_list.size()];
      ++step;
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st =
          internal::Forward(bank, T, top_k, routings.ids[s], in.w, in.x, absl::MakeSpan(in.y),
                            opt, tuning, Pool(), nullptr, &Onednn());
      const auto t1 = std::chrono::steady_clock::now();
      if (!st.ok()) {
        state.SkipWithError(st.ToString().c_str());
        return;
      }
      seconds[dedup] += std::chrono::duration<double>(t1 - t0).count();
    }
    unique_sum += routings.unique[s];
    ++pairs;
  }
  const double dram = std::max(dram_before, DramNow());
  const double n = static_cast<double>(pairs);
  const double on_ms = 1e3 * seconds[1] / n, off_ms = 1e3 * seconds[0] / n;
  const double unique = unique_sum / n;
  const double routes = static_cast<double>(T) * top_k;
  const double reuse = routes / unique;
  state.counters["on_ms"] = on_ms;
  state.counters["off_ms"] = off_ms;
  state.counters["speedup"] = off_ms / on_ms;
  state.counters["reuse"] = reuse;
  state.counters["speedup_over_reuse"] = off_ms / on_ms / reuse;
  state.counters["dram_gbps"] = dram;
  state.counters["on_bw_fraction"] = unique * per_expert / (on_ms * 1e-3) / 1e9 / dram;
  state.counters["off_bw_fraction"] = routes * per_expert / (off_ms * 1e-3) / 1e9 / dram;
  state.counters["panels"] = bank_list[0].layout == Layout::kPanels ? 1 : 0;
  state.SetLabel(absl::StrCat("threads=", Pool().num_workers()));
}

void BM_CpuMoeSpeedup(benchmark::State& state, WeightFormat format, int num_experts, int T) {
  std::mt19937_64 rng(1000 + T);
  const Routings routings = MakeRoutings(num_experts, T, rng);
  SpeedupCase(state, format, num_experts, T, kTopK, routings, rng);
}

// Real routing (--trace=<.npy>, e.g. ../shared/traces/qwen3_30b_a3b_top6_expert_ids.npy: one
// Qwen3-30B-A3B sequence, [tokens, layers, k] with k = 6): each step's batch is T tokens drawn at
// random (without replacement) from one random layer's complete rows, as T requests decoding
// together would route through that layer. The weights are the Qwen3-30B-A3B layer's shape
// (E = 128, H = 2048, I = 768); the counters are BM_CpuMoeSpeedup's. Expert popularity is the
// model's (skewed), but the tokens of one sequence also share context, so its reuse may run
// above that of unrelated requests.
std::string g_trace_path;
constexpr int kTraceExperts = 128;  // Qwen3-30B-A3B

// A routing trace: expert ids [tokens, layers, k], negative for padding.
struct RoutingTrace {
  int tokens = 0, layers = 0, k = 0;
  std::vector<int32_t> ids;
  const int32_t* Row(int token, int layer) const {
    return ids.data() + (static_cast<size_t>(token) * layers + layer) * k;
  }
  int MaxId() const { return ids.empty() ? -1 : *std::max_element(ids.begin(), ids.end()); }
};

struct TraceRows {
  RoutingTrace trace;
  std::vector<std::vector<int>> complete;  // per layer: tokens with no padded slot
};

absl::StatusOr<TraceRows> ReadTrace(const std::string& path) {
  absl::StatusOr<common::NpyArray> a = common::ReadNpy(path);
  if (!a.ok()) return a.status();
  if (a->dtype != common::NpyDtype::kInt32 || a->shape.size() != 3 || a->shape[0] > (1 << 30) ||
      a->shape[1] > (1 << 20) || a->shape[2] > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": a trace is an integer array [tokens, layers, k]"));
  }
  TraceRows t;
  t.trace.tokens = static_cast<int>(a->shape[0]);
  t.trace.layers = static_cast<int>(a->shape[1]);
  t.trace.k = static_cast<int>(a->shape[2]);
  t.trace.ids = std::move(a->i32);
  t.complete.resize(t.trace.layers);
  for (int l = 0; l < t.trace.layers; ++l) {
    for (int tok = 0; tok < t.trace.tokens; ++tok) {
      const int32_t* row = t.trace.Row(tok, l);
      if (std::all_of(row, row + t.trace.k, [](int32_t id) { return id >= 0; })) {
        t.complete[l].push_back(tok);
      }
    }
  }
  return t;
}

// A pool of batches of T tokens from the trace: each from one random layer with at least T
// complete rows, the tokens drawn without replacement.
Routings MakeTraceRoutings(const TraceRows& t, int T, std::mt19937_64& rng) {
  Routings r;
  r.ids.resize(Routings::kCount);
  r.unique.resize(Routings::kCount);
  const int num_experts = t.trace.MaxId() + 1;
  for (int s = 0; s < Routings::kCount; ++s) {
    int layer = 0;
    do {
      layer = std::uniform_int_distribution<int>(0, t.trace.layers - 1)(rng);
    } while (static_cast<int>(t.complete[layer].size()) < T);
    std::vector<int> tokens = t.complete[layer];
    std::shuffle(tokens.begin(), tokens.end(), rng);
    std::vector<char> seen(num_experts, 0);
    for (int i = 0; i < T; ++i) {
      const int32_t* row = t.trace.Row(tokens[i], layer);
      for (int j = 0; j < t.trace.k; ++j) {
        r.ids[s].push_back(row[j]);
        r.unique[s] += !seen[row[j]];
        seen[row[j]] = 1;
      }
    }
  }
  return r;
}

// The trace of --trace, read once; an error where none was given or it does not hold a batch of
// T tokens of the 128-expert layer the cases use.
const TraceRows* TraceFor(int T, std::string* error) {
  static const absl::StatusOr<TraceRows>* trace =
      new absl::StatusOr<TraceRows>(g_trace_path.empty()
                                        ? absl::InvalidArgumentError("no --trace=<.npy> given")
                                        : ReadTrace(g_trace_path));
  if (!trace->ok()) {
    *error = trace->status().ToString();
    return nullptr;
  }
  const TraceRows& t = **trace;
  if (t.trace.MaxId() >= kTraceExperts) {
    *error = absl::StrCat("the trace has expert ids up to ", t.trace.MaxId(), "; the cases have ",
                          kTraceExperts, " experts");
    return nullptr;
  }
  size_t most = 0;
  for (const std::vector<int>& c : t.complete) most = std::max(most, c.size());
  if (most < static_cast<size_t>(T)) {
    *error = absl::StrCat("no layer of the trace has ", T, " complete rows");
    return nullptr;
  }
  return &t;
}

void BM_CpuMoeTrace(benchmark::State& state, WeightFormat format, int T) {
  std::string error;
  const TraceRows* t = TraceFor(T, &error);
  if (t == nullptr) {
    state.SkipWithError(error.c_str());
    return;
  }
  std::mt19937_64 rng(2000 + T);
  const Routings r = MakeTraceRoutings(*t, T, rng);
  SpeedupCase(state, format, kTraceExperts, T, t->trace.k, r, rng);
}

// Cache-hot kernel throughput (not a DRAM figure): one bank of 16 experts, each with `routes`
// routes (2 x routes tokens, the even ones routed to experts 0-7, the odd ones to 8-15), reused
// every step, so the weights come from L2/L3 (bf16: 151 MB). 16 experts give 48 pass-1 items, 3
// per worker with 16 workers (8 experts gave 24, and half the workers idled through the second
// half of pass 1). gbps_hot = weight bytes per step / time, and pass1_gbps_hot / pass2_gbps_hot
// the same per pass. With --threads=1: one core's decode + dot rate, which must exceed the
// per-core DRAM share of the target machine for the DRAM cases to be memory-bound.
void BM_CpuMoeHot(benchmark::State& state, WeightFormat format, int routes) {
  constexpr int kE = 16;
  static_assert(kE == 2 * kTopK, "each token routes to half the experts");
  const int T = 2 * routes;
  static std::unique_ptr<testing::HostBank> hb;
  static std::unique_ptr<PanelBank> hb_panels;
  static WeightFormat hb_format;
  if (!hb || hb_format != format) {
    hb = std::make_unique<testing::HostBank>(testing::MakeRandomBank(format, kE, kH, kI, 7, false));
    hb_panels.reset();
    hb_format = format;
  }
  if (UsePanels(format) && !hb_panels) {
    absl::StatusOr<std::unique_ptr<PanelBank>> pb = PackPanels(hb->bank);
    if (!pb.ok()) {
      state.SkipWithError(pb.status().ToString().c_str());
      return;
    }
    hb_panels = std::move(*pb);
  }
  const ExpertBank& bank = UsePanels(format) ? hb_panels->bank : hb->bank;
  std::vector<int32_t> ids;
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < kTopK; ++j) ids.push_back(j + kTopK * (t % 2));
  }
  std::vector<float> w(T * kTopK, 1.0f / kTopK);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * kH), y(x.size());
  for (float& v : x) v = nd(rng);
  Options opt = Options::FromEnv();
  opt.debug = false;
  const internal::Tuning tuning = internal::Tuning::FromEnv();
  ForwardStats fs;
  double p1 = 0.0, p2 = 0.0, prep = 0.0;
  for (auto _ : state) {
    const absl::Status st = internal::Forward(bank, T, kTopK, ids, w, x, absl::MakeSpan(y), opt,
                                              tuning, Pool(), &fs, &Onednn());
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      return;
    }
    p1 += fs.pass1_seconds;
    p2 += fs.pass2_seconds;
    prep += fs.prep_x_seconds + fs.prep_h_seconds;
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["gbps_hot"] = benchmark::Counter(
      static_cast<double>(hb->bank.BytesPerExpert()) * kE * 1e-9 * iters,
      benchmark::Counter::kIsRate);
  // Each pass's own rate (its matrix's bytes / its time).
  state.counters["pass1_gbps_hot"] = hb->bank.GateUpBytesPerExpert() * kE * 1e-9 * iters / p1;
  state.counters["pass2_gbps_hot"] = hb->bank.DownBytesPerExpert() * kE * 1e-9 * iters / p2;
  // Preparing the activations (x; h when the passes are not overlapped), us per step.
  state.counters["prep_us"] = 1e6 * prep / iters;
  state.counters["bf16_dot"] = fs.bf16_dot_product ? 1 : 0;
  state.counters["fp8_fp16"] = fs.fp8_fp16 ? 1 : 0;
  state.counters["panels"] = bank.layout == Layout::kPanels ? 1 : 0;
}

// The prefill path with and without parking the pool, side by side: every iteration runs one
// call with the pool parked while oneDNN runs (OnednnConfig::park_pool, the default) and one
// without, on the same routing (each call on the next bank), the order alternating between
// iterations. T tokens of uniform routing over E experts at the decode cases' shapes (T=2048 at
// E=128 gives each expert about 128 routes, so every expert goes through oneDNN); the call
// includes the GEMV rest (none here) and the pool's final sum of the oneDNN part, as the engine
// sees it. Counters: park_on_ms and park_off_ms (medians over the calls), off_over_on (median of
// the per-iteration ratios; > 1: parking is faster), onednn_experts, omp_threads; the label
// names the OpenMP wait policy of the environment.
void BM_CpuMoePrefillPark(benchmark::State& state, int num_experts, int T) {
  const std::vector<ExpertBank>& bank_list = BankList(GetBanks(WeightFormat::kBf16, num_experts));
  std::mt19937_64 rng(3000 + T);
  // A few routings, all of whose padded oneDNN shapes are created in the warm-up.
  constexpr int kRoutings = 4;
  std::vector<std::vector<int32_t>> ids(kRoutings);
  {
    std::vector<int> perm(num_experts);
    for (std::vector<int32_t>& r : ids) {
      for (int t = 0; t < T; ++t) {
        for (int e = 0; e < num_experts; ++e) perm[e] = e;
        for (int j = 0; j < kTopK; ++j) {
          std::swap(perm[j], perm[std::uniform_int_distribution<int>(j, num_experts - 1)(rng)]);
          r.push_back(perm[j]);
        }
      }
    }
  }
  StepInputs in(T, kTopK, rng);
  Options opt = Options::FromEnv();
  opt.debug = false;
  const internal::Tuning tuning = internal::Tuning::FromEnv();
  OnednnExperts* arms[2] = {&OnednnUnparked(), &Onednn()};  // [park]
  size_t step = 0;
  ForwardStats fs;
  auto call = [&](int park, int r) -> absl::Status {
    const ExpertBank& bank = bank_list[step++ % bank_list.size()];
    return internal::Forward(bank, T, kTopK, ids[r], in.w, in.x, absl::MakeSpan(in.y), opt, tuning,
                             Pool(), &fs, arms[park]);
  };
  for (int r = 0; r < kRoutings; ++r) {
    for (int park : {0, 1}) {
      const absl::Status st = call(park, r);
      if (!st.ok()) {
        state.SkipWithError(st.ToString().c_str());
        return;
      }
    }
  }
  if (fs.onednn_experts == 0) {
    state.SkipWithError(
        "the oneDNN path did not run (bf16 with oneDNN needs AVX-512; see the "
        "onednn_min_* options)");
    return;
  }
  std::vector<double> ms[2], ratio;
  size_t pairs = 0;
  for (auto _ : state) {
    const int r = static_cast<int>(pairs % kRoutings);
    double this_ms[2];
    for (int i = 0; i < 2; ++i) {
      const int park = (i + static_cast<int>(pairs)) % 2;
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st = call(park, r);
      const auto t1 = std::chrono::steady_clock::now();
      if (!st.ok()) {
        state.SkipWithError(st.ToString().c_str());
        return;
      }
      this_ms[park] = 1e3 * std::chrono::duration<double>(t1 - t0).count();
      ms[park].push_back(this_ms[park]);
    }
    ratio.push_back(this_ms[0] / this_ms[1]);
    ++pairs;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  state.counters["park_on_ms"] = median(ms[1]);
  state.counters["park_off_ms"] = median(ms[0]);
  state.counters["off_over_on"] = median(ratio);
  state.counters["onednn_experts"] = fs.onednn_experts;
  state.counters["omp_threads"] = Onednn().threads();
  state.SetLabel(
      absl::StrCat("threads=", Pool().num_workers(), " omp_wait=", OnednnExperts::WaitPolicy()));
}

void RegisterAll() {
  for (WeightFormat f : kFormats) {
    for (int routes : {1, 4, 8}) {
      const std::string name =
          absl::StrCat("BM_CpuMoeHot/", std::string(common::WeightFormatName(f)), "/", routes);
      benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoeHot, f, routes)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.3);
    }
  }
  // T=1 is left out: with one token every expert has one route and both arms run the same
  // split (dedup is inert).
  for (WeightFormat f : kFormats) {
    for (int E : {256, 128}) {
      for (int T : {4, 8, 16, 32, 64}) {
        const std::string name = absl::StrCat(
            "BM_CpuMoeSpeedup/", std::string(common::WeightFormatName(f)), "/", E, "/", T);
        benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoeSpeedup, f, E, T)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.5);
      }
    }
  }
  for (int T : {2048}) {
    const std::string name = absl::StrCat("BM_CpuMoePrefillPark/bf16/128/", T);
    benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoePrefillPark, 128, T)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(9);
  }
  if (!g_trace_path.empty()) {
    for (WeightFormat f : kFormats) {
      for (int T : {8, 16, 32, 64}) {
        const std::string name =
            absl::StrCat("BM_CpuMoeTrace/", std::string(common::WeightFormatName(f)), "/", T);
        benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoeTrace, f, T)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.5);
      }
    }
  }
  for (WeightFormat f : kFormats) {
    for (int E : {256, 128}) {
      for (int T : {1, 4, 8, 16, 32, 64}) {
        for (int dedup : {0, 1}) {
          const std::string name = absl::StrCat(
              "BM_CpuMoe/", std::string(common::WeightFormatName(f)), "/", E, "/", T, "/", dedup);
          benchmark::RegisterBenchmark(name.c_str(), BM_CpuMoe, f, E, T, dedup != 0)
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(0.3);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Side-by-side mode (--ab): variants of the library's environment switches measured in one
// process, interleaved, so that they share the machine's state (a VM's DRAM bandwidth moves by
// 10% and more between processes, more than most tuning effects).
//
//   --ab=<format>/<E>/<T>/<dedup>[,...]  cases (names as in BM_CpuMoe), or trace:<format>/<T>
//       for BM_CpuMoeTrace's routing (with --trace; E=128, dedup on), or bal:<format>/<E>/<T>
//       for balanced routing (8T / E routes for every expert, dedup on)
//   --variant=<name>:<ENV>=<value>[;<ENV>=<value>...]   (repeatable; an empty list = defaults)
//   --ab_reps=<n> (default 9)
// Every rep runs each variant for about 0.15 s (whole steps), in an order rotated by one per rep,
// after one warm-up round. Before a variant runs, every variable named by any variant is unset
// and its own are set; Options::FromEnv() and internal::Tuning::FromEnv() read them on every
// call. Printed per case and
// variant: median ms per step, bw_fraction (unique bytes / time / DRAM), the passes' fractions,
// and the median over reps of the step-time ratio to the first variant (< 1: faster).
struct Variant {
  std::string name;
  std::vector<std::pair<std::string, std::string>> env;
};

std::vector<std::string> g_ab_cases;
std::vector<Variant> g_variants;
int g_ab_reps = 9;

bool ParseVariant(const std::string& arg, Variant* v) {
  const size_t colon = arg.find(':');
  if (colon == std::string::npos || colon == 0) return false;
  v->name = arg.substr(0, colon);
  for (absl::string_view kv : absl::StrSplit(arg.substr(colon + 1), ';', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos || eq == 0) return false;
    v->env.emplace_back(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int RunAb() {
  if (g_variants.empty()) g_variants.push_back({"default", {}});
  std::vector<std::string> all_vars;
  for (const Variant& v : g_variants) {
    for (const auto& kv : v.env) all_vars.push_back(kv.first);
  }
  for (const std::string& c : g_ab_cases) {
    // "trace:<format>/<T>": BM_CpuMoeTrace's routing, with dedup; "bal:<format>/<E>/<T>":
    // balanced routing (MakeBalancedRoutings), with dedup.
    const bool from_trace = absl::StartsWith(c, "trace:");
    const bool balanced = absl::StartsWith(c, "bal:");
    const std::vector<std::string> parts = absl::StrSplit(
        from_trace ? c.substr(6) + "/1" : balanced ? c.substr(4) + "/1" : c, '/');
    WeightFormat format;
    int E = kTraceExperts, T = 0, dedup = 0;
    bool ok = from_trace
                  ? parts.size() == 3 && absl::SimpleAtoi(parts[1], &T) && T > 0
                  : parts.size() == 4 && absl::SimpleAtoi(parts[1], &E) &&
                        absl::SimpleAtoi(parts[2], &T) && absl::SimpleAtoi(parts[3], &dedup) &&
                        E > 0 && T > 0;
    if (from_trace || balanced) dedup = 1;
    if (ok && balanced && (kTopK * T) % E != 0) ok = false;
    if (ok) {
      ok = false;
      for (WeightFormat f : kFormats) {
        if (parts[0] == common::WeightFormatName(f)) {
          format = f;
          ok = true;
        }
      }
    }
    if (!ok) {
      std::fprintf(stderr,
                   "bad --ab case '%s' (want format/E/T/dedup, e.g. q4_0/256/1/1, "
                   "trace:format/T with --trace, or bal:format/E/T with E dividing 8T)\n",
                   c.c_str());
      return 2;
    }
    int top_k = kTopK;
    Routings routings;
    std::mt19937_64 rng(1000 + T);
    if (from_trace) {
      std::string error;
      const TraceRows* t = TraceFor(T, &error);
      if (t == nullptr) {
        std::fprintf(stderr, "--ab case '%s': %s\n", c.c_str(), error.c_str());
        return 2;
      }
      top_k = t->trace.k;
      routings = MakeTraceRoutings(*t, T, rng);
    } else if (balanced) {
      routings = MakeBalancedRoutings(E, T, rng);
    } else {
      routings = MakeRoutings(E, T, rng);
    }
    Banks& banks = GetBanks(format, E);
    const ExpertBank& b0 = banks.banks[0];  // (the same bytes per expert in either layout)
    StepInputs in(T, top_k, rng);
    size_t step = 0;
    struct Sample {
      double ms, p1_ms, p2_ms, unique;
    };
    // Runs variant v for about `seconds`; returns per-step means.
    auto run = [&](const Variant& v, double seconds) -> Sample {
      for (const std::string& name : all_vars) unsetenv(name.c_str());
      for (const auto& kv : v.env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
      Sample sum{0, 0, 0, 0};
      int n = 0;
      ForwardStats fs;
      while (sum.ms < seconds * 1e3 || n < 3) {
        Options opt = Options::FromEnv();
        opt.dedup = dedup != 0;
        opt.debug = false;
        const internal::Tuning tuning = internal::Tuning::FromEnv();
        const int r = static_cast<int>(step % routings.ids.size());
        const std::vector<ExpertBank>& bank_list = BankList(banks);  // MOE_BENCH_LAYOUT
        const ExpertBank& bank = bank_list[step % bank_list.size()];
        ++step;
        const auto t0 = std::chrono::steady_clock::now();
        const absl::Status st =
            internal::Forward(bank, T, top_k, routings.ids[r], in.w, in.x, absl::MakeSpan(in.y),
                              opt, tuning, Pool(), &fs, &Onednn());
        const auto t1 = std::chrono::steady_clock::now();
        if (!st.ok()) {
          std::fprintf(stderr, "%s: %s\n", v.name.c_str(), st.ToString().c_str());
          std::exit(1);
        }
        sum.ms += 1e3 * std::chrono::duration<double>(t1 - t0).count();
        sum.p1_ms += 1e3 * fs.pass1_seconds;
        sum.p2_ms += 1e3 * fs.pass2_seconds;
        sum.unique += routings.unique[r];
        ++n;
      }
      return {sum.ms / n, sum.p1_ms / n, sum.p2_ms / n, sum.unique / n};
    };
    const size_t nv = g_variants.size();
    for (const Variant& v : g_variants) run(v, 0.1);  // warm-up
    std::vector<std::vector<Sample>> samples(nv);
    std::vector<std::vector<double>> ratio(nv);
    // DRAM readings before every rep and after the last; a rep is held against the higher of
    // the readings on either side of it.
    std::vector<double> dram{DramNow()};
    for (int rep = 0; rep < g_ab_reps; ++rep) {
      std::vector<Sample> this_rep(nv);
      for (size_t i = 0; i < nv; ++i) {
        const size_t vi = (i + rep) % nv;
        this_rep[vi] = run(g_variants[vi], 0.15);
      }
      for (size_t vi = 0; vi < nv; ++vi) {
        samples[vi].push_back(this_rep[vi]);
        ratio[vi].push_back(this_rep[vi].ms / this_rep[0].ms);
      }
      dram.push_back(DramNow());
    }
    std::printf("case %s (DRAM %.1f GB/s median of %zu readings, range %.1f-%.1f; %d workers, "
                "%d reps)\n",
                c.c_str(), Median(dram), dram.size(), *std::min_element(dram.begin(), dram.end()),
                *std::max_element(dram.begin(), dram.end()), Pool().num_workers(), g_ab_reps);
    const double experts_per_route = dedup ? 0.0 : 1.0;
    for (size_t vi = 0; vi < nv; ++vi) {
      std::vector<double> ms, frac, f1, f2;
      for (size_t rep = 0; rep < samples[vi].size(); ++rep) {
        const Sample& smp = samples[vi][rep];
        const double limit = std::max(dram[rep], dram[rep + 1]);
        const double ub = smp.unique * b0.BytesPerExpert();
        const double experts = experts_per_route > 0 ? T * top_k : smp.unique;
        ms.push_back(smp.ms);
        frac.push_back(ub / (smp.ms * 1e-3) / 1e9 / limit);
        f1.push_back(experts * b0.GateUpBytesPerExpert() / (smp.p1_ms * 1e-3) / 1e9 / limit);
        f2.push_back(experts * b0.DownBytesPerExpert() / (smp.p2_ms * 1e-3) / 1e9 / limit);
      }
      std::printf("  %-14s ms_per_step=%.4f bw_fraction=%.3f pass1_bw_fraction=%.3f "
                  "pass2_bw_fraction=%.3f ratio_to_%s=%.3f\n",
                  g_variants[vi].name.c_str(), Median(ms), Median(frac), Median(f1), Median(f2),
                  g_variants[0].name.c_str(), Median(ratio[vi]));
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace moe::cpu_moe

// cpu_moe_bench's own flags, printed before Google Benchmark's for --help.
constexpr char kUsage[] =
    "cpu_moe_bench: cpu_moe's decode benchmark with the weights read from DRAM (see the header\n"
    "of cpu_moe/cpu_moe_bench.cc). Its own flags, before Google Benchmark's:\n"
    "  --total_gb=<GB>       weights per format (env MOE_BENCH_TOTAL_GB; default max(2, 8 x LLC))\n"
    "  --threads=<n>         workers (default: physical cores)\n"
    "  --probe_rounds=<n>    DRAM probe rounds per reading (default 3)\n"
    "  --hugepages=0         weights on 4 KiB pages (default: transparent huge pages)\n"
    "  --layout=panels|row   q4_0, mxfp4, nvfp4 banks in panels (default; PackPanels) or "
    "row-major\n"
    "                        (env MOE_BENCH_LAYOUT, which --variant can set for --ab)\n"
    "  --trace=<.npy>        also register BM_CpuMoeTrace/<format>/<T> on that routing trace\n"
    "  --ab=<cases>          side-by-side mode: format/E/T/dedup, trace:format/T or "
    "bal:format/E/T\n"
    "                        (every expert 8T/E routes), comma-separated\n"
    "  --variant=<name>:<ENV>=<v>[;<ENV>=<v>]  a variant of the library's env switches (--ab)\n"
    "  --ab_reps=<n>         rounds of the side-by-side mode (default 9)\n"
    "Families: BM_CpuMoe/<format>/<E>/<T>/<dedup>, BM_CpuMoeSpeedup/<format>/<E>/<T>,\n"
    "BM_CpuMoeHot/<format>/<routes per expert>, BM_CpuMoePrefillPark/bf16/128/<T>;\n"
    "python3 cpu_moe/benchmarks/summarize.py reads the JSON.\n\n";

int main(int argc, char** argv) {
  using moe::cpu_moe::g_threads;
  using moe::cpu_moe::g_total_gb;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);  // Google Benchmark prints its own flags after this
    }
  }
  if (const char* e = std::getenv("MOE_BENCH_TOTAL_GB"); e != nullptr) {
    (void)absl::SimpleAtod(e, &g_total_gb);
  }
  // Take our flags out before Google Benchmark sees argv. Integer flags with their minimum.
  struct IntFlag {
    const char* prefix;
    int* value;
    int min;
  };
  const IntFlag int_flags[] = {{"--threads=", &g_threads, 0},
                               {"--probe_rounds=", &moe::cpu_moe::g_probe_rounds, 1},
                               {"--hugepages=", &moe::cpu_moe::g_hugepages, 0},
                               {"--ab_reps=", &moe::cpu_moe::g_ab_reps, 1}};
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const IntFlag* flag = nullptr;
    for (const IntFlag& f : int_flags) {
      if (a.rfind(f.prefix, 0) == 0) flag = &f;
    }
    if (flag != nullptr) {
      if (!absl::SimpleAtoi(a.substr(std::strlen(flag->prefix)), flag->value) ||
          *flag->value < flag->min) {
        std::fprintf(stderr, "bad %s (an integer >= %d)\n", a.c_str(), flag->min);
        return 2;
      }
    } else if (a.rfind("--total_gb=", 0) == 0) {
      if (!absl::SimpleAtod(a.substr(11), &g_total_gb)) {
        std::fprintf(stderr, "bad %s\n", a.c_str());
        return 2;
      }
    } else if (a.rfind("--layout=", 0) == 0) {
      if (a != "--layout=panels" && a != "--layout=row") {
        std::fprintf(stderr, "bad %s (want --layout=panels or --layout=row)\n", a.c_str());
        return 2;
      }
      moe::cpu_moe::g_layout_panels = a == "--layout=panels";
    } else if (a.rfind("--trace=", 0) == 0) {
      moe::cpu_moe::g_trace_path = a.substr(8);
    } else if (a.rfind("--ab=", 0) == 0) {
      for (absl::string_view c : absl::StrSplit(a.substr(5), ',', absl::SkipEmpty())) {
        moe::cpu_moe::g_ab_cases.emplace_back(c);
      }
    } else if (a.rfind("--variant=", 0) == 0) {
      moe::cpu_moe::Variant v;
      if (!moe::cpu_moe::ParseVariant(a.substr(10), &v)) {
        std::fprintf(stderr, "bad %s (want --variant=name:ENV=value;ENV=value)\n", a.c_str());
        return 2;
      }
      moe::cpu_moe::g_variants.push_back(v);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  if (!moe::cpu_moe::g_trace_path.empty()) {
    // Read it now, so that a wrong path or file stops the run before any case, not as an error
    // row among the results (the smallest batch of the trace cases: 8 tokens).
    std::string error;
    if (moe::cpu_moe::TraceFor(8, &error) == nullptr) {
      std::fprintf(stderr, "bad --trace=%s: %s\n", moe::cpu_moe::g_trace_path.c_str(),
                   error.c_str());
      return 2;
    }
  }
  if (!moe::cpu_moe::g_ab_cases.empty()) return moe::cpu_moe::RunAb();
  benchmark::AddCustomContext("cpu_moe_targets",
                              [] {
                                std::string s;
                                for (const auto& t : moe::cpu_moe::AvailableTargets()) {
                                  s += (s.empty() ? "" : ",") + t;
                                }
                                return s;
                              }());
  {
    // The memory-system tuning in effect (MOE_CPU_PREFETCH_BYTES / _PREFETCH_L2_BYTES /
    // _PASS1_ROWS / _PASS2_ROWS) and the bf16 dot product switch (MOE_CPU_BF16_DOT), so each
    // JSON of a sweep says which setting it measured.
    const moe::cpu_moe::Options o = moe::cpu_moe::Options::FromEnv();
    const moe::cpu_moe::internal::Tuning t = moe::cpu_moe::internal::Tuning::FromEnv();
    benchmark::AddCustomContext("cpu_moe_tuning",
                                absl::StrCat("hugepages=", moe::cpu_moe::g_hugepages,
                                             " layout=",
                                             moe::cpu_moe::UsePanels(moe::cpu_moe::WeightFormat::kQ4_0)
                                                 ? "panels"
                                                 : "row",
                                             " prefetch_bytes=", t.prefetch_bytes,
                                             " prefetch_l2_bytes=", t.prefetch_l2_bytes,
                                             " pass1_rows=", t.pass1_rows,
                                             " pass2_rows=", t.pass2_rows,
                                             " row_streams=", t.row_streams,
                                             " overlap_passes=", t.overlap_passes ? 1 : 0,
                                             " block_lane=", t.block_lane ? 1 : 0,
                                             " bf16_dot_product=", o.bf16_dot_product ? 1 : 0));
  }
  moe::cpu_moe::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
