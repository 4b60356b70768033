// The Gated DeltaNet kernels against the CPU engine's (engine/gated_delta_net.h plus the gates
// and the gated RMSNorm as engine/model.cc computes them): pieces of 1, 2, 3, 70 and 130 tokens,
// some continuing a sequence from its slot's state and some starting one (start 0: the slot's
// old contents must not be read), a padding piece that must leave its slot alone and output
// zeros, a piece split over two passes equal bit for bit to one pass, and a captured decode
// step replayed bit-equal to eager with new pieces written into the same arrays. GPU test: skips
// without a GPU.
#include "engine/cuda/ops/delta_net.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/formats.h"
#include "common/gpu_test_util.h"
#include "engine/gated_delta_net.h"
#include "gtest/gtest.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/ops/ops_test_util.h"

namespace moe::engine::gpu {
namespace {

using testing::CheckCuda;
using testing::DeviceArray;
using testing::RandomF32;
using testing::Rng;

constexpr float kEps = 1e-6f;

struct Piece {
  int slot = 0;
  int start = 0;  // < 0: padding
  int rows = 0;
};

// One layer's weights and a pass's inputs, on the host.
struct Problem {
  DeltaNetShape shape;
  int num_slots = 0;
  int64_t slot_stride = 0;  // floats: conv [k - 1, C] then recurrent [nv, dk, dv]
  std::vector<float> conv_w, a_log, dt_bias, norm_w;
  std::vector<float> state;  // num_slots * slot_stride

