// Decode-step time of the synthetic MoE stack with the routed-expert miss copy beside the shared
// expert (overlap on) or before it (off), replayed as a captured graph and enqueued eagerly, at
// several cache sizes. Shaped by default like Qwen3.6-35B-A3B's MoE part (40 layers, 256 experts,
// top-8, H=2048, I=512, shared expert 512). For each cache size: a warm-up, then --pairs pairs of
// (off, on) runs per mode with the order rotating between pairs, each run timing --steps whole
// decode steps; the ideal gain is measured separately (eager, overlap off, per-layer events):
// per layer min(shared-expert time, copy time), summed over the step. Prints a table and, with
// --json=PATH, writes the numbers.
//
// Usage: overlap_bench [--slots=9984,9344,8320] [--steps=64] [--pairs=3] [--warmup=200]
//                      [--batch=1] [--layers=40] [--experts=256] [--top_k=8] [--hidden=2048]
//                      [--inter=512] [--shared_inter=512] [--threads=16] [--commit=SHA]
//                      [--json=PATH]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "graph_capture/decode_graph.h"
#include "nlohmann/json.hpp"
#include "tests/overlap/synthetic_stack.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::overlap_test {
namespace {

struct Args {
  std::vector<int> slots = {9984, 9344, 8320};
  int steps = 64, pairs = 3, warmup = 200, batch = 1;
  int layers = 40, experts = 256, top_k = 8, hidden = 2048, inter = 512, shared_inter = 512;
  int threads = 16;
  std::string commit = "unknown", json;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  std::map<std::string, int*> ints = {
      {"steps", &a->steps},   {"pairs", &a->pairs},   {"warmup", &a->warmup},
      {"batch", &a->batch},   {"layers", &a->layers}, {"experts", &a->experts},
      {"top_k", &a->top_k},   {"hidden", &a->hidden}, {"inter", &a->inter},
      {"shared_inter", &a->shared_inter},             {"threads", &a->threads}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
    const std::string key = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    if (ints.count(key)) {
      if (!absl::SimpleAtoi(value, ints[key])) return false;
    } else if (key == "slots") {
      a->slots.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int v;
        if (!absl::SimpleAtoi(s, &v)) return false;
        a->slots.push_back(v);
      }
    } else if (key == "commit") {
      a->commit = value;
    } else if (key == "json") {
      a->json = value;
    } else {
      return false;
    }
  }
  return a->steps > 0 && a->pairs > 0 && a->batch > 0 && !a->slots.empty();
}

#if MOE_HAVE_CUDA

#define CHECK_OK(expr)                                                                \
  do {                                                                                \
    const absl::Status s_ = (expr);                                                   \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, std::string(s_.message()).c_str());     \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define CHECK_CUDA(expr) CHECK_OK((expr) == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(expr)))

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}

double StdDev(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  const double m = Mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / (v.size() - 1));
}

