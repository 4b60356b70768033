// GPU routed experts against a float64 CPU reference on the decoded weights: bf16 and q4_0
// (panels from the project's quantizer and PackPanels), small shapes with ragged tails and
// Qwen3-30B-A3B's (H 2048, I 768), T in {1, 3, 8, 32}, k = 8, random routes with padding (-1 and
// ids past the pool), slots shared across tokens, each grouping. y starts nonzero (the kernels
// accumulate), rows past T and all of the workspace hold a NaN pattern before every launch, tokens
// whose routes are all padding must come back bit-identical, and the same launch captured in a
// CUDA graph must replay bit-identically to eager runs with new slot ids. GPU tests skip without
// a GPU; the bank-size checks run everywhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_test_util.h"
#include "engine/cuda/experts/expert_test_util.h"
#include "engine/cuda/experts/routed_experts.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::engine::gpu {
namespace {

using common::WeightFormat;

TEST(BankBytesTest, MatchTheLoadersBanks) {
  EXPECT_EQ(*GateUpBankBytes(WeightFormat::kBf16, 2048, 768), 2ull * 768 * 2048 * 2);
  EXPECT_EQ(*DownBankBytes(WeightFormat::kBf16, 2048, 768), 2048ull * 768 * 2);
  EXPECT_EQ(*GateUpBankBytes(WeightFormat::kQ4_0, 2048, 768), 2ull * 768 * 64 * 18);
  EXPECT_EQ(*DownBankBytes(WeightFormat::kQ4_0, 2048, 768), 2048ull * 24 * 18);
  EXPECT_FALSE(GateUpBankBytes(WeightFormat::kFp8Block, 2048, 768).ok());
  EXPECT_FALSE(GateUpBankBytes(WeightFormat::kBf16, 2040, 768).ok());
  EXPECT_FALSE(DownBankBytes(WeightFormat::kQ4_0, 2048, 0).ok());
}

#if MOE_HAVE_CUDA

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x

constexpr int kTopK = 8;

template <class T>
struct DeviceArray {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// A layer: experts in a pool whose slots hold them in shuffled order, some slots empty (NaN).
struct Layer {
  TestExperts experts;
  std::vector<int> expert_of_slot;
  std::vector<int> occupied;  // slots holding an expert
  std::unique_ptr<moe_cache::SlotPool> pool;
  SlotBanks banks;
};

std::unique_ptr<Layer> MakeLayer(WeightFormat format, int H, int I, int num_experts,
                                 int num_slots, uint32_t seed) {
  auto layer = std::make_unique<Layer>();
  auto experts = MakeTestExperts(format, num_experts, H, I, seed);
  EXPECT_TRUE(experts.ok()) << experts.status();
  if (!experts.ok()) return nullptr;
  layer->experts = std::move(*experts);
  std::mt19937 rng(seed + 1);
  std::vector<int> slots(num_slots);
  for (int s = 0; s < num_slots; ++s) slots[s] = s;
  std::shuffle(slots.begin(), slots.end(), rng);
  layer->expert_of_slot.assign(num_slots, -1);
  for (int e = 0; e < num_experts; ++e) {
    layer->expert_of_slot[slots[e]] = e;
    layer->occupied.push_back(slots[e]);
  }
  auto pool = MakeSlotPool(layer->experts, layer->expert_of_slot);
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return nullptr;
  layer->pool = std::move(*pool);
  auto banks = SlotBanksFromPool(*layer->pool, format, H, I);
  EXPECT_TRUE(banks.ok()) << banks.status();
  if (!banks.ok()) return nullptr;
  layer->banks = *banks;
  return layer;
}

struct Inputs {
  int T = 0;
  std::vector<float> x, w, y0;
  std::vector<int32_t> slots;
  std::vector<bool> all_padding;  // per token
};

// Routes drawn with replacement from the occupied slots (so slots repeat across tokens and now
// and then within one), about 20% padding (-1, or an id past the pool), token 1 all padding
// when T > 1.
Inputs MakeInputs(const Layer& layer, int T, uint32_t seed) {
  const int H = layer.experts.hidden;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), w01(0.05f, 1.0f), p(0.0f, 1.0f);
  Inputs in;
  in.T = T;
  in.x.resize(T * H);
  in.y0.resize(T * H);
  for (float& v : in.x) v = u(rng);
  for (float& v : in.y0) v = u(rng);
  in.slots.resize(T * kTopK);
  in.w.resize(T * kTopK);
  in.all_padding.assign(T, false);
  const int pool_slots = static_cast<int>(layer.expert_of_slot.size());
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < kTopK; ++j) {
      const float r = p(rng);
      int32_t s = layer.occupied[rng() % layer.occupied.size()];
      if (r < 0.15f) s = -1;
      else if (r < 0.2f) s = pool_slots + static_cast<int32_t>(rng() % 5);
      if (T > 1 && t == 1) s = -1;
      in.slots[t * kTopK + j] = s;
      in.w[t * kTopK + j] = w01(rng);
    }
    if (T > 1 && t == 1) in.all_padding[t] = true;
  }
  // At least one real route, so no case is vacuous.
  in.slots[0] = layer.occupied[0];
  return in;
}

