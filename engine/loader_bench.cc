// Load time of a model folder per expert format (the repacking cost of each format shows here):
//
//   tools/bazel run --config=opt //engine:loader_bench -- --model=DIR [--threads=N]
//       [--progress] [--benchmark_filter=...]
//
// DIR: any HF folder the loader takes, e.g. one from
//   make_tiny_model --family qwen3_moe --out DIR --layers 4 --hidden 1024 --experts 32
//       --moe_intermediate 512
// bytes_per_second counts the checkpoint's tensor bytes (what the load reads).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/formats.h"
#include "engine/loader.h"
#include "engine/safetensors.h"

namespace moe::engine {
namespace {

std::string g_model;
int g_threads = 0;
bool g_progress = false;

void BM_Load(benchmark::State& state, common::WeightFormat format) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(g_model);
  if (!ck.ok()) {
    state.SkipWithError(std::string(ck.status().message()).c_str());
    return;
  }
  const uint64_t bytes = (*ck)->total_tensor_bytes();
  LoadOptions o;
  o.expert_format = format;
  o.threads = g_threads;
  o.progress = g_progress;
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<ModelWeights>> w = LoadModel(g_model, o);
    if (!w.ok()) {
      state.SkipWithError(std::string(w.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(w->get());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

}  // namespace
}  // namespace moe::engine

int main(int argc, char** argv) {
  // Our flags first; Google Benchmark takes the rest.
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--model=", 8) == 0) {
      moe::engine::g_model = argv[i] + 8;
    } else if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      moe::engine::g_threads = std::atoi(argv[i] + 10);
    } else if (std::strcmp(argv[i], "--progress") == 0) {
      moe::engine::g_progress = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (moe::engine::g_model.empty()) {
    std::fprintf(stderr,
                 "usage: loader_bench --model=DIR [--threads=N] [--progress] [benchmark flags]\n");
    return 2;
  }
  for (moe::common::WeightFormat f :
       {moe::common::WeightFormat::kBf16, moe::common::WeightFormat::kFp8Block,
        moe::common::WeightFormat::kQ4_0, moe::common::WeightFormat::kNvfp4,
        moe::common::WeightFormat::kMxfp4}) {
    benchmark::RegisterBenchmark(
        ("BM_Load/" + std::string(moe::common::WeightFormatName(f))).c_str(),
        [f](benchmark::State& s) { moe::engine::BM_Load(s, f); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