class Runner {
 public:
  Runner(SyntheticMoeStack* stack, int batch) : stack_(stack), batch_(batch), rng_(17) {
    CHECK_CUDA(cudaEventCreate(&start_));
    CHECK_CUDA(cudaEventCreate(&stop_));
  }
  ~Runner() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }

  std::vector<int32_t> Tokens() {
    std::vector<int32_t> t(batch_);
    for (auto& x : t) x = static_cast<int32_t>(rng_() % 1000000);
    return t;
  }

  // Captures the graphs of both arms (after ResetCache: they bake in the pool and state).
  void Capture() {
    for (bool on : {false, true}) {
      stack_->set_overlap(on);
      auto g = graph_capture::DecodeGraph::Create(
          stack_->compute(), [&](CUstream_st*) { return stack_->EnqueueStep(batch_); });
      CHECK_OK(g.status());
      graphs_[on] = std::move(*g);
    }
  }

  // Runs `steps` whole decode steps of one arm; returns ms per step.
  double Run(bool graph, bool overlap, int steps) {
    stack_->set_overlap(overlap);
    CHECK_CUDA(cudaEventRecord(start_, stack_->compute()));
    for (int i = 0; i < steps; ++i) {
      CHECK_OK(stack_->SetTokens(Tokens()));
      if (graph) {
        CHECK_OK(graphs_[overlap]->Launch(stack_->compute()));
      } else {
        CHECK_OK(stack_->EnqueueStep(batch_));
      }
    }
    CHECK_CUDA(cudaEventRecord(stop_, stack_->compute()));
    CHECK_CUDA(cudaEventSynchronize(stop_));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms / steps;
  }

  // Eager, overlap off, per-layer events: (ideal gain ms/step, copy ms/step, shared ms/step,
  // misses per token).
  // stage_ms: the serial step by stage, ms/step (router, ensure_experts, copy + shared expert,
  // checksum consumer + combine), from events between the stages.
  void MeasureIdeal(int steps, double* ideal, double* copy, double* shared, double* misses,
                    double stage_ms[4]) {
    stack_->set_overlap(false);
    const int L = stack_->config().layers;
    LayerTimers t;
    t.stages.resize(L * LayerTimers::kStageMarks);
    for (auto* v : {&t.side_begin, &t.side_end, &t.compute_begin, &t.compute_end, &t.stages}) {
      if (v != &t.stages) v->resize(L);
      for (auto& e : *v) CHECK_CUDA(cudaEventCreate(&e));
    }
    *ideal = *copy = *shared = *misses = 0;
    for (int i = 0; i < 4; ++i) stage_ms[i] = 0;
    for (int s = 0; s < steps; ++s) {
      CHECK_OK(stack_->SetTokens(Tokens()));
      CHECK_OK(stack_->EnqueueStep(batch_, &t));
      auto r = stack_->ReadStep(batch_);  // synchronises
      CHECK_OK(r.status());
      if (stack_->CountMismatches(*r, batch_) != 0) {
        std::fprintf(stderr, "checksum mismatch in the serial arm\n");
        std::exit(1);
      }
      for (int l = 0; l < L; ++l) {
        float c = 0, h = 0;
        CHECK_CUDA(cudaEventElapsedTime(&c, t.side_begin[l], t.side_end[l]));
        CHECK_CUDA(cudaEventElapsedTime(&h, t.compute_begin[l], t.compute_end[l]));
        *copy += c;
        *shared += h;
        *ideal += std::min(c, h);
        *misses += r->plan_counts[l];
        for (int i = 0; i < 4; ++i) {
          float m = 0;
          CHECK_CUDA(cudaEventElapsedTime(&m, t.stages[l * LayerTimers::kStageMarks + i],
                                          t.stages[l * LayerTimers::kStageMarks + i + 1]));
          stage_ms[i] += m;
        }
      }
    }
    for (int i = 0; i < 4; ++i) stage_ms[i] /= steps;
    *ideal /= steps;
    *copy /= steps;
    *shared /= steps;
    *misses /= static_cast<double>(steps) * batch_;
    for (auto* v : {&t.side_begin, &t.side_end, &t.compute_begin, &t.compute_end, &t.stages}) {
      for (auto& e : *v) cudaEventDestroy(e);
    }
  }

 private:
  SyntheticMoeStack* stack_;
  int batch_;
  std::mt19937 rng_;
  cudaEvent_t start_, stop_;
  std::map<bool, std::unique_ptr<graph_capture::DecodeGraph>> graphs_;
};