// Runs one launch on fresh device buffers (y rows past T and the workspace poisoned) and returns
// y [T + 2, H].
std::vector<float> RunOnce(const Layer& layer, ExpertWorkspace& ws, const Inputs& in,
                           RouteGrouping grouping) {
  const int H = layer.experts.hidden, T = in.T;
  DeviceArray<float> x(T * H), w(T * kTopK), y((T + 2) * H);
  DeviceArray<int32_t> slots(T * kTopK);
  x.Upload(in.x);
  w.Upload(in.w);
  slots.Upload(in.slots);
  std::vector<float> y_host(in.y0);
  y_host.resize((T + 2) * H, std::nanf(""));
  y.Upload(y_host);
  EXPECT_EQ(cudaMemset(ws.scratch(), 0xff, ws.scratch_bytes()), cudaSuccess);
  const absl::Status st =
      LaunchRoutedExperts(layer.banks, ws, T, x.p, slots.p, w.p, y.p, nullptr, grouping);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return y.Download();
}

const char* GroupingName(RouteGrouping g) {
  switch (g) {
    case RouteGrouping::kAuto:
      return "auto";
    case RouteGrouping::kPerRoute:
      return "per_route";
    case RouteGrouping::kBySlot:
      return "by_slot";
  }
  return "?";
}

