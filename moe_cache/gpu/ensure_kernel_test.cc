// The CUDA ensure kernel against the CPU mirror: identical slot maps, policy state, slot ids and
// miss plans after every step of a long routed trace (GPU test; skips without a GPU).
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/gpu_test_util.h"
#include "gtest/gtest.h"
#include "moe_cache/ensure_cpu.h"
#include "moe_cache/gpu/ensure_kernels.h"
#include "moe_cache/hybrid_split.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::moe_cache {
namespace {

#if MOE_HAVE_CUDA

// Skewed routing with temporal locality: per layer a random rank permutation and a Zipf-like
// draw; each token keeps some of the previous token's experts. Rows >= real_rows are padding.
class Router {
 public:
  Router(int layers, int experts, int k, uint32_t seed)
      : layers_(layers), experts_(experts), k_(k), rng_(seed), prev_(layers) {
    perm_.resize(layers);
    for (auto& p : perm_) {
      p.resize(experts);
      for (int e = 0; e < experts; ++e) p[e] = e;
      std::shuffle(p.begin(), p.end(), rng_);
    }
    for (int r = 0; r < experts; ++r) cdf_.push_back((r ? cdf_.back() : 0.0) + 1.0 / (r + 1.0));
  }

  // ids [tokens * k] for one layer.
  std::vector<int32_t> Route(int layer, int tokens, int real_rows) {
    std::vector<int32_t> ids(static_cast<size_t>(tokens) * k_, -1);
    std::uniform_real_distribution<double> u(0.0, cdf_.back());
    std::bernoulli_distribution keep(0.5);
    for (int t = 0; t < real_rows; ++t) {
      std::vector<int32_t> row;
      for (int32_t e : prev_[layer]) {
        if (static_cast<int>(row.size()) < k_ && keep(rng_)) row.push_back(e);
      }
      while (static_cast<int>(row.size()) < k_) {
        const int rank = static_cast<int>(std::lower_bound(cdf_.begin(), cdf_.end(), u(rng_)) -
                                          cdf_.begin());
        const int32_t e = perm_[layer][std::min(rank, experts_ - 1)];
        if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
      }
      std::copy(row.begin(), row.end(), ids.begin() + static_cast<size_t>(t) * k_);
      prev_[layer] = row;
    }
    return ids;
  }

