// The overlap of the routed-expert miss copy with the shared expert, end to end on a synthetic MoE
// stack wired to moe_cache's ensure and gather kernels:
//  - eager steps and two captured graphs (buckets 1 and 4), replayed over 192 steps whose routes
//    change every step, give hidden states byte-identical to a single-stream (overlap off, eager)
//    reference, every consumer checksum equal to the store's, and slot maps equal to the CPU
//    mirror of ensure_experts;
//  - an aliased side stream is refused;
//  - the captured step has two branches per layer, the fork and join edges in place, and no node
//    outside the plan; with the overlap off it is one chain;
//  - a raw cudaMalloc inside the captured step fails with the capture guard's error.
// GPU test: skips without a GPU.
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "common/gpu_test_util.h"
#include "graph_capture/capture.h"
#include "graph_capture/graph_cache.h"
#include "graph_capture/topology.h"
#include "gtest/gtest.h"
#include "moe_cache/ensure_cpu.h"
#include "moe_overlap/stream_pair.h"
#include "tests/overlap/synthetic_stack.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::overlap_test {
namespace {

StackConfig SmallConfig(bool overlap) {
  StackConfig c;
  c.layers = 4;
  c.experts = 32;
  c.top_k = 4;
  c.hidden = 256;
  c.inter = 256;  // 110 KiB per routed expert
  c.shared_inter = 128;
  c.slots = 48;  // of 128 experts: misses every step
  c.max_batch = 4;
  c.seed = 5;
  c.overlap.overlap = overlap;
  return c;
}

TEST(OverlapTest, WithoutCudaTheStackIsUnavailable) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a GPU is visible";
  EXPECT_EQ(SyntheticMoeStack::Create(SmallConfig(true)).status().code(),
            absl::StatusCode::kUnavailable);
}

#if MOE_HAVE_CUDA

std::vector<int32_t> Tokens(std::mt19937& rng, int batch) {
  std::vector<int32_t> t(batch);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 100000);
  return t;
}

TEST(OverlapTest, EagerAndTwoGraphsMatchTheSingleStreamReference) {
  MOE_SKIP_WITHOUT_GPU();
  auto ref_or = SyntheticMoeStack::Create(SmallConfig(false));
  ASSERT_TRUE(ref_or.ok()) << ref_or.status();
  auto sub_or = SyntheticMoeStack::Create(SmallConfig(true));
  ASSERT_TRUE(sub_or.ok()) << sub_or.status();
  SyntheticMoeStack& ref = **ref_or;
  SyntheticMoeStack& sub = **sub_or;
  const StackConfig& c = sub.config();
  moe_cache::CacheConfig mirror_config{c.layers, c.experts, c.slots,
                                       moe_cache::DefaultPolicyParams(c.policy), {}};
  auto mirror_or = moe_cache::CpuExpertCache::Create(mirror_config);
  ASSERT_TRUE(mirror_or.ok());
  moe_cache::CpuExpertCache mirror = std::move(*mirror_or);

  graph_capture::GraphCache graphs(2);
  auto step = [&](int bucket, CUstream_st*) { return sub.EnqueueStep(bucket); };
  std::mt19937 rng(11);
  constexpr int kSteps = 192;
  int total_misses = 0, changed_routes = 0;
  std::vector<int32_t> previous_ids;
  for (int s = 0; s < kSteps; ++s) {
    // Eager batch 2, graph bucket 1, graph bucket 4, in turn.
    const int mode = s % 3;
    const int batch = mode == 0 ? 2 : mode == 1 ? 1 : 4;
    const std::vector<int32_t> tokens = Tokens(rng, batch);
    ASSERT_TRUE(ref.SetTokens(tokens).ok());
    ASSERT_TRUE(ref.EnqueueStep(batch).ok());
    ASSERT_TRUE(sub.SetTokens(tokens).ok());
    if (mode == 0) {
      ASSERT_TRUE(sub.EnqueueStep(batch).ok());
    } else {
      absl::Status replay = graphs.Replay(batch, sub.compute(), step);
      ASSERT_TRUE(replay.ok()) << replay;
    }
    auto want = ref.ReadStep(batch);
    auto got = sub.ReadStep(batch);
    ASSERT_TRUE(want.ok() && got.ok());
    ASSERT_EQ(std::memcmp(want->hidden.data(), got->hidden.data(), want->hidden.size() * 4), 0)
        << "step " << s;
    ASSERT_EQ(want->ids, got->ids) << "step " << s;
    ASSERT_EQ(want->slots, got->slots) << "step " << s;
    ASSERT_EQ(want->checksums, got->checksums) << "step " << s;
    ASSERT_EQ(sub.CountMismatches(*got, batch), 0) << "step " << s;
    ASSERT_EQ(ref.CountMismatches(*want, batch), 0) << "step " << s;
    // The CPU mirror, fed the same routes, makes the same decisions.
    const int n = batch * c.top_k;
    for (int l = 0; l < c.layers; ++l) {
      std::vector<int32_t> ids(got->ids.begin() + l * n, got->ids.begin() + (l + 1) * n);
      auto r = mirror.Ensure(l, ids, batch, c.top_k);
      ASSERT_TRUE(r.ok());
      ASSERT_EQ(r->slots, std::vector<int32_t>(got->slots.begin() + l * n,
                                               got->slots.begin() + (l + 1) * n))
          << "step " << s << " layer " << l;
      ASSERT_EQ(static_cast<int>(r->plan.size()), got->plan_counts[l]);
      total_misses += got->plan_counts[l];
    }
    if (got->ids != previous_ids) ++changed_routes;
    previous_ids = got->ids;
  }
  EXPECT_EQ(changed_routes, kSteps);
  EXPECT_GT(total_misses, kSteps);  // the copy really runs
  EXPECT_EQ(graphs.captures(), 2);
  // The device slot map equals the mirror's at the end.
  std::vector<int32_t> slot_of(c.layers * c.experts), expert_of_slot(c.slots);
  std::vector<uint32_t> last_use(c.slots), freq(c.layers * c.experts), counter(1);
  std::vector<uint8_t> pinned(c.layers * c.experts);
  moe_cache::CacheStateView host{slot_of.data(), expert_of_slot.data(), last_use.data(),
                                 freq.data(),    pinned.data(),         counter.data(),
                                 c.layers,       c.experts,             c.slots,
                                 mirror_config.params};
  ASSERT_TRUE(sub.cache_state().Download(host).ok());
  EXPECT_EQ(slot_of, mirror.slot_of());
  EXPECT_EQ(expert_of_slot, mirror.expert_of_slot());
  EXPECT_EQ(counter[0], mirror.call_counter());
}