// Every element within the reference's worst-case bound (for random data it is 0.05-2% of the
// routed signal: sums of |terms| exceed the sums by about sqrt(n)); the whole error, relative
// Frobenius, under 1e-4 (f32 rounding adds up like sqrt(n) 2^-24, a few 1e-6 at n = 2048);
// padded tokens bit-identical; rows past T untouched (still NaN).
void ExpectMatches(const Layer& layer, const Inputs& in, const Reference& ref,
                   const std::vector<float>& y, const std::string& what) {
  const int H = layer.experts.hidden, T = in.T;
  double sig = 0, bnd = 0, err2 = 0;
  int bad = 0;
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < H; ++c) {
      const int i = t * H + c;
      if (in.all_padding[t]) {
        uint32_t a, b;
        std::memcpy(&a, &y[i], 4);
        std::memcpy(&b, &in.y0[i], 4);
        if (a != b && ++bad <= 5) ADD_FAILURE() << what << " padded token " << t << " col " << c;
        continue;
      }
      const double err = std::fabs(y[i] - ref.y[i]);
      if (!(err <= ref.bound[i]) && ++bad <= 5) {
        ADD_FAILURE() << what << " t=" << t << " c=" << c << " got " << y[i] << " want "
                      << ref.y[i] << " err " << err << " bound " << ref.bound[i];
      }
      err2 += err * err;
      sig += (ref.y[i] - in.y0[i]) * (ref.y[i] - in.y0[i]);
      bnd += ref.bound[i] * ref.bound[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
  EXPECT_GT(sig, 0.0) << what;
  EXPECT_LT(std::sqrt(err2), 1e-4 * std::sqrt(sig)) << what << ": relative Frobenius error";
  EXPECT_LT(std::sqrt(bnd), 0.05 * std::sqrt(sig)) << what << ": the bound is too loose to test";
  for (int i = T * H; i < (T + 2) * H; ++i) {
    if (!std::isnan(y[i])) {
      ADD_FAILURE() << what << " wrote past T at " << i;
      break;
    }
  }
}

void CheckShape(WeightFormat format, int H, int I, int num_experts, int num_slots,
                const std::vector<int>& token_counts, uint32_t seed) {
  std::unique_ptr<Layer> layer = MakeLayer(format, H, I, num_experts, num_slots, seed);
  ASSERT_NE(layer, nullptr);
  int max_t = 0;
  for (int T : token_counts) max_t = std::max(max_t, T);
  auto ws = ExpertWorkspace::Create({max_t, kTopK, H, I, num_experts});
  ASSERT_TRUE(ws.ok()) << ws.status();
  for (int T : token_counts) {
    const Inputs in = MakeInputs(*layer, T, seed + 100 + T);
    const Reference ref = ReferenceExperts(layer->experts, layer->expert_of_slot, T, kTopK, in.x,
                                           in.slots, in.w, in.y0);
    std::vector<float> first;
    for (RouteGrouping g :
         {RouteGrouping::kAuto, RouteGrouping::kPerRoute, RouteGrouping::kBySlot}) {
      const std::string what = std::string(common::WeightFormatName(format)) + " H=" +
                               std::to_string(H) + " I=" + std::to_string(I) +
                               " T=" + std::to_string(T) + " " + GroupingName(g);
      const std::vector<float> y = RunOnce(*layer, **ws, in, g);
      ExpectMatches(*layer, in, ref, y, what);
      if (g == RouteGrouping::kAuto) {
        first = y;
        // The same launch again: bit-identical.
        const std::vector<float> again = RunOnce(*layer, **ws, in, g);
        EXPECT_EQ(std::memcmp(first.data(), again.data(), first.size() * 4), 0)
            << what << ": two runs differ";
      }
    }
  }
}

// Ragged shapes: bf16 rows shorter than a warp's 256 columns; q4_0 panels with an odd number of
// 32-column blocks (a lone last block), gate/up row blocks not a multiple of the block's units.
TEST(RoutedExpertsTest, SmallShapesBf16) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kBf16, 96, 160, 12, 20, {1, 3, 8, 32}, 11);
  CheckShape(WeightFormat::kBf16, 256, 128, 12, 20, {1, 3, 8, 32}, 12);
  CheckShape(WeightFormat::kBf16, 544, 352, 6, 9, {1, 3, 8, 32}, 13);
}

TEST(RoutedExpertsTest, SmallShapesQ4_0) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kQ4_0, 96, 160, 12, 20, {1, 3, 8, 32}, 21);
  CheckShape(WeightFormat::kQ4_0, 256, 128, 12, 20, {1, 3, 8, 32}, 22);
  CheckShape(WeightFormat::kQ4_0, 544, 352, 6, 9, {1, 3, 8, 32}, 23);
}

// Qwen3-30B-A3B's expert shape.
TEST(RoutedExpertsTest, Qwen3MoeShapeBf16) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kBf16, 2048, 768, 12, 20, {1, 3, 8, 32}, 31);
}

TEST(RoutedExpertsTest, Qwen3MoeShapeQ4_0) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kQ4_0, 2048, 768, 12, 20, {1, 3, 8, 32}, 41);
}