 private:
  int layers_, experts_, k_;
  std::mt19937 rng_;
  std::vector<std::vector<int32_t>> perm_;
  std::vector<double> cdf_;
  std::vector<std::vector<int32_t>> prev_;
};

struct Case {
  int32_t policy;
  int layers, experts, k, slots, tokens_per_step, steps;
  bool pin;
  bool hybrid = false;  // split the misses with the CPU (a 50 : 70 GB/s profile)
};

void RunMirror(const Case& c) {
  CacheConfig config;
  config.num_layers = c.layers;
  config.num_experts = c.experts;
  config.num_slots = c.slots;
  config.params = DefaultPolicyParams(c.policy);
  if (c.hybrid) {
    auto table = FetchTable(BandwidthProfile{50.0, 70.0, true}, c.experts);
    ASSERT_TRUE(table.ok()) << table.status();
    config.fetch_of_misses = *table;
  }
  auto cpu_or = CpuExpertCache::Create(config);
  ASSERT_TRUE(cpu_or.ok()) << cpu_or.status();
  CpuExpertCache cpu = std::move(*cpu_or);
  auto dev_or = DeviceCacheState::Create(c.layers, c.experts, c.slots, config.params);
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  DeviceCacheState& dev = **dev_or;

  const int n = c.tokens_per_step * c.k;
  const uint64_t le = static_cast<uint64_t>(c.layers) * c.experts;
  int32_t *d_ids, *d_slots, *d_count;
  MissPlanEntry* d_plan;
  ASSERT_EQ(cudaMalloc(&d_ids, sizeof(int32_t) * n * c.layers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_slots, sizeof(int32_t) * n * c.layers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_count, sizeof(int32_t) * c.layers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * n * c.layers), cudaSuccess);
  int32_t* d_table = nullptr;
  if (c.hybrid) {
    const size_t bytes = sizeof(int32_t) * config.fetch_of_misses.size();
    ASSERT_EQ(cudaMalloc(&d_table, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_table, config.fetch_of_misses.data(), bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  int64_t cpu_routes = 0;

  std::vector<int32_t> h_slot_of(le), h_expert_of_slot(c.slots), h_slots(n * c.layers),
      h_count(c.layers);
  std::vector<uint32_t> h_last_use(c.slots), h_freq(le);
  std::vector<uint8_t> h_pinned(le);
  std::vector<MissPlanEntry> h_plan(static_cast<size_t>(n) * c.layers);
  uint32_t h_counter = 0;
  CacheStateView host{h_slot_of.data(), h_expert_of_slot.data(), h_last_use.data(),
                      h_freq.data(),    h_pinned.data(),         &h_counter,
                      c.layers,         c.experts,               c.slots,
                      config.params};

  Router router(c.layers, c.experts, c.k, 1234u + c.policy);
  std::mt19937 rng(99);
  int64_t total_misses = 0;
  for (int step = 0; step < c.steps; ++step) {
    if (c.pin && step % 500 == 250) {
      // Re-pin a random set of experts (as the host pinner does between steps) on both sides.
      std::vector<uint8_t> pins(le, 0);
      for (int i = 0; i < c.slots / 4; ++i) pins[rng() % le] = 1;
      for (uint64_t g = 0; g < le; ++g) cpu.SetPinned(static_cast<int32_t>(g), pins[g] != 0);
      ASSERT_TRUE(dev.UploadPinned(pins.data()).ok());
    }
    // Some steps pad their last token (a batch bucket larger than the live batch).
    const int real_rows = (step % 3 == 2 && c.tokens_per_step > 1) ? c.tokens_per_step - 1
                                                                   : c.tokens_per_step;
    std::vector<std::vector<MissPlanEntry>> cpu_plans(c.layers);
    std::vector<std::vector<int32_t>> cpu_slots(c.layers);
    for (int layer = 0; layer < c.layers; ++layer) {
      std::vector<int32_t> ids = router.Route(layer, c.tokens_per_step, real_rows);
      ASSERT_EQ(cudaMemcpy(d_ids + layer * n, ids.data(), sizeof(int32_t) * n,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_TRUE(LaunchEnsureExperts(dev.view(), layer, d_ids + layer * n, n,
                                      d_slots + layer * n, d_count + layer, d_plan + layer * n,
                                      nullptr, nullptr, d_table)
                      .ok());
      auto r = cpu.Ensure(layer, ids, c.tokens_per_step, c.k);
      ASSERT_TRUE(r.ok()) << r.status();
      cpu_plans[layer] = r->plan;
      cpu_slots[layer] = r->slots;
      total_misses += static_cast<int64_t>(r->plan.size());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(dev.Download(host).ok());
    ASSERT_EQ(cudaMemcpy(h_slots.data(), d_slots, sizeof(int32_t) * n * c.layers,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h_count.data(), d_count, sizeof(int32_t) * c.layers,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h_plan.data(), d_plan, sizeof(MissPlanEntry) * n * c.layers,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(h_slot_of, cpu.slot_of()) << "slot map differs after step " << step;
    ASSERT_EQ(h_expert_of_slot, cpu.expert_of_slot()) << "step " << step;
    ASSERT_EQ(h_last_use, cpu.last_use()) << "step " << step;
    ASSERT_EQ(h_freq, cpu.freq()) << "step " << step;
    ASSERT_EQ(h_counter, cpu.call_counter()) << "step " << step;
    for (int layer = 0; layer < c.layers; ++layer) {
      ASSERT_EQ(h_count[layer], static_cast<int32_t>(cpu_plans[layer].size()))
          << "step " << step << " layer " << layer;
      for (size_t m = 0; m < cpu_plans[layer].size(); ++m) {
        ASSERT_EQ(h_plan[layer * n + m].expert, cpu_plans[layer][m].expert);
        ASSERT_EQ(h_plan[layer * n + m].slot, cpu_plans[layer][m].slot);
      }
      ASSERT_TRUE(std::equal(cpu_slots[layer].begin(), cpu_slots[layer].end(),
                             h_slots.begin() + layer * n));
      cpu_routes += std::count(cpu_slots[layer].begin(), cpu_slots[layer].end(), kCpuSlot);
    }
  }
  // The trace must actually exercise eviction, and the split its CPU side.
  EXPECT_GT(total_misses, static_cast<int64_t>(c.slots) * 2);
  if (c.hybrid) {
    EXPECT_GT(cpu_routes, total_misses / 4);
  } else {
    EXPECT_EQ(cpu_routes, 0);
  }
  cudaFree(d_table);
  cudaFree(d_ids);
  cudaFree(d_slots);
  cudaFree(d_count);
  cudaFree(d_plan);
}

// The hybrid split's decisions (which misses take a slot, which go to the CPU, and every victim)
// equal the CPU mirror's, with pinning and padded rows.
TEST(EnsureKernelTest, HybridSplitMatchesCpuMirror) {
  MOE_SKIP_WITHOUT_GPU();
  RunMirror({kPolicyScored, 8, 128, 8, 8 * 128 / 4, 4, 2000, true, true});
}

TEST(EnsureKernelTest, LruMatchesCpuMirrorOver10000Steps) {
  MOE_SKIP_WITHOUT_GPU();
  RunMirror({kPolicyLru, 48, 128, 8, 48 * 128 / 4, 1, 10000, false});
}

TEST(EnsureKernelTest, ScoredWithPinningAndPaddingMatchesCpuMirror) {
  MOE_SKIP_WITHOUT_GPU();
  RunMirror({kPolicyScored, 48, 128, 8, 48 * 128 / 10, 3, 10000, true});
}

TEST(EnsureKernelTest, LfuSmallPoolMatchesCpuMirror) {
  MOE_SKIP_WITHOUT_GPU();
  // Fewer slots than one call's experts: some misses stay unplaced.
  RunMirror({kPolicyLfu, 4, 64, 8, 12, 4, 2000, true});
}

TEST(EnsureKernelTest, CapturedGraphReplaysLikeTheMirror) {
  MOE_SKIP_WITHOUT_GPU();
  // One decode step of all layers captured once (ids live in a fixed device buffer), replayed
  // with fresh routing each step: the kernel must read the ids and state at replay time.
  constexpr int kLayers = 8, kExperts = 64, kTopK = 8, kSlots = 96, kSteps = 300;
  CacheConfig config{kLayers, kExperts, kSlots, DefaultPolicyParams(kPolicyScored), {}};
  auto cpu_or = CpuExpertCache::Create(config);
  ASSERT_TRUE(cpu_or.ok());
  CpuExpertCache cpu = std::move(*cpu_or);
  auto dev_or = DeviceCacheState::Create(kLayers, kExperts, kSlots, config.params);
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  int32_t *d_ids, *d_slots, *d_count;
  MissPlanEntry* d_plan;
  ASSERT_EQ(cudaMalloc(&d_ids, sizeof(int32_t) * kTopK * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_slots, sizeof(int32_t) * kTopK * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_count, sizeof(int32_t) * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * kTopK * kLayers), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(LaunchEnsureExperts((*dev_or)->view(), layer, d_ids + layer * kTopK, kTopK,
                                    d_slots + layer * kTopK, d_count + layer,
                                    d_plan + layer * kTopK, stream)
                    .ok());
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  Router router(kLayers, kExperts, kTopK, 77);
  std::vector<int32_t> slots(kTopK * kLayers), counts(kLayers);
  std::vector<MissPlanEntry> plans(kTopK * kLayers);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<int32_t> ids;
    std::vector<EnsureResult> expected;
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<int32_t> layer_ids = router.Route(layer, 1, 1);
      auto r = cpu.Ensure(layer, layer_ids, 1, kTopK);
      ASSERT_TRUE(r.ok());
      expected.push_back(*r);
      ids.insert(ids.end(), layer_ids.begin(), layer_ids.end());
    }
    ASSERT_EQ(cudaMemcpyAsync(d_ids, ids.data(), sizeof(int32_t) * ids.size(),
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(slots.data(), d_slots, sizeof(int32_t) * slots.size(),
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(counts.data(), d_count, sizeof(int32_t) * kLayers,
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(plans.data(), d_plan, sizeof(MissPlanEntry) * plans.size(),
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(std::equal(expected[layer].slots.begin(), expected[layer].slots.end(),
                             slots.begin() + layer * kTopK))
          << "step " << step << " layer " << layer;
      ASSERT_EQ(counts[layer], static_cast<int32_t>(expected[layer].plan.size()));
      for (size_t m = 0; m < expected[layer].plan.size(); ++m) {
        ASSERT_EQ(plans[layer * kTopK + m].expert, expected[layer].plan[m].expert);
        ASSERT_EQ(plans[layer * kTopK + m].slot, expected[layer].plan[m].slot);
      }
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_ids);
  cudaFree(d_slots);
  cudaFree(d_count);
  cudaFree(d_plan);
}

// The id rule on the GPU: an id >= E inside a captured step is skipped like padding (the state
// evolves exactly as the mirror's on the same ids with that id made padding) and raises the
// error flag, which TakeEnsureError reports once as InvalidArgument and clears. Launches without
// a flag keep their old behaviour.
TEST(EnsureKernelTest, CapturedKernelFlagsIdAtOrAboveExperts) {
  MOE_SKIP_WITHOUT_GPU();
  constexpr int kLayers = 2, kExperts = 16, kTopK = 4, kSlots = 8;
  CacheConfig config{kLayers, kExperts, kSlots, DefaultPolicyParams(kPolicyLru), {}};
  auto cpu_or = CpuExpertCache::Create(config);
  ASSERT_TRUE(cpu_or.ok());
  CpuExpertCache cpu = std::move(*cpu_or);
  auto dev_or = DeviceCacheState::Create(kLayers, kExperts, kSlots, config.params);
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  int32_t *d_ids, *d_slots, *d_count, *d_flag;
  MissPlanEntry* d_plan;
  ASSERT_EQ(cudaMalloc(&d_ids, sizeof(int32_t) * kTopK * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_slots, sizeof(int32_t) * kTopK * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_count, sizeof(int32_t) * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * kTopK * kLayers), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_flag, sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_flag, 0, sizeof(int32_t)), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(LaunchEnsureExperts((*dev_or)->view(), layer, d_ids + layer * kTopK, kTopK,
                                    d_slots + layer * kTopK, d_count + layer,
                                    d_plan + layer * kTopK, stream, d_flag)
                    .ok());
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Steps: clean, one id == E in layer 1, clean again, an id far above E in layer 0.
  const std::vector<std::vector<int32_t>> steps = {
      {0, 1, 2, 3, 4, 5, -1, 6},
      {0, 7, 8, 9, 10, kExperts, 11, -1},
      {1, 2, 12, 13, 14, 15, 3, 4},
      {kExperts + 1000, 5, 6, -1, 7, 8, 9, 0},
  };
  const bool bad[] = {false, true, false, true};
  std::vector<int32_t> slots(kTopK * kLayers);
  for (size_t step = 0; step < steps.size(); ++step) {
    const std::vector<int32_t>& ids = steps[step];
    ASSERT_EQ(cudaMemcpyAsync(d_ids, ids.data(), sizeof(int32_t) * ids.size(),
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(slots.data(), d_slots, sizeof(int32_t) * slots.size(),
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    const absl::Status err = TakeEnsureError(d_flag, stream);
    if (bad[step]) {
      EXPECT_EQ(err.code(), absl::StatusCode::kInvalidArgument) << "step " << step;
    } else {
      EXPECT_TRUE(err.ok()) << "step " << step << ": " << err;
    }
    EXPECT_TRUE(TakeEnsureError(d_flag, stream).ok()) << "the flag is cleared";
    // The mirror rejects the bad id; with it made padding, its decisions equal the kernel's.
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<int32_t> layer_ids(ids.begin() + layer * kTopK,
                                     ids.begin() + (layer + 1) * kTopK);
      bool has_bad = false;
      for (int32_t& id : layer_ids) {
        if (id >= kExperts) {
          id = -1;
          has_bad = true;
        }
      }
      if (has_bad) {
        std::vector<int32_t> raw(ids.begin() + layer * kTopK, ids.begin() + (layer + 1) * kTopK);
        EXPECT_EQ(cpu.Ensure(layer, raw, 1, kTopK).status().code(),
                  absl::StatusCode::kInvalidArgument);
      }
      auto r = cpu.Ensure(layer, layer_ids, 1, kTopK);
      ASSERT_TRUE(r.ok());
      EXPECT_TRUE(std::equal(r->slots.begin(), r->slots.end(), slots.begin() + layer * kTopK))
          << "step " << step << " layer " << layer;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_ids);
  cudaFree(d_slots);
  cudaFree(d_count);
  cudaFree(d_plan);
  cudaFree(d_flag);
}

#else
TEST(EnsureKernelTest, BuiltWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }
#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::moe_cache
