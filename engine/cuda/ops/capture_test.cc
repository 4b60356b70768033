// A decoder layer's worth of these operators (embedding, RMSNorm, q/k projections with a bias,
// q/k norm + RoPE, the o projection accumulating into the residual, router top-k, the shared
// expert with its sigmoid gate, a residual add, the final norm, the tied LM head and argmax)
// captured in one CUDA graph (global capture mode, so any allocation or synchronization inside
// fails the capture), replayed, and compared bit for bit with the same chain run eagerly; then
// again with new token ids and positions written into the same buffers. GPU test: skips without
// a GPU.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/gpu_test_util.h"
#include "common/status.h"
#include "engine/cuda/ops/gemm.h"
#include "engine/cuda/ops/rope_table.h"
#include "engine/cuda/ops/token_ops.h"
#include "engine/model_config.h"
#include "engine/rope.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/ops/ops_test_util.h"

namespace moe::engine::gpu {
namespace {

using testing::CheckCuda;
using testing::DeviceArray;
using testing::RandomBf16;
using testing::RandomF32;
using testing::Rng;

constexpr int T = 5, V = 5003, H = 512, NQ = 8, NKV = 2, HD = 64, E = 64, K = 8, I = 256;
constexpr int kMaxPos = 4096;
constexpr float kEps = 1e-6f;

struct Layer {
  explicit Layer(Rng& rng)
      : embed(RandomBf16(rng, static_cast<size_t>(V) * H, -1, 1)),
        w_in(RandomF32(rng, H, 0.5f, 1.5f)),
        w_post(RandomF32(rng, H, 0.5f, 1.5f)),
        w_final(RandomF32(rng, H, 0.5f, 1.5f)),
        q_norm(RandomF32(rng, HD, 0.5f, 1.5f)),
        k_norm(RandomF32(rng, HD, 0.5f, 1.5f)),
        k_bias(RandomF32(rng, NKV * HD, -0.5f, 0.5f)),
        wq(RandomBf16(rng, static_cast<size_t>(NQ) * HD * H, -0.05f, 0.05f)),
        wk(RandomBf16(rng, static_cast<size_t>(NKV) * HD * H, -0.05f, 0.05f)),
        wo(RandomBf16(rng, static_cast<size_t>(H) * NQ * HD, -0.05f, 0.05f)),
        wr(RandomBf16(rng, static_cast<size_t>(E) * H, -0.1f, 0.1f)),
        wgu(RandomBf16(rng, static_cast<size_t>(2 * I) * H, -0.05f, 0.05f)),
        wd(RandomBf16(rng, static_cast<size_t>(H) * I, -0.05f, 0.05f)),
        wsg(RandomBf16(rng, H, -0.05f, 0.05f)) {}
  DeviceArray<uint16_t> embed;
  DeviceArray<float> w_in, w_post, w_final, q_norm, k_norm, k_bias;
  DeviceArray<uint16_t> wq, wk, wo, wr, wgu, wd, wsg;
};

struct Activations {
  DeviceArray<int32_t> ids{T}, positions{T};
  DeviceArray<float> h{T * H}, xn{T * H}, q{T * NQ * HD}, k{T * NKV * HD};
  DeviceArray<uint16_t> xn_bf{T * H}, q_bf{T * NQ * HD}, act_bf{T * I};
  DeviceArray<float> router_logits{T * E}, route_w{T * K}, gu{T * 2 * I}, shared{T * H}, sgate{T},
      final_f32{T * H}, logits{static_cast<size_t>(T) * V};
  DeviceArray<int32_t> route_ids{T * K}, tokens{T};
  DeviceArray<uint64_t> argmax_scratch{static_cast<size_t>(ArgmaxScratchBytes(T, V) / 8 + 1)};