  int C() const { return shape.conv_dim(); }
  int P() const { return C() + shape.value_dim() + 2 * shape.num_value_heads; }
  int64_t conv_floats() const { return static_cast<int64_t>(shape.conv_kernel - 1) * C(); }
};

Problem MakeProblem(const DeltaNetShape& shape, int num_slots, Rng& rng) {
  Problem p;
  p.shape = shape;
  p.num_slots = num_slots;
  p.slot_stride = p.conv_floats() + static_cast<int64_t>(shape.num_value_heads) *
                                        shape.key_head_dim * shape.value_head_dim;
  p.conv_w = RandomF32(rng, static_cast<size_t>(shape.conv_kernel) * p.C(), -0.6f, 0.6f);
  p.a_log.resize(shape.num_value_heads);
  for (float& a : p.a_log) a = std::log(rng.Uniform(1.0f, 16.0f));
  p.dt_bias = RandomF32(rng, shape.num_value_heads, -1.0f, 1.0f);
  p.norm_w = RandomF32(rng, shape.value_head_dim, 0.5f, 1.5f);
  p.state.resize(static_cast<size_t>(num_slots) * p.slot_stride);
  for (int s = 0; s < num_slots; ++s) {
    float* st = p.state.data() + s * p.slot_stride;
    for (int64_t i = 0; i < p.conv_floats(); ++i) st[i] = rng.Uniform(-1.0f, 1.0f);
    for (int64_t i = p.conv_floats(); i < p.slot_stride; ++i) st[i] = rng.Uniform(-0.2f, 0.2f);
  }
  return p;
}

int TotalRows(const std::vector<Piece>& pieces) {
  int n = 0;
  for (const Piece& pc : pieces) n += pc.rows;
  return n;
}

// The CPU engine's steps over `pieces`: out (f32 before the bf16 cast), state updated.
std::vector<float> CpuForward(const Problem& pr, const std::vector<Piece>& pieces,
                              const std::vector<float>& proj, std::vector<float>& state) {
  const DeltaNetShape& s = pr.shape;
  const int C = pr.C(), P = pr.P(), Kd = s.key_dim(), Vd = s.value_dim();
  const int nk = s.num_key_heads, nv = s.num_value_heads, dk = s.key_head_dim,
            dv = s.value_head_dim;
  const int rows = TotalRows(pieces);
  std::vector<float> out(static_cast<size_t>(rows) * Vd, 0.0f);
  std::vector<float> conv, g, beta, core, scratch;
  int r0 = 0;
  for (const Piece& pc : pieces) {
    const int n = pc.rows;
    if (pc.start < 0) {
      r0 += n;
      continue;
    }
    float* st = state.data() + pc.slot * pr.slot_stride;
    if (pc.start == 0) std::fill(st, st + pr.slot_stride, 0.0f);
    conv.assign(static_cast<size_t>(n) * C, 0.0f);
    CausalConvSilu(proj.data() + static_cast<size_t>(r0) * P, P, n, C, s.conv_kernel,
                   pr.conv_w.data(), st, conv.data());
    g.assign(static_cast<size_t>(n) * nv, 0.0f);
    beta.assign(g.size(), 0.0f);
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int t = 0; t < n; ++t) {
      float* row = conv.data() + static_cast<size_t>(t) * C;
      for (int h = 0; h < 2 * nk; ++h) {
        float* x = row + h * dk;
        float ss = 0.0f;
        for (int i = 0; i < dk; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / std::sqrt(ss + 1e-6f);
        for (int i = 0; i < dk; ++i) x[i] = h < nk ? (x[i] * inv) * q_scale : x[i] * inv;
      }
      const float* prow = proj.data() + static_cast<size_t>(r0 + t) * P;
      for (int h = 0; h < nv; ++h) {
        const float b = prow[C + Vd + h], a = prow[C + Vd + nv + h] + pr.dt_bias[h];
        beta[t * nv + h] = 1.0f / (1.0f + std::exp(-b));
        g[t * nv + h] = -std::exp(pr.a_log[h]) * (a > 20.0f ? a : std::log1p(std::exp(a)));
      }
    }
    core.assign(static_cast<size_t>(n) * Vd, 0.0f);
    scratch.assign(dv, 0.0f);
    for (int h = 0; h < nv; ++h) {
      const int kh = h / (nv / nk);
      DeltaRuleArgs a;
      a.n = n;
      a.key_dim = dk;
      a.value_dim = dv;
      a.q = conv.data() + kh * dk;
      a.k = conv.data() + Kd + kh * dk;
      a.qk_stride = C;
      a.v = conv.data() + 2 * Kd + h * dv;
      a.v_stride = C;
      a.g = g.data() + h;
      a.beta = beta.data() + h;
      a.gb_stride = nv;
      a.state = st + pr.conv_floats() + static_cast<int64_t>(h) * dk * dv;
      a.out = core.data() + h * dv;
      a.out_stride = Vd;
      DeltaRuleRecurrent(a, scratch.data());
    }
    for (int t = 0; t < n; ++t) {
      const float* zrow = proj.data() + static_cast<size_t>(r0 + t) * P + C;
      for (int h = 0; h < nv; ++h) {
        const float* o = core.data() + static_cast<size_t>(t) * Vd + h * dv;
        float ss = 0.0f;
        for (int i = 0; i < dv; ++i) ss += o[i] * o[i];
        const float inv = 1.0f / std::sqrt(ss / dv + kEps);
        for (int i = 0; i < dv; ++i) {
          const float z = zrow[h * dv + i];
          out[static_cast<size_t>(r0 + t) * Vd + h * dv + i] =
              pr.norm_w[i] * (o[i] * inv) * (z / (1.0f + std::exp(-z)));
        }
      }
    }
    r0 += n;
  }
  return out;
}

// Device buffers of one layer and a pass of up to max_rows rows / max_pieces pieces.
struct Gpu {
  Gpu(const Problem& pr, int max_rows, int max_pieces)
      : conv_w(pr.conv_w),
        a_log(pr.a_log),
        dt_bias(pr.dt_bias),
        norm_w(pr.norm_w),
        state(pr.state),
        proj(static_cast<size_t>(max_rows) * pr.P()),
        conv(static_cast<size_t>(max_rows) * pr.C()),
        g(static_cast<size_t>(max_rows) * pr.shape.num_value_heads),
        beta(g.size()),
        core(static_cast<size_t>(max_rows) * pr.shape.value_dim()),
        out(core.size()),
        positions(max_rows),
        first(max_pieces),
        nrows(max_pieces),
        start(max_pieces),
        slot(max_pieces) {}

