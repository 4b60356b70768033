// Capture, the guard, update-before-reinstantiate, static buffers, the bucket LRU and the graph
// reader. Bucket arithmetic runs everywhere; the rest skips without a GPU. The graphs here are
// built from memset/memcpy nodes so the package's tests need no kernels of their own.
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/gpu_test_util.h"
#include "graph_capture/capture.h"
#include "graph_capture/decode_graph.h"
#include "graph_capture/graph_cache.h"
#include "graph_capture/topology.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::graph_capture {
namespace {

TEST(BucketTest, SmallestPowerOfTwoThatHoldsTheBatch) {
  EXPECT_EQ(*BucketFor(1, 16), 1);
  EXPECT_EQ(*BucketFor(2, 16), 2);
  EXPECT_EQ(*BucketFor(3, 16), 4);
  EXPECT_EQ(*BucketFor(5, 16), 8);
  EXPECT_EQ(*BucketFor(9, 16), 16);
  EXPECT_EQ(*BucketFor(16, 16), 16);
  EXPECT_EQ(BucketFor(17, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BucketFor(0, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BucketFor(1, 12).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CaptureTest, WithoutCudaEverythingIsUnavailable) {
  if (common::CudaAvailable().ok()) GTEST_SKIP() << "a GPU is visible";
  int dummy = 0;
  auto step = [&](CUstream_st*) { return absl::OkStatus(); };
  EXPECT_EQ(CaptureGraph(reinterpret_cast<CUstream_st*>(&dummy), step).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(StaticBuffer::Create(64).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ReadTopology(nullptr).status().code(), absl::StatusCode::kUnavailable);
}

#if MOE_HAVE_CUDA

class GraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MOE_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    auto in = StaticBuffer::Create(kBytes);
    auto out = StaticBuffer::Create(kBytes);
    ASSERT_TRUE(in.ok() && out.ok());
    in_ = std::move(*in);
    out_ = std::move(*out);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  // out <- in, then memset of the first `n` bytes of out to `value`.
  absl::Status Step(CUstream_st* s, int value, size_t n) {
    if (cudaMemcpyAsync(out_->data(), in_->data(), kBytes, cudaMemcpyDeviceToDevice, s) != 0) {
      return absl::InternalError("memcpy");
    }
    if (n > 0 && cudaMemsetAsync(out_->data(), value, n, s) != 0) {
      return absl::InternalError("memset");
    }
    return absl::OkStatus();
  }
  std::vector<uint8_t> Output() {
    std::vector<uint8_t> host(kBytes);
    EXPECT_EQ(cudaMemcpyAsync(host.data(), out_->data(), kBytes, cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return host;
  }
  void SetInput(uint8_t seed) {
    std::vector<uint8_t> host(kBytes);
    for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<uint8_t>(i * 7 + seed);
    ASSERT_EQ(cudaMemcpyAsync(in_->data(), host.data(), kBytes, cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  static constexpr size_t kBytes = 4096;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<StaticBuffer> in_, out_;
};

TEST_F(GraphTest, ReplaysReadNewInputsFromStaticBuffers) {
  auto g = DecodeGraph::Create(stream_, [&](CUstream_st* s) { return Step(s, 0xAB, 16); });
  ASSERT_TRUE(g.ok()) << g.status();
  void* in_address = in_->data();
  for (uint8_t seed = 0; seed < 5; ++seed) {
    SetInput(seed);
    ASSERT_TRUE((*g)->Launch(stream_).ok());
    std::vector<uint8_t> out = Output();
    for (size_t i = 0; i < kBytes; ++i) {
      ASSERT_EQ(out[i], i < 16 ? 0xAB : static_cast<uint8_t>(i * 7 + seed)) << i;
    }
  }
  EXPECT_EQ(in_->data(), in_address);
}

TEST_F(GraphTest, RecaptureUpdatesInPlaceWhenTheTopologyMatches) {
  auto g = DecodeGraph::Create(stream_, [&](CUstream_st* s) { return Step(s, 0x11, 16); });
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->instantiations(), 1);
  // Same nodes, new memset value and width: cudaGraphExecUpdate applies it.
  auto same = (*g)->Recapture(stream_, [&](CUstream_st* s) { return Step(s, 0x22, 32); });
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(*same);
  EXPECT_EQ((*g)->instantiations(), 1);
  SetInput(3);
  ASSERT_TRUE((*g)->Launch(stream_).ok());
  std::vector<uint8_t> out = Output();
  EXPECT_EQ(out[31], 0x22);
  EXPECT_EQ(out[32], static_cast<uint8_t>(32 * 7 + 3));
  // One node fewer: a new instantiation.
  auto other = (*g)->Recapture(stream_, [&](CUstream_st* s) { return Step(s, 0, 0); });
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE(*other);
  EXPECT_EQ((*g)->instantiations(), 2);
  ASSERT_TRUE((*g)->Launch(stream_).ok());
  EXPECT_EQ(Output()[0], static_cast<uint8_t>(3));
}

TEST_F(GraphTest, GuardRefusesAnAllocationInsideTheCapture) {
  void* leaked = nullptr;
  auto bad = CaptureGraph(stream_, [&](CUstream_st* s) -> absl::Status {
    if (cudaMemsetAsync(out_->data(), 0, kBytes, s) != 0) return absl::InternalError("memset");
    const cudaError_t e = cudaMalloc(&leaked, 1 << 20);
    if (e != cudaSuccess) return absl::InternalError(cudaGetErrorName(e));
    return absl::OkStatus();
  });
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bad.status().message().find("capture guard"), absl::string_view::npos)
      << bad.status();
  if (leaked != nullptr) cudaFree(leaked);
  // The stream left capture mode and captures again.
  cudaStreamCaptureStatus st;
  ASSERT_EQ(cudaStreamIsCapturing(stream_, &st), cudaSuccess);
  EXPECT_EQ(st, cudaStreamCaptureStatusNone);
  EXPECT_TRUE(CaptureGraph(stream_, [&](CUstream_st* s) { return Step(s, 1, 1); }).ok());
}

TEST_F(GraphTest, GuardRefusesASynchronisationInsideTheCapture) {
  auto bad = CaptureGraph(stream_, [&](CUstream_st* s) -> absl::Status {
    if (cudaMemsetAsync(out_->data(), 0, kBytes, s) != 0) return absl::InternalError("memset");
    cudaStreamSynchronize(s);  // the error is the guard's to report
    return absl::OkStatus();
  });
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bad.status().message().find("capture guard"), absl::string_view::npos)
      << bad.status();
}

TEST_F(GraphTest, GuardRefusesAStreamOrderedAllocation) {
  auto bad = CaptureGraph(stream_, [&](CUstream_st* s) -> absl::Status {
    void* p = nullptr;
    if (cudaMallocAsync(&p, 1 << 16, s) != cudaSuccess) return absl::InternalError("malloc");
    if (cudaMemsetAsync(p, 0, 1 << 16, s) != cudaSuccess) return absl::InternalError("memset");
    if (cudaFreeAsync(p, s) != cudaSuccess) return absl::InternalError("free");
    return absl::OkStatus();
  });
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  EXPECT_NE(bad.status().message().find("capture guard"), absl::string_view::npos);
}

TEST_F(GraphTest, StepErrorsAndBadStreamsAreReported) {
  auto failing = CaptureGraph(stream_, [&](CUstream_st*) {
    return absl::InvalidArgumentError("bad batch");
  });
  EXPECT_EQ(failing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CaptureGraph(nullptr, [&](CUstream_st*) { return absl::OkStatus(); }).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(GraphTest, CacheKeepsTheMostRecentBucketsAndReusesExecutables) {
  GraphCache cache(2);
  std::vector<int> captured;
  auto step = [&](int bucket, CUstream_st* s) {
    captured.push_back(bucket);
    return Step(s, bucket, static_cast<size_t>(bucket));
  };
  SetInput(9);
  for (int bucket : {1, 2, 1, 4, 1, 2}) {
    ASSERT_TRUE(cache.Replay(bucket, stream_, step).ok()) << bucket;
    std::vector<uint8_t> out = Output();
    EXPECT_EQ(out[bucket - 1], bucket);
    EXPECT_EQ(out[bucket], static_cast<uint8_t>(bucket * 7 + 9));
  }
  // 1, 2 captured; 1 hit; 4 evicts 2; 1 hit; 2 evicts 4.
  EXPECT_EQ(captured, (std::vector<int>{1, 2, 4, 2}));
  EXPECT_EQ(cache.captures(), 4);
  EXPECT_EQ(cache.size(), 2);
  EXPECT_TRUE(cache.Contains(1));
  EXPECT_TRUE(cache.Contains(2));
  EXPECT_FALSE(cache.Contains(4));
  // Same topology for every bucket here: both evictions updated in place.
  EXPECT_EQ(cache.updates_in_place(), 2);
}

TEST_F(GraphTest, TopologyReadsNodesAndEdges) {
  auto g = CaptureGraph(stream_, [&](CUstream_st* s) { return Step(s, 5, 8); });
  ASSERT_TRUE(g.ok());
  auto t = ReadTopology(g->get());
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->nodes.size(), 2u);
  ASSERT_EQ(t->edges.size(), 1u);
  const int from = t->edges[0].first, to = t->edges[0].second;
  EXPECT_EQ(t->nodes[from].kind, NodeKind::kMemcpy);
  EXPECT_EQ(t->nodes[to].kind, NodeKind::kMemset);
  EXPECT_EQ(t->Successors(from), std::vector<int>{to});
  EXPECT_EQ(t->Predecessors(to), std::vector<int>{from});
  EXPECT_TRUE(t->KernelsNamed("").empty());
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::graph_capture