  void PoisonOutputs() {
    for (auto* a :
         {&h, &xn, &q, &k, &router_logits, &route_w, &gu, &shared, &sgate, &final_f32, &logits}) {
      a->Poison();
    }
    xn_bf.Poison();
    q_bf.Poison();
    act_bf.Poison();
    route_ids.Poison();
    tokens.Poison();
  }
};

struct Snapshot {
  std::vector<float> h, q, k, route_w, logits;
  std::vector<int32_t> route_ids, tokens;
};

Snapshot Take(const Activations& a) {
  return {a.h.Download(),      a.q.Download(),         a.k.Download(),     a.route_w.Download(),
          a.logits.Download(), a.route_ids.Download(), a.tokens.Download()};
}

template <typename X>
bool SameBits(const std::vector<X>& a, const std::vector<X>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0;
}

void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_TRUE(SameBits(a.h, b.h));
  EXPECT_TRUE(SameBits(a.q, b.q));
  EXPECT_TRUE(SameBits(a.k, b.k));
  EXPECT_TRUE(SameBits(a.route_w, b.route_w));
  EXPECT_TRUE(SameBits(a.logits, b.logits));
  EXPECT_EQ(a.route_ids, b.route_ids);
  EXPECT_EQ(a.tokens, b.tokens);
}

absl::Status Gemm(DenseGemm& g, const uint16_t* x, const uint16_t* w, void* y, int n, int k,
                  const float* bias = nullptr, bool accumulate = false, bool y_bf16 = false) {
  GemmArgs a;
  a.x = x;
  a.w = w;
  a.y = y;
  a.bias = bias;
  a.accumulate = accumulate;
  a.y_bf16 = y_bf16;
  a.rows = T;
  a.n = n;
  a.k = k;
  return g.Run(a);
}

absl::Status Enqueue(const Layer& L, const DeviceRopeTable& rope, DenseGemm& g, Activations& a) {
  cudaStream_t s = g.stream();
  RETURN_IF_ERROR(LaunchEmbeddingGather(L.embed.get(), V, H, a.ids.get(), T, a.h.get(), s));
  RETURN_IF_ERROR(LaunchRmsNorm(a.h.get(), T, H, L.w_in.get(), kEps, nullptr, a.xn_bf.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.wq.get(), a.q.get(), NQ * HD, H));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.wk.get(), a.k.get(), NKV * HD, H, L.k_bias.get()));
  QkNormRopeArgs qk;
  qk.q = a.q.get();
  qk.k = a.k.get();
  qk.num_tokens = T;
  qk.num_q_heads = NQ;
  qk.num_kv_heads = NKV;
  qk.head_dim = HD;
  qk.q_norm = L.q_norm.get();
  qk.k_norm = L.k_norm.get();
  qk.eps = kEps;
  qk.positions = a.positions.get();
  qk.cos = rope.cos();
  qk.sin = rope.sin();
  qk.max_positions = rope.max_positions();
  RETURN_IF_ERROR(LaunchQkNormRope(qk, s));
  RETURN_IF_ERROR(LaunchF32ToBf16(a.q.get(), T * NQ * HD, a.q_bf.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.q_bf.get(), L.wo.get(), a.h.get(), H, NQ * HD, nullptr, true));
  RETURN_IF_ERROR(
      LaunchRmsNorm(a.h.get(), T, H, L.w_post.get(), kEps, a.xn.get(), a.xn_bf.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.wr.get(), a.router_logits.get(), E, H));
  RETURN_IF_ERROR(LaunchRouterTopK(a.router_logits.get(), T, E, K, true, a.route_ids.get(),
                                   a.route_w.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.wgu.get(), a.gu.get(), 2 * I, H));
  RETURN_IF_ERROR(LaunchSiluMul(a.gu.get(), T, I, nullptr, a.act_bf.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.act_bf.get(), L.wd.get(), a.shared.get(), H, I));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.wsg.get(), a.sgate.get(), 1, H));
  RETURN_IF_ERROR(LaunchSharedExpertCombine(a.h.get(), a.shared.get(), a.sgate.get(), T, H, s));
  RETURN_IF_ERROR(LaunchAdd(a.h.get(), a.xn.get(), T * H, s));
  RETURN_IF_ERROR(LaunchRmsNorm(a.h.get(), T, H, L.w_final.get(), kEps, nullptr, a.xn_bf.get(), s));
  RETURN_IF_ERROR(LaunchBf16ToF32(a.xn_bf.get(), T * H, a.final_f32.get(), s));
  RETURN_IF_ERROR(Gemm(g, a.xn_bf.get(), L.embed.get(), a.logits.get(), V, H));  // tied head
  return LaunchArgmax(a.logits.get(), T, V, a.argmax_scratch.get(), a.tokens.get(), s);
}

void NewInputs(Rng& rng, Activations& a) {
  std::vector<int32_t> ids(T), pos(T);
  for (int t = 0; t < T; ++t) {
    ids[t] = rng.Int(V);
    pos[t] = rng.Int(kMaxPos);
  }
  a.ids.Upload(ids);
  a.positions.Upload(pos);
}

TEST(CaptureTest, ReplayEqualsEagerWithNewInputs) {
  MOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::FreshSeed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  Rng rng(seed);
  ModelConfig c;
  c.head_dim = HD;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = kMaxPos;
  auto params = ComputeRopeParams(c);
  ASSERT_TRUE(params.ok());
  auto host = BuildRopeCosSin(*params, HD, kMaxPos);
  ASSERT_TRUE(host.ok());
  auto rope = DeviceRopeTable::Create(*host);
  ASSERT_TRUE(rope.ok()) << rope.status();
  const Layer layer(rng);
  Activations act;

  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  auto gemm = DenseGemm::Create(stream);
  ASSERT_TRUE(gemm.ok()) << gemm.status();

  NewInputs(rng, act);
  act.PoisonOutputs();
  ASSERT_TRUE(Enqueue(layer, **rope, **gemm, act).ok());
  const Snapshot eager1 = Take(act);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CheckCuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  const absl::Status enqueued = Enqueue(layer, **rope, **gemm, act);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
  CheckCuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  act.PoisonOutputs();
  CheckCuda(cudaGraphLaunch(exec, stream), "replay");
  CheckCuda(cudaStreamSynchronize(stream), "replay");
  ExpectSame(Take(act), eager1);

  // New ids and positions in the same buffers: the replay must follow them.
  NewInputs(rng, act);
  act.PoisonOutputs();
  ASSERT_TRUE(Enqueue(layer, **rope, **gemm, act).ok());
  const Snapshot eager2 = Take(act);
  EXPECT_FALSE(SameBits(eager1.logits, eager2.logits));
  act.PoisonOutputs();
  CheckCuda(cudaGraphLaunch(exec, stream), "replay");
  CheckCuda(cudaStreamSynchronize(stream), "replay");
  ExpectSame(Take(act), eager2);
  // Every output written: the eager run started from poisoned buffers too.
  for (float v : eager2.logits) ASSERT_FALSE(std::isnan(v));
  for (float v : eager2.h) ASSERT_FALSE(std::isnan(v));
  for (int32_t id : eager2.route_ids) ASSERT_TRUE(id >= 0 && id < E);
  for (int32_t t : eager2.tokens) ASSERT_TRUE(t >= 0 && t < V);

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gemm->reset();
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moe::engine::gpu

#else  // !MOE_HAVE_CUDA

TEST(CaptureTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MOE_HAVE_CUDA