int Main(const Args& a) {
  StackConfig c;
  c.layers = a.layers;
  c.experts = a.experts;
  c.top_k = a.top_k;
  c.hidden = a.hidden;
  c.inter = a.inter;
  c.shared_inter = a.shared_inter;
  c.slots = a.slots[0];
  c.max_batch = a.batch;
  c.host_threads = a.threads;
  c.overlap.overlap = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto stack_or = SyntheticMoeStack::Create(c);
  CHECK_OK(stack_or.status());
  SyntheticMoeStack& stack = **stack_or;
  const double setup_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::printf("%s, %s, commit %s; store %.1f GB pinned (%.2f MiB per expert), set up in %.0f s\n",
              prop.name, date, a.commit.c_str(),
              stack.bytes_per_expert() * double(c.layers) * c.experts / 1e9,
              stack.bytes_per_expert() / 1048576.0, setup_s);

  nlohmann::json out;
  out["machine"] = prop.name;
  out["date"] = date;
  out["commit"] = a.commit;
  out["config"] = {{"layers", c.layers},     {"experts", c.experts}, {"top_k", c.top_k},
                   {"hidden", c.hidden},     {"inter", c.inter},     {"shared_inter", c.shared_inter},
                   {"batch", a.batch},       {"steps", a.steps},     {"pairs", a.pairs},
                   {"warmup", a.warmup},     {"bytes_per_expert", stack.bytes_per_expert()}};
  out["results"] = nlohmann::json::array();
  std::printf("\n| slots | misses/token | mode | off ms (median/mean) | on ms (median/mean) | "
              "gain ms (median/mean) | ideal ms | reached | pair noise ms |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> stage_rows;
  for (int slots : a.slots) {
    CHECK_OK(stack.ResetCache(slots));
    Runner runner(&stack, a.batch);
    runner.Capture();
    // Warm-up: fill the cache to its steady state and warm clocks, both modes, both arms.
    for (bool graph : {true, false}) {
      for (bool on : {false, true}) runner.Run(graph, on, std::max(1, a.warmup / 4));
    }
    double ideal, copy, shared, misses, stage[4];
    runner.MeasureIdeal(16, &ideal, &copy, &shared, &misses, stage);
    nlohmann::json row = {{"slots", slots},       {"misses_per_token", misses},
                          {"ideal_gain_ms", ideal}, {"copy_ms", copy},
                          {"shared_ms", shared},
                          {"serial_stage_ms", {{"router", stage[0]}, {"ensure_experts", stage[1]},
                                               {"copy_and_shared", stage[2]},
                                               {"consumer", stage[3]}}}};
    stage_rows.push_back(absl::StrFormat(
        "| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |", slots, stage[0], stage[1], copy,
        shared, stage[2], stage[3]));
    for (bool graph : {true, false}) {
      std::vector<double> off, on, gain;
      for (int p = 0; p < a.pairs; ++p) {
        // Rotate the order: off first in even pairs, on first in odd ones.
        double t_off, t_on;
        if (p % 2 == 0) {
          t_off = runner.Run(graph, false, a.steps);
          t_on = runner.Run(graph, true, a.steps);
        } else {
          t_on = runner.Run(graph, true, a.steps);
          t_off = runner.Run(graph, false, a.steps);
        }
        off.push_back(t_off);
        on.push_back(t_on);
        gain.push_back(t_off - t_on);
      }
      const double noise = StdDev(gain);
      const double reached = ideal > 0 ? Median(gain) / ideal : 0;
      row[graph ? "graph" : "eager"] = {
          {"off_ms", off},          {"on_ms", on},
          {"off_median", Median(off)}, {"off_mean", Mean(off)},
          {"on_median", Median(on)},   {"on_mean", Mean(on)},
          {"gain_median", Median(gain)}, {"gain_mean", Mean(gain)},
          {"gain_noise_sd", noise},   {"fraction_of_ideal", reached},
          {"ideal_within_noise", ideal <= 2 * noise}};
      std::printf("| %d | %.1f | %s | %.3f / %.3f | %.3f / %.3f | %.3f / %.3f | %.3f | %.0f%%%s | "
                  "%.3f |\n",
                  slots, misses, graph ? "graph" : "eager", Median(off), Mean(off), Median(on),
                  Mean(on), Median(gain), Mean(gain), ideal, 100 * reached,
                  ideal <= 2 * noise ? " (ideal within noise)" : "", noise);
    }
    out["results"].push_back(row);
    std::fflush(stdout);
  }
  std::printf("\nThe serial step (eager, overlap off) by stage, ms per step, summed over layers:\n\n"
              "| slots | router | ensure_experts | copy_missing | shared expert | copy + shared | "
              "checksum + combine |\n|---|---|---|---|---|---|---|\n");
  for (const std::string& r : stage_rows) std::printf("%s\n", r.c_str());
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    f << out.dump(2) << "\n";
  }
  return 0;
}

#else

int Main(const Args&) {
  std::fprintf(stderr, "overlap_bench: built without CUDA\n");
  return 1;
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::overlap_test

int main(int argc, char** argv) {
  moe::overlap_test::Args args;
  if (!moe::overlap_test::ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr, "bad arguments; see the comment at the top of overlap_bench.cc\n");
    return 2;
  }
  return moe::overlap_test::Main(args);
}