  // Writes the pass's inputs (plain copies: legal between graph replays).
  void Stage(const std::vector<Piece>& pieces, const std::vector<float>& proj_host) {
    std::vector<int32_t> f, n, s, sl, pos;
    int r = 0;
    for (const Piece& pc : pieces) {
      f.push_back(r);
      n.push_back(pc.rows);
      s.push_back(pc.start);
      sl.push_back(pc.slot);
      for (int i = 0; i < pc.rows; ++i) pos.push_back(pc.start < 0 ? -1 : pc.start + i);
      r += pc.rows;
    }
    CheckCuda(cudaMemcpy(first.get(), f.data(), f.size() * 4, cudaMemcpyHostToDevice), "f");
    CheckCuda(cudaMemcpy(nrows.get(), n.data(), n.size() * 4, cudaMemcpyHostToDevice), "n");
    CheckCuda(cudaMemcpy(start.get(), s.data(), s.size() * 4, cudaMemcpyHostToDevice), "s");
    CheckCuda(cudaMemcpy(slot.get(), sl.data(), sl.size() * 4, cudaMemcpyHostToDevice), "sl");
    CheckCuda(cudaMemcpy(positions.get(), pos.data(), pos.size() * 4, cudaMemcpyHostToDevice),
              "pos");
    CheckCuda(cudaMemcpy(proj.get(), proj_host.data(), proj_host.size() * 4,
                         cudaMemcpyHostToDevice),
              "proj");
    CheckCuda(cudaDeviceSynchronize(), "stage");
  }

  absl::Status Enqueue(const Problem& pr, int num_pieces, int rows, cudaStream_t s) {
    const DeltaNetShape& sh = pr.shape;
    DeltaNetPieces pc;
    pc.num_pieces = num_pieces;
    pc.first_row = first.get();
    pc.num_rows = nrows.get();
    pc.start_pos = start.get();
    pc.state_slot = slot.get();
    DeltaNetState st;
    st.conv = state.get();
    st.recurrent = state.get() + pr.conv_floats();
    st.slot_stride = pr.slot_stride;
    st.num_slots = pr.num_slots;
    const int C = pr.C(), Vd = sh.value_dim(), nv = sh.num_value_heads;
    if (absl::Status e = LaunchDeltaNetConv(proj.get(), pr.P(), rows, sh, conv_w.get(), pc, st,
                                            conv.get(), s);
        !e.ok()) {
      return e;
    }
    if (absl::Status e = LaunchDeltaNetGates(conv.get(), rows, sh, positions.get(), proj.get(),
                                             pr.P(), C + Vd, C + Vd + nv, a_log.get(),
                                             dt_bias.get(), g.get(), beta.get(), s);
        !e.ok()) {
      return e;
    }
    if (absl::Status e = LaunchDeltaRule(conv.get(), g.get(), beta.get(), rows, sh, pc, st,
                                         core.get(), s);
        !e.ok()) {
      return e;
    }
    return LaunchGatedRmsNorm(core.get(), proj.get() + C, pr.P(), rows, nv, sh.value_head_dim,
                              norm_w.get(), kEps, out.get(), s);
  }

  DeviceArray<float> conv_w, a_log, dt_bias, norm_w, state, proj, conv, g, beta, core;
  DeviceArray<uint16_t> out;
  DeviceArray<int32_t> positions, first, nrows, start, slot;
};

std::vector<float> RandomProj(const Problem& pr, int rows, Rng& rng) {
  std::vector<float> proj = RandomF32(rng, static_cast<size_t>(rows) * pr.P(), -1.0f, 1.0f);
  // b and a columns over a wider range, so beta and the decay cover (0, 1) well.
  const int C = pr.C(), Vd = pr.shape.value_dim(), nv = pr.shape.num_value_heads;
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < 2 * nv; ++j) proj[static_cast<size_t>(r) * pr.P() + C + Vd + j] *= 3.0f;
  }
  return proj;
}