TEST(OverlapTest, AliasedSideStreamIsRefused) {
  MOE_SKIP_WITHOUT_GPU();
  auto stack = SyntheticMoeStack::Create(SmallConfig(true));
  ASSERT_TRUE(stack.ok()) << stack.status();
  auto pair = moe_overlap::StreamPair::CreateWithStreams({}, (*stack)->compute(),
                                                         (*stack)->compute());
  ASSERT_FALSE(pair.ok());
  EXPECT_EQ(pair.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE((*stack)->streams().side(), (*stack)->streams().compute());
}

// Nodes that one call of `fn` on the compute stream adds to a graph.
int NodesOf(SyntheticMoeStack& stack, absl::FunctionRef<absl::Status(CUstream_st*)> fn) {
  auto g = graph_capture::CaptureGraph(stack.compute(), fn);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return -1;
  auto t = graph_capture::ReadTopology(g->get());
  EXPECT_TRUE(t.ok());
  return t.ok() ? static_cast<int>(t->nodes.size()) : -1;
}

TEST(OverlapTest, CapturedStepHasTwoBranchesPerLayerJoinedBeforeTheConsumer) {
  MOE_SKIP_WITHOUT_GPU();
  auto stack_or = SyntheticMoeStack::Create(SmallConfig(true));
  ASSERT_TRUE(stack_or.ok()) << stack_or.status();
  SyntheticMoeStack& stack = **stack_or;
  const int L = stack.config().layers;
  const int router = NodesOf(stack, [&](CUstream_st* s) { return stack.EnqueueRouter(0, 1, s); });
  const int shared =
      NodesOf(stack, [&](CUstream_st* s) { return stack.EnqueueSharedExpert(0, 1, s); });
  ASSERT_GE(router, 2);  // the router GEMM and top-k at least
  ASSERT_GE(shared, 3);  // two GEMMs and the gate

  auto g = graph_capture::CaptureGraph(stack.compute(),
                                       [&](CUstream_st*) { return stack.EnqueueStep(1); });
  ASSERT_TRUE(g.ok()) << g.status();
  auto t = graph_capture::ReadTopology(g->get());
  ASSERT_TRUE(t.ok()) << t.status();
  // The plan: embed, then per layer router + ensure + copy + shared expert + checksum + combine.
  EXPECT_EQ(static_cast<int>(t->nodes.size()), 1 + L * (router + shared + 4));
  for (const auto& node : t->nodes) {
    EXPECT_EQ(node.kind, graph_capture::NodeKind::kKernel) << node.kernel;
  }
  const std::vector<int> copies = t->KernelsNamed("CopyMissingKernel");
  const std::vector<int> ensures = t->KernelsNamed("EnsureExpertsKernel");
  const std::vector<int> checks = t->KernelsNamed("ChecksumKernel");
  ASSERT_EQ(static_cast<int>(copies.size()), L);
  ASSERT_EQ(static_cast<int>(ensures.size()), L);
  ASSERT_EQ(static_cast<int>(checks.size()), L);
  ASSERT_EQ(t->KernelsNamed("EmbedKernel").size(), 1u);
  ASSERT_EQ(static_cast<int>(t->KernelsNamed("CombineKernel").size()), L);
  const std::set<int> ensure_set(ensures.begin(), ensures.end());
  const std::set<int> check_set(checks.begin(), checks.end());
  std::set<int> forks, joins;
  for (int copy : copies) {
    // Fork: the copy starts after ensure_experts and nothing else.
    const std::vector<int> pred = t->Predecessors(copy);
    ASSERT_EQ(pred.size(), 1u);
    EXPECT_TRUE(ensure_set.count(pred[0]));
    forks.insert(pred[0]);
    // Join: the copy's only successor is the consumer.
    const std::vector<int> succ = t->Successors(copy);
    ASSERT_EQ(succ.size(), 1u);
    EXPECT_TRUE(check_set.count(succ[0]));
    joins.insert(succ[0]);
  }
  EXPECT_EQ(forks, ensure_set);  // one fork per layer
  EXPECT_EQ(joins, check_set);   // one join per layer
  for (int e : ensures) EXPECT_EQ(t->Successors(e).size(), 2u);      // two branches
  for (int ch : checks) EXPECT_EQ(t->Predecessors(ch).size(), 2u);   // both joined
  // Every other node is on a single chain.
  for (int i = 0; i < static_cast<int>(t->nodes.size()); ++i) {
    if (ensure_set.count(i) || check_set.count(i)) continue;
    EXPECT_LE(t->Predecessors(i).size(), 1u) << t->nodes[i].kernel;
    EXPECT_LE(t->Successors(i).size(), 1u) << t->nodes[i].kernel;
  }

  // With the overlap off the step is one chain of the same nodes.
  auto off_or = SyntheticMoeStack::Create(SmallConfig(false));
  ASSERT_TRUE(off_or.ok());
  auto off = graph_capture::CaptureGraph((*off_or)->compute(),
                                         [&](CUstream_st*) { return (*off_or)->EnqueueStep(1); });
  ASSERT_TRUE(off.ok()) << off.status();
  auto chain = graph_capture::ReadTopology(off->get());
  ASSERT_TRUE(chain.ok());
  EXPECT_EQ(chain->nodes.size(), t->nodes.size());
  EXPECT_EQ(chain->edges.size(), chain->nodes.size() - 1);
  for (int i = 0; i < static_cast<int>(chain->nodes.size()); ++i) {
    EXPECT_LE(chain->Predecessors(i).size(), 1u);
    EXPECT_LE(chain->Successors(i).size(), 1u);
  }
}

TEST(OverlapTest, RawMallocInsideTheCapturedStepFailsWithTheGuardsError) {
  MOE_SKIP_WITHOUT_GPU();
  auto stack_or = SyntheticMoeStack::Create(SmallConfig(true));
  ASSERT_TRUE(stack_or.ok()) << stack_or.status();
  SyntheticMoeStack& stack = **stack_or;
  void* leaked = nullptr;
  auto g = graph_capture::CaptureGraph(stack.compute(), [&](CUstream_st*) -> absl::Status {
    absl::Status s = stack.EnqueueStep(1);
    if (!s.ok()) return s;
    if (cudaMalloc(&leaked, 1 << 20) != cudaSuccess) return absl::InternalError("cudaMalloc");
    return absl::OkStatus();
  });
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(g.status().message().find("capture guard"), absl::string_view::npos) << g.status();
  if (leaked != nullptr) cudaFree(leaked);
  // The stack still runs: both streams left capture mode.
  std::mt19937 rng(3);
  ASSERT_TRUE(stack.SetTokens(Tokens(rng, 1)).ok());
  ASSERT_TRUE(stack.EnqueueStep(1).ok());
  auto r = stack.ReadStep(1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(stack.CountMismatches(*r, 1), 0);
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::overlap_test