// Captured once per bucket, replayed with new slot ids (and y reset) twice: each replay equals
// an eager launch on the same inputs bit for bit.
void CheckGraph(WeightFormat format, int T, RouteGrouping grouping) {
  const int H = 256, I = 160;
  std::unique_ptr<Layer> layer = MakeLayer(format, H, I, 12, 20, 51);
  ASSERT_NE(layer, nullptr);
  auto ws = ExpertWorkspace::Create({T, kTopK, H, I, 12});
  ASSERT_TRUE(ws.ok()) << ws.status();
  const Inputs a = MakeInputs(*layer, T, 52), b = MakeInputs(*layer, T, 53);
  ASSERT_NE(a.slots, b.slots);
  const std::vector<float> eager_a = RunOnce(*layer, **ws, a, grouping);

  // Fixed device buffers: x, w, y0 from a; slot ids change between replays.
  DeviceArray<float> x(T * H), w(T * kTopK), y((T + 2) * H);
  DeviceArray<int32_t> slots(T * kTopK);
  x.Upload(a.x);
  w.Upload(a.w);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status st =
      LaunchRoutedExperts(layer->banks, **ws, T, x.p, slots.p, w.p, y.p, stream, grouping);
  cudaGraph_t graph;
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(st.ok()) << st;
  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  Inputs b_with_a = b;  // b's routes on a's x and weights
  b_with_a.x = a.x;
  b_with_a.w = a.w;
  b_with_a.y0 = a.y0;
  const std::vector<float> eager_b_on_a = RunOnce(*layer, **ws, b_with_a, grouping);
  const Inputs* const cases[] = {&a, &b_with_a};
  for (const Inputs* in : cases) {
    slots.Upload(in->slots);
    std::vector<float> y_host(in->y0);
    y_host.resize((T + 2) * H, std::nanf(""));
    y.Upload(y_host);
    ASSERT_CUDA(cudaMemset((*ws)->scratch(), 0xff, (*ws)->scratch_bytes()));
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    const std::vector<float> replay = y.Download();
    const std::vector<float>& eager = in == &a ? eager_a : eager_b_on_a;
    EXPECT_EQ(std::memcmp(replay.data(), eager.data(), eager.size() * 4), 0)
        << common::WeightFormatName(format) << " T=" << T << " " << GroupingName(grouping)
        << ": replay differs from eager";
  }
  // The two slot sets really give different results.
  EXPECT_NE(std::memcmp(eager_a.data(), eager_b_on_a.data(), eager_a.size() * 4), 0);
  ASSERT_CUDA(cudaGraphExecDestroy(exec));
  ASSERT_CUDA(cudaGraphDestroy(graph));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST(RoutedExpertsTest, GraphReplayMatchesEager) {
  MOE_SKIP_WITHOUT_GPU();
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kQ4_0}) {
    CheckGraph(f, 1, RouteGrouping::kAuto);
    CheckGraph(f, 8, RouteGrouping::kAuto);
    CheckGraph(f, 8, RouteGrouping::kPerRoute);
  }
}

TEST(RoutedExpertsTest, RejectsBadArguments) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_FALSE(ExpertWorkspace::Create({0, 8, 256, 128, 0}).ok());
  EXPECT_FALSE(ExpertWorkspace::Create({2048, 8, 256, 128, 0}).ok());  // 16384 routes
  EXPECT_FALSE(ExpertWorkspace::Create({4, 8, 250, 128, 0}).ok());
  std::unique_ptr<Layer> layer = MakeLayer(WeightFormat::kBf16, 256, 128, 4, 4, 61);
  ASSERT_NE(layer, nullptr);
  auto ws = ExpertWorkspace::Create({4, kTopK, 256, 128, 0});
  ASSERT_TRUE(ws.ok()) << ws.status();
  DeviceArray<float> x(4 * 256), w(4 * kTopK), y(4 * 256);
  DeviceArray<int32_t> slots(4 * kTopK);
  EXPECT_FALSE(LaunchRoutedExperts(layer->banks, **ws, 5, x.p, slots.p, w.p, y.p, nullptr).ok());
  EXPECT_FALSE(LaunchRoutedExperts(layer->banks, **ws, 0, x.p, slots.p, w.p, y.p, nullptr).ok());
  EXPECT_FALSE(LaunchRoutedExperts(layer->banks, **ws, 1, x.p + 1, slots.p, w.p, y.p, nullptr).ok());
  SlotBanks other = layer->banks;
  other.hidden = 512;
  EXPECT_FALSE(LaunchRoutedExperts(other, **ws, 1, x.p, slots.p, w.p, y.p, nullptr).ok());
  EXPECT_FALSE(SlotBanksFromPool(*layer->pool, WeightFormat::kQ4_0, 256, 128).ok());
  EXPECT_FALSE(SlotBanksFromPool(*layer->pool, WeightFormat::kBf16, 256, 96).ok());
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::engine::gpu