DeltaNetShape Tiny() { return {2, 4, 16, 8, 4}; }
DeltaNetShape Qwen36() { return {16, 32, 128, 128, 4}; }

void ExpectNear(const std::vector<float>& ref, const std::vector<float>& got, float atol,
                float rtol, const char* what) {
  ASSERT_EQ(ref.size(), got.size());
  int bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(ref[i]) - got[i]);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::fabs(ref[i]))) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << ref[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " off, worst " << worst;
}

void CheckAgainstCpu(const DeltaNetShape& shape) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(0x5eed0 + shape.key_head_dim);
  constexpr int kSlots = 6;
  Problem pr = MakeProblem(shape, kSlots, rng);
  // Continuing pieces (start > 0), starting ones (start 0, over slots holding old values), and
  // a padding piece on slot 0 (as a captured bucket pads: it must not touch slot 0).
  const std::vector<Piece> pieces = {{0, 9, 1},   {1, 0, 2},   {2, 40, 3}, {3, 0, 70},
                                     {4, 7, 130}, {5, 0, 1},   {0, -1, 1}};
  const int rows = TotalRows(pieces);
  const std::vector<float> proj = RandomProj(pr, rows, rng);
  std::vector<float> ref_state = pr.state;
  const std::vector<float> ref = CpuForward(pr, pieces, proj, ref_state);

  Gpu gpu(pr, rows, static_cast<int>(pieces.size()));
  gpu.Stage(pieces, proj);
  gpu.conv.Poison();
  gpu.core.Poison();
  gpu.out.Poison();
  ASSERT_TRUE(gpu.Enqueue(pr, static_cast<int>(pieces.size()), rows, nullptr).ok());
  const std::vector<uint16_t> out = gpu.out.Download();
  std::vector<float> got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = common::Bf16ToFloat(out[i]);
  // bf16 output: half an ulp is 2^-9 relative.
  ExpectNear(ref, got, 2e-3f, 8e-3f, "out");
  // The padding piece's row is all zeros.
  const int Vd = shape.value_dim();
  for (int i = 0; i < Vd; ++i) ASSERT_EQ(got[static_cast<size_t>(rows - 1) * Vd + i], 0.0f);
  ExpectNear(ref_state, gpu.state.Download(), 1e-4f, 2e-3f, "state");
}

TEST(DeltaNetTest, TinyShapeMatchesTheCpuEngine) { CheckAgainstCpu(Tiny()); }
TEST(DeltaNetTest, Qwen36ShapeMatchesTheCpuEngine) { CheckAgainstCpu(Qwen36()); }

// A piece run as two passes (60 then 70 tokens) equals the same piece in one pass, bit for bit:
// the state between passes holds exactly what the kernel kept in registers.
TEST(DeltaNetTest, SplitPieceEqualsOnePass) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(77);
  const Problem pr = MakeProblem(Qwen36(), 2, rng);
  const int n = 130, cut = 60;
  const std::vector<float> proj = RandomProj(pr, n, rng);
  const int P = pr.P();

  Gpu one(pr, n, 1);
  one.Stage({{1, 12, n}}, proj);
  ASSERT_TRUE(one.Enqueue(pr, 1, n, nullptr).ok());
  const std::vector<uint16_t> out_one = one.out.Download();
  const std::vector<float> state_one = one.state.Download();

  Gpu two(pr, n, 1);
  two.Stage({{1, 12, cut}}, std::vector<float>(proj.begin(), proj.begin() + cut * P));
  ASSERT_TRUE(two.Enqueue(pr, 1, cut, nullptr).ok());
  std::vector<uint16_t> out_two = two.out.Download();
  out_two.resize(static_cast<size_t>(cut) * pr.shape.value_dim());
  two.Stage({{1, 12 + cut, n - cut}}, std::vector<float>(proj.begin() + cut * P, proj.end()));
  ASSERT_TRUE(two.Enqueue(pr, 1, n - cut, nullptr).ok());
  const std::vector<uint16_t> rest = two.out.Download();
  out_two.insert(out_two.end(), rest.begin(),
                 rest.begin() + static_cast<size_t>(n - cut) * pr.shape.value_dim());
  ASSERT_EQ(out_one.size(), out_two.size());
  EXPECT_EQ(std::memcmp(out_one.data(), out_two.data(), out_one.size() * 2), 0);
  const std::vector<float> state_two = two.state.Download();
  EXPECT_EQ(std::memcmp(state_one.data(), state_two.data(), state_one.size() * 4), 0);
}

