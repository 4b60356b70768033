// GPU routed experts against a float64 CPU reference on the decoded weights: bf16, q4_0 and
// nvfp4 (panels from the project's quantizers and PackPanels; nvfp4 with gate and up global
// scales about 4x apart) and fp8_block (128x128 block scales in banks of their own, partial edge
// blocks, and in the small shapes scale rows padded in the slot's pitch), small shapes with
// ragged tails and Qwen3-30B-A3B's (H 2048, I 768), T in {1, 3, 8, 32}, k = 8, random routes with
// padding (-1 and ids past the pool), slots shared across tokens, each grouping. y starts
// nonzero (the kernels accumulate), rows past T, all of the workspace, empty slots and the
// padding of every slot row hold a NaN pattern, tokens whose routes are all padding must come
// back bit-identical, and the same launch captured in a CUDA graph must replay bit-identically to
// eager runs with new slot ids. Negative controls: the up rows read with the gate's global
// scale, and fp8 scales read at a dense pitch, must both miss the reference. GPU tests skip
// without a GPU; the bank-size checks run everywhere.
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
  EXPECT_EQ(*GateUpBankBytes(WeightFormat::kFp8Block, 2048, 768), 2ull * 768 * 2048);
  EXPECT_EQ(*DownBankBytes(WeightFormat::kFp8Block, 2048, 768), 2048ull * 768);
  EXPECT_EQ(*GateUpBankBytes(WeightFormat::kNvfp4, 2048, 768), 2ull * 768 * (1024 + 128));
  EXPECT_EQ(*DownBankBytes(WeightFormat::kNvfp4, 2048, 768), 2048ull * (384 + 48));
  EXPECT_FALSE(GateUpBankBytes(WeightFormat::kMxfp4, 2048, 768).ok());
  EXPECT_FALSE(GateUpBankBytes(WeightFormat::kBf16, 2040, 768).ok());
  EXPECT_FALSE(DownBankBytes(WeightFormat::kQ4_0, 2048, 0).ok());
}

// The banks per format, by name and size, as engine/loader.cc's MakeLayout makes them.
TEST(BankBytesTest, EveryBankOfEachFormat) {
  auto names = [](WeightFormat f, int H, int I) {
    std::vector<std::string> out;
    auto sizes = ExpertBankSizes(f, H, I);
    EXPECT_TRUE(sizes.ok()) << sizes.status();
    if (!sizes.ok()) return out;
    for (const ExpertBankSize& b : *sizes) {
      out.push_back(std::string(b.name) + ":" + std::to_string(b.bytes));
    }
    return out;
  };
  EXPECT_EQ(names(WeightFormat::kBf16, 64, 32),
            (std::vector<std::string>{"gate_up:8192", "down:4096"}));
  EXPECT_EQ(names(WeightFormat::kQ4_0, 64, 32),
            (std::vector<std::string>{"gate_up:2304", "down:1152"}));
  // fp8: scales [ceil(2I/128), ceil(H/128)] = [12, 16] and [16, 6] f32 at Qwen3-30B-A3B's shape;
  // [3, 1] and [1, 2] (12 and 8 bytes, padded to 16 in a store) at H 96, I 160.
  EXPECT_EQ(names(WeightFormat::kFp8Block, 2048, 768),
            (std::vector<std::string>{"gate_up:3145728", "gate_up_scales:768", "down:1572864",
                                      "down_scales:384"}));
  EXPECT_EQ(names(WeightFormat::kFp8Block, 96, 160),
            (std::vector<std::string>{"gate_up:30720", "gate_up_scales:12", "down:15360",
                                      "down_scales:8"}));
  EXPECT_EQ(names(WeightFormat::kNvfp4, 64, 32),
            (std::vector<std::string>{"gate_up:2304", "down:1152", "gate_up_global_scale:4",
                                      "up_global_scale:4", "down_global_scale:4"}));
  EXPECT_FALSE(ExpertBankSizes(WeightFormat::kMxfp4, 64, 32).ok());
}

// The test data has what the GPU checks below rely on: nvfp4 gate and up global scales far apart in
// every expert, and fp8 scale rows padded in the slots at H 96, I 160.
TEST(RoutedExpertsTest, TestDataCoversScaleCases) {
  auto nv = MakeTestExperts(WeightFormat::kNvfp4, 4, 96, 160, 5);
  ASSERT_TRUE(nv.ok()) << nv.status();
  for (int e = 0; e < 4; ++e) {
    EXPECT_LT(2.0f * nv->up_global[e], nv->gate_global[e]) << e;
    EXPECT_NE(nv->down_global[e], nv->gate_global[e]) << e;
  }
  auto f8 = MakeTestExperts(WeightFormat::kFp8Block, 4, 96, 160, 5);
  ASSERT_TRUE(f8.ok()) << f8.status();
  std::vector<moe_cache::BankSpec> specs;
  for (const TestBank& b : f8->banks) specs.push_back({b.name, b.bytes, 0});
  auto layout = moe_cache::BankLayout::Create(specs);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->bank(1).name, "gate_up_scales");
  EXPECT_GT(layout->bank(1).pitch, layout->bank(1).bytes);
  ASSERT_EQ(layout->bank(3).name, "down_scales");
  EXPECT_GT(layout->bank(3).pitch, layout->bank(3).bytes);
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
// Elements of real tokens outside the reference's bound (NaN included).
int OutOfBound(const Layer& layer, const Inputs& in, const Reference& ref,
               const std::vector<float>& y) {
  const int H = layer.experts.hidden;
  int bad = 0;
  for (int t = 0; t < in.T; ++t) {
    if (in.all_padding[t]) continue;
    for (int c = 0; c < H; ++c) {
      const int i = t * H + c;
      bad += std::fabs(y[i] - ref.y[i]) <= ref.bound[i] ? 0 : 1;
    }
  }
  return bad;
}

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

