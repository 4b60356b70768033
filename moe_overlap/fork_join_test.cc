// The fork/join scope's stream ordering, eager and captured: the side branch starts after the
// compute work before the fork, the compute stream continues only after the side branch; errors
// still join; with the overlap off both branches run on the compute stream in order; captured,
// one scope gives exactly two branches with the fork and join edges. Skips without a GPU.
#include "moe_overlap/fork_join.h"

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "common/gpu_test_util.h"
#include "gtest/gtest.h"
#include "moe_overlap/stream_pair.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::moe_overlap {
namespace {

TEST(ForkJoinTest, WithoutCudaTheScopeReportsUnavailable) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a GPU is visible";
  // A pair cannot be had without CUDA, so the scope is only reachable through its status path;
  // the factory's error is what callers see.
  EXPECT_EQ(StreamPair::Create({}).status().code(), absl::StatusCode::kUnavailable);
}

#if MOE_HAVE_CUDA

// 64 MiB: long enough that a consumer that does not wait would read it half-written.
constexpr size_t kBytes = 64 << 20;

struct Buffers {
  uint8_t* host = nullptr;  // pinned source
  uint8_t* a = nullptr;     // written by the compute stream before the fork
  uint8_t* b = nullptr;     // written by the side branch
  uint8_t* c = nullptr;     // written by the compute stream after the join
  Buffers() {
    EXPECT_EQ(cudaMallocHost(&host, kBytes), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&a, kBytes), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b, kBytes), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&c, kBytes), cudaSuccess);
  }
  ~Buffers() {
    cudaFreeHost(host);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
  }
};

// compute: a <- host (pattern), fork; side: b <- a; compute: memset(c, 0); join; c <- b.
// Correct ordering leaves c == pattern.
absl::Status EnqueueLayer(const StreamPair& pair, Buffers& buf) {
  if (cudaMemcpyAsync(buf.a, buf.host, kBytes, cudaMemcpyHostToDevice, pair.compute()) != 0) {
    return absl::InternalError("copy a");
  }
  ForkJoinScope scope(pair);
  absl::Status s = scope.Side([&](CUstream_st* st) -> absl::Status {
    if (cudaMemcpyAsync(buf.b, buf.a, kBytes, cudaMemcpyDeviceToDevice, st) != 0) {
      return absl::InternalError("copy b");
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  s = scope.Compute([&](CUstream_st* st) -> absl::Status {
    return cudaMemsetAsync(buf.c, 0, kBytes, st) == 0 ? absl::OkStatus()
                                                       : absl::InternalError("memset c");
  });
  if (!s.ok()) return s;
  s = scope.Join();
  if (!s.ok()) return s;
  return cudaMemcpyAsync(buf.c, buf.b, kBytes, cudaMemcpyDeviceToDevice, pair.compute()) == 0
             ? absl::OkStatus()
             : absl::InternalError("copy c");
}

TEST(ForkJoinTest, EagerOrderingCarriesDataAcrossTheFork) {
  MOE_SKIP_WITHOUT_GPU();
  auto pair = StreamPair::Create({});
  ASSERT_TRUE(pair.ok()) << pair.status();
  Buffers buf;
  std::vector<uint8_t> out(kBytes);
  for (int round = 0; round < 4; ++round) {
    for (size_t i = 0; i < kBytes; ++i) buf.host[i] = static_cast<uint8_t>(i * 31 + round * 7);
    ASSERT_TRUE(EnqueueLayer(**pair, buf).ok());
    ASSERT_EQ(cudaMemcpyAsync(out.data(), buf.c, kBytes, cudaMemcpyDeviceToHost,
                              (*pair)->compute()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize((*pair)->compute()), cudaSuccess);
    ASSERT_EQ(std::memcmp(out.data(), buf.host, kBytes), 0) << "round " << round;
  }
}

TEST(ForkJoinTest, OverlapOffRunsBothBranchesOnTheComputeStreamInOrder) {
  MOE_SKIP_WITHOUT_GPU();
  OverlapOptions off;
  off.overlap = false;
  auto pair = StreamPair::Create(off);
  ASSERT_TRUE(pair.ok());
  std::vector<CUstream_st*> seen;
  ForkJoinScope scope(**pair);
  EXPECT_FALSE(scope.forked());
  ASSERT_TRUE(scope.Side([&](CUstream_st* s) {
                     seen.push_back(s);
                     return absl::OkStatus();
                   })
                  .ok());
  ASSERT_TRUE(scope.Compute([&](CUstream_st* s) {
                     seen.push_back(s);
                     return absl::OkStatus();
                   })
                  .ok());
  EXPECT_TRUE(scope.Join().ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], (*pair)->compute());
  EXPECT_EQ(seen[1], (*pair)->compute());
}

// Reads a captured graph back: node types and edges as index pairs.
struct Topology {
  std::vector<cudaGraphNodeType> types;
  std::vector<std::pair<int, int>> edges;
};

Topology Read(cudaGraph_t graph) {
  Topology t;
  size_t n = 0;
  EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &n), cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(n);
  EXPECT_EQ(cudaGraphGetNodes(graph, nodes.data(), &n), cudaSuccess);
  std::map<cudaGraphNode_t, int> index;
  for (size_t i = 0; i < n; ++i) {
    index[nodes[i]] = static_cast<int>(i);
    cudaGraphNodeType type;
    EXPECT_EQ(cudaGraphNodeGetType(nodes[i], &type), cudaSuccess);
    t.types.push_back(type);
  }
  size_t e = 0;
  EXPECT_EQ(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &e), cudaSuccess);
  std::vector<cudaGraphNode_t> from(e), to(e);
  std::vector<cudaGraphEdgeData> data(e);
  if (e > 0) {
    EXPECT_EQ(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &e), cudaSuccess);
  }
  for (size_t i = 0; i < e; ++i) t.edges.push_back({index[from[i]], index[to[i]]});
  return t;
}