// A decode step of three sequences and a padding piece, captured once (global capture mode, so
// an allocation or synchronization inside fails) and replayed: equal bit for bit to the eager
// run from the same state, also after new pieces (other slots, a sequence start) are written
// into the same arrays.
TEST(DeltaNetTest, CapturedDecodeStepReplaysLikeEager) {
  MOE_SKIP_WITHOUT_GPU();
  Rng rng(99);
  const Problem pr = MakeProblem(Qwen36(), 5, rng);
  constexpr int kPieces = 4;
  const std::vector<Piece> step1 = {{0, 30, 1}, {2, 5, 1}, {4, 100, 1}, {0, -1, 1}};
  const std::vector<Piece> step2 = {{1, 0, 1}, {3, 8, 1}, {0, 31, 1}, {1, -1, 1}};
  const std::vector<float> proj1 = RandomProj(pr, kPieces, rng);
  const std::vector<float> proj2 = RandomProj(pr, kPieces, rng);

  cudaStream_t s;
  CheckCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  // Eager: two steps.
  Gpu eager(pr, kPieces, kPieces);
  std::vector<std::vector<uint16_t>> eager_out;
  for (const auto& [pieces, proj] : {std::pair{&step1, &proj1}, {&step2, &proj2}}) {
    eager.Stage(*pieces, *proj);
    ASSERT_TRUE(eager.Enqueue(pr, kPieces, kPieces, s).ok());
    CheckCuda(cudaStreamSynchronize(s), "eager");
    eager_out.push_back(eager.out.Download());
  }
  const std::vector<float> eager_state = eager.state.Download();

  Gpu graph(pr, kPieces, kPieces);
  cudaGraph_t g;
  CheckCuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  const absl::Status enq = graph.Enqueue(pr, kPieces, kPieces, s);
  CheckCuda(cudaStreamEndCapture(s, &g), "end capture");
  ASSERT_TRUE(enq.ok()) << enq;
  cudaGraphExec_t exec;
  CheckCuda(cudaGraphInstantiate(&exec, g, 0), "instantiate");
  int step = 0;
  for (const auto& [pieces, proj] : {std::pair{&step1, &proj1}, {&step2, &proj2}}) {
    graph.Stage(*pieces, *proj);
    CheckCuda(cudaGraphLaunch(exec, s), "launch");
    CheckCuda(cudaStreamSynchronize(s), "replay");
    const std::vector<uint16_t> out = graph.out.Download();
    EXPECT_EQ(std::memcmp(out.data(), eager_out[step].data(), out.size() * 2), 0) << step;
    ++step;
  }
  const std::vector<float> graph_state = graph.state.Download();
  EXPECT_EQ(std::memcmp(graph_state.data(), eager_state.data(), graph_state.size() * 4), 0);
  // The replays changed the state (the test would pass trivially otherwise).
  EXPECT_NE(std::memcmp(graph_state.data(), pr.state.data(), graph_state.size() * 4), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

TEST(DeltaNetTest, RejectsBadShapes) {
  DeltaNetShape bad = Tiny();
  bad.num_value_heads = 5;  // not a multiple of the key heads
  DeltaNetPieces pc;
  DeltaNetState st;
  EXPECT_EQ(LaunchDeltaRule(nullptr, nullptr, nullptr, 1, bad, pc, st, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  bad = Tiny();
  bad.key_head_dim = kMaxDeltaHeadDim + 1;
  EXPECT_EQ(LaunchDeltaNetConv(nullptr, 100, 1, bad, nullptr, pc, st, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::engine::gpu

#else  // !MOE_HAVE_CUDA

TEST(DeltaNetTest, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MOE_HAVE_CUDA