// fp8: rows shorter than a warp's 512 columns and not whole 128-column blocks (partial edge
// blocks in both dimensions; gate/up's stacked 2I rows straddle a block at I = 160 and 352);
// at H 96, I 160 and H 544, I 352 the scale rows (12 and 8, 80 and 60 bytes) are padded in the
// slot's pitch.
TEST(RoutedExpertsTest, SmallShapesFp8Block) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kFp8Block, 96, 160, 12, 20, {1, 3, 8, 32}, 71);
  CheckShape(WeightFormat::kFp8Block, 256, 128, 12, 20, {1, 3, 8, 32}, 72);
  CheckShape(WeightFormat::kFp8Block, 544, 352, 6, 9, {1, 3, 8, 32}, 73);
}

TEST(RoutedExpertsTest, SmallShapesNvfp4) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kNvfp4, 96, 160, 12, 20, {1, 3, 8, 32}, 81);
  CheckShape(WeightFormat::kNvfp4, 256, 128, 12, 20, {1, 3, 8, 32}, 82);
  CheckShape(WeightFormat::kNvfp4, 544, 352, 6, 9, {1, 3, 8, 32}, 83);
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

TEST(RoutedExpertsTest, Qwen3MoeShapeFp8Block) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kFp8Block, 2048, 768, 12, 20, {1, 3, 8, 32}, 91);
}

TEST(RoutedExpertsTest, Qwen3MoeShapeNvfp4) {
  MOE_SKIP_WITHOUT_GPU();
  CheckShape(WeightFormat::kNvfp4, 2048, 768, 12, 20, {1, 3, 8, 32}, 101);
}

// Negative controls: the same launches with the up rows' global scale taken from the gate's
// bank, or fp8 block scales read as if their rows were dense (pitch = payload), fall outside
// the reference's bound, in both groupings.
TEST(RoutedExpertsTest, WrongScalesAreCaught) {
  MOE_SKIP_WITHOUT_GPU();
  const int H = 96, I = 160, T = 8;
  for (WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kFp8Block}) {
    std::unique_ptr<Layer> layer = MakeLayer(f, H, I, 12, 20, 111);
    ASSERT_NE(layer, nullptr);
    auto ws = ExpertWorkspace::Create({T, kTopK, H, I, 12});
    ASSERT_TRUE(ws.ok()) << ws.status();
    const Inputs in = MakeInputs(*layer, T, 112);
    const Reference ref = ReferenceExperts(layer->experts, layer->expert_of_slot, T, kTopK, in.x,
                                           in.slots, in.w, in.y0);
    const SlotBanks good = layer->banks;
    SlotBanks wrong = good;
    if (f == WeightFormat::kNvfp4) {
      wrong.up_global_scale = good.gate_global_scale;
      wrong.up_global_scale_pitch = good.gate_global_scale_pitch;
    } else {
      wrong.gate_up_scales_pitch = layer->experts.Bank("gate_up_scales")->bytes;
      wrong.down_scales_pitch = layer->experts.Bank("down_scales")->bytes;
      ASSERT_NE(wrong.gate_up_scales_pitch, good.gate_up_scales_pitch);
    }
    for (RouteGrouping g : {RouteGrouping::kPerRoute, RouteGrouping::kBySlot}) {
      const std::string what = std::string(common::WeightFormatName(f)) + " " + GroupingName(g);
      EXPECT_EQ(OutOfBound(*layer, in, ref, RunOnce(*layer, **ws, in, g)), 0) << what;
      layer->banks = wrong;
      EXPECT_GT(OutOfBound(*layer, in, ref, RunOnce(*layer, **ws, in, g)), (T - 1) * H / 4)
          << what << ": a wrong scale went unnoticed";
      layer->banks = good;
    }
  }
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
  for (WeightFormat f :
       {WeightFormat::kBf16, WeightFormat::kQ4_0, WeightFormat::kFp8Block, WeightFormat::kNvfp4}) {
    CheckGraph(f, 1, RouteGrouping::kAuto);
    CheckGraph(f, 8, RouteGrouping::kAuto);
    CheckGraph(f, 8, RouteGrouping::kPerRoute);
    CheckGraph(f, 8, RouteGrouping::kBySlot);
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
  // A bf16 pool has no scale banks.
  EXPECT_FALSE(SlotBanksFromPool(*layer->pool, WeightFormat::kFp8Block, 256, 128).ok());
  EXPECT_FALSE(SlotBanksFromPool(*layer->pool, WeightFormat::kNvfp4, 256, 128).ok());
  // fp8 and nvfp4 launches without their scale banks (all routes padding).
  ASSERT_EQ(cudaMemset(slots.p, 0xff, 4 * kTopK * sizeof(int32_t)), cudaSuccess);
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kNvfp4}) {
    std::unique_ptr<Layer> fl = MakeLayer(f, 256, 128, 4, 4, 62);
    ASSERT_NE(fl, nullptr);
    EXPECT_TRUE(LaunchRoutedExperts(fl->banks, **ws, 1, x.p, slots.p, w.p, y.p, nullptr).ok());
    SlotBanks missing = fl->banks;
    if (f == WeightFormat::kFp8Block) {
      missing.down_scales = nullptr;
    } else {
      missing.up_global_scale = nullptr;
    }
    EXPECT_FALSE(LaunchRoutedExperts(missing, **ws, 1, x.p, slots.p, w.p, y.p, nullptr).ok());
  }
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::engine::gpu