TEST(ForkJoinTest, CapturedScopeHasTwoBranchesJoinedBeforeTheNextNode) {
  MOE_SKIP_WITHOUT_GPU();
  auto pair = StreamPair::Create({});
  ASSERT_TRUE(pair.ok());
  Buffers buf;
  cudaStream_t compute = (*pair)->compute();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(compute, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE(EnqueueLayer(**pair, buf).ok());
  ASSERT_EQ(cudaStreamEndCapture(compute, &graph), cudaSuccess);
  Topology t = Read(graph);
  // Nodes: a <- host, b <- a (side), memset c (compute), c <- b; events of the pair leave no node.
  ASSERT_EQ(t.types.size(), 4u);
  int copy_a = -1, copy_b = -1, memset_c = -1, copy_c = -1;
  for (int i = 0; i < 4; ++i) {
    if (t.types[i] == cudaGraphNodeTypeMemset) memset_c = i;
  }
  ASSERT_GE(memset_c, 0);
  // The roots and sinks identify the copies: a has no predecessor, c has two.
  std::map<int, int> in_degree, out_degree;
  for (auto [f, to] : t.edges) {
    ++out_degree[f];
    ++in_degree[to];
  }
  for (int i = 0; i < 4; ++i) {
    if (i == memset_c) continue;
    if (in_degree[i] == 0) copy_a = i;
    else if (in_degree[i] == 2) copy_c = i;
    else copy_b = i;
  }
  ASSERT_GE(copy_a, 0);
  ASSERT_GE(copy_b, 0);
  ASSERT_GE(copy_c, 0);
  std::vector<std::pair<int, int>> expected = {
      {copy_a, copy_b}, {copy_a, memset_c}, {copy_b, copy_c}, {memset_c, copy_c}};
  std::sort(expected.begin(), expected.end());
  std::sort(t.edges.begin(), t.edges.end());
  EXPECT_EQ(t.edges, expected);
  // And it replays with the right data.
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < kBytes; ++i) buf.host[i] = static_cast<uint8_t>(i * 13 + 5);
  ASSERT_EQ(cudaGraphLaunch(exec, compute), cudaSuccess);
  std::vector<uint8_t> out(kBytes);
  ASSERT_EQ(cudaMemcpyAsync(out.data(), buf.c, kBytes, cudaMemcpyDeviceToHost, compute),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_EQ(std::memcmp(out.data(), buf.host, kBytes), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(ForkJoinTest, AFailingSideBranchStillJoinsSoCaptureEnds) {
  MOE_SKIP_WITHOUT_GPU();
  auto pair = StreamPair::Create({});
  ASSERT_TRUE(pair.ok());
  Buffers buf;
  cudaStream_t compute = (*pair)->compute();
  ASSERT_EQ(cudaStreamBeginCapture(compute, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  bool compute_ran = false;
  {
    ForkJoinScope scope(**pair);
    EXPECT_TRUE(scope.forked());
    absl::Status s = scope.Side([&](CUstream_st* st) -> absl::Status {
      EXPECT_EQ(cudaMemsetAsync(buf.b, 1, 1024, st), cudaSuccess);
      return absl::InternalError("copy_missing failed");
    });
    EXPECT_EQ(s.message(), "copy_missing failed");
    EXPECT_FALSE(scope.Compute([&](CUstream_st*) {
                        compute_ran = true;
                        return absl::OkStatus();
                      })
                     .ok());
    // No explicit Join(): the destructor joins.
  }
  EXPECT_FALSE(compute_ran);
  cudaGraph_t graph = nullptr;
  // An unjoined side stream would make this fail with cudaErrorStreamCaptureUnjoined.
  ASSERT_EQ(cudaStreamEndCapture(compute, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  cudaGraphDestroy(graph);

  // Same through RunForkJoin, eager, with the side branch never enqueuing anything.
  absl::Status s = RunForkJoin(
      **pair, [](CUstream_st*) { return absl::InvalidArgumentError("bad plan"); },
      [](CUstream_st*) { return absl::OkStatus(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::moe_overlap
