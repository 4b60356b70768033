// cpu_moe kernels: one Forward call on one Highway target (ForwardImpl, the one function that
// cpu_moe.cc dispatches to, once per call). Over the routing plan that Forward built
// (ForwardPlan), it prepares x, runs pass 1 (gate_up rows) and pass 2 (down rows) as work items
// of (expert group, row block) on the thread pool, each item choosing its row kernel (row
// vectors, panels, AMX or fp8's fp16 FMAs), applies the activation between the passes and sums
// every token's routes into y:
//   prep x  -> pass 1 (gate_up rows, split by (group, row block), routes of the group inner)
//           -> h [routes, I] -> prep h -> pass 2 (down rows, split by (group, H-block) the same
//              way) -> part [routes, H] -> per token, the sum of its routes' rows -> y.
// A group is a unique expert with all its routes when deduping, a single route otherwise.
// Each weight row is decoded once per work item and dotted against up to 4 (bf16, fp8) or 8 (int8
// formats, bf16 by vdpbf16ps) routes at a time, so a row shared by several tokens is read from
// DRAM once and reused from registers / L1.
//
// Textual header of cpu_moe's per-target kernels, not for other users: cpu_moe.cc includes
// forward-inl.h once per Highway target through hwy/foreach_target.h, and the toggle guard below
// lets this file re-enter for each target.
#if defined(MOE_CPU_MOE_INTERNAL_FORWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_CPU_MOE_INTERNAL_FORWARD_INL_H_
#undef MOE_CPU_MOE_INTERNAL_FORWARD_INL_H_
#else
#define MOE_CPU_MOE_INTERNAL_FORWARD_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "common/thread_pool.h"
#include "cpu_moe/cpu_moe.h"
#include "cpu_moe/internal/activations-inl.h"
#include "cpu_moe/internal/amx_tiles-inl.h"
#include "cpu_moe/internal/forward_plan.h"
#include "cpu_moe/internal/fp8_fp16-inl.h"
#include "cpu_moe/internal/int8_panels-inl.h"
#include "cpu_moe/internal/kernel_common-inl.h"
#include "cpu_moe/internal/row_kernels-inl.h"
#include "cpu_moe/internal/tuning.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// The AVX3_DL extras of every kernel file (kernel_common-inl.h says why).
#pragma GCC target("avx512vnni")
#pragma GCC target("avx512bf16")
#pragma GCC target("amx-tile,amx-bf16")
#endif
namespace moe {
namespace cpu_moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using internal::ForwardPlan;

// h[j] = act(g[j], u[j]) for j < n, in place over g (u is clobbered). Every element goes through
// the same vector operations (a partial last vector is padded through a scratch array), so an
// element's result does not depend on where it sits in [0, n): work splits stay bit-identical.
HWY_INLINE void ApplyActivation(const Options& opt, float* HWY_RESTRICT g, float* HWY_RESTRICT u,
                                size_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  const auto one = hn::Set(df, 1.0f);
  const bool oai = opt.activation == Activation::kSwiGluOai;
  const auto limit = hn::Set(df, opt.swiglu_limit);
  const auto alpha = hn::Set(df, opt.swiglu_alpha);
  // Highway's Exp is valid up to +104 only (beyond, its exponent bits wrap and it returns
  // garbage): its argument is capped at 88, where exp is 1.7e38 and the quotient below is
  // |g| / 1.7e38, as good as the exact g e^g (< 1e-36 |g|) against any output's scale.
  const auto cap = hn::Set(df, 88.0f);
  auto act = [&](hn::Vec<decltype(df)> gv, hn::Vec<decltype(df)> uv) {
    if (!oai) {
      // silu(g) * u = g / (1 + exp(-g)) * u
      return hn::Mul(hn::Div(gv, hn::Add(one, hn::Exp(df, hn::Min(hn::Neg(gv), cap)))), uv);
    }
    const auto gc = hn::Min(gv, limit);
    const auto uc = hn::Min(hn::Max(uv, hn::Neg(limit)), limit);
    return hn::Mul(
        hn::Div(gc, hn::Add(one, hn::Exp(df, hn::Min(hn::Neg(hn::Mul(alpha, gc)), cap)))),
        hn::Add(uc, one));
  };
  size_t j = 0;
  for (; j + N <= n; j += N) {
    hn::StoreU(act(hn::LoadU(df, g + j), hn::LoadU(df, u + j)), df, g + j);
  }
  if (j < n) {
    HWY_ALIGN float tg[hn::MaxLanes(df)] = {};
    HWY_ALIGN float tu[hn::MaxLanes(df)] = {};
    std::memcpy(tg, g + j, (n - j) * sizeof(float));
    std::memcpy(tu, u + j, (n - j) * sizeof(float));
    hn::Store(act(hn::Load(df, tg), hn::Load(df, tu)), df, tg);
    std::memcpy(g + j, tg, (n - j) * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------
// The whole call for one format.

// Rows dotted together (sharing activation loads): gate with up in pass 1, row pairs in pass 2.
// Measured better for every format once the int8 activations needed one pointer each (one core,
// cache-hot, 4 routes per expert: q4_0 +9%, nvfp4 +5%, mxfp4 +7%, bf16 +30%).
template <common::WeightFormat F>
constexpr bool kFuseRows = true;

// Rows per work item (Tuning::pass1_rows / pass2_rows, validated by Forward): gate rows (and as
// many up rows) per pass-1 item, H rows per pass-2 item (even: a pass-2 item dots its rows in
// pairs, row p with row p + nb/2 of its block, so that each core reads two streams at once like
// pass 1's gate and up rows; one stream of adjacent rows kept too few bytes in flight and ran
// pass 2 at 0.43-0.50 of DRAM bandwidth against pass 1's 0.74 on the GPU machine's host).
// Neither changes any row's arithmetic: a row's dot has its own accumulators whatever row it is
// paired with, a pass-1 row is computed whole by one item, and a pass-2 item owns its output
// rows, adding routes in group order.

// Scratch memory of the Forward calls of one calling thread, kept between calls so that a
// decode step allocates nothing: allocating and freeing a call's buffers (activations, h, u,
// the per-route outputs) took several microseconds per call, a few percent of a T=1 step of a
// 4-bit layer on the GPU machine's 16-core host. Buffers above kKeepBytes (prefill sizes) are
// freed at the end of their call. The workers of the call's pool use the caller's buffers.
class CallScratch {
 public:
  enum Slot { kXActs, kHActs, kH, kU, kPart, kXFloat, kX32, kAmxX, kAmxH, kSync, kNumSlots };
  static constexpr size_t kKeepBytes = size_t{16} << 20;

  static CallScratch& ForThisThread() {
    static thread_local CallScratch scratch;
    return scratch;
  }

  // At least `bytes` (>= 1) bytes, 64-byte aligned, contents undefined.
  void* Get(Slot slot, size_t bytes) {
    common::AlignedBuffer<uint8_t>& b = buf_[slot];
    if (b.size() < bytes) b = common::AlignedBuffer<uint8_t>(std::max<size_t>(64, bytes));
    return b.data();
  }
  template <typename T>
  T* Get(Slot slot, size_t n) {
    return static_cast<T*>(Get(slot, n * sizeof(T)));
  }

  // Grows every slot to at least bytes[slot] bytes (slots asking 0 are left alone), so that the
  // Get calls of the same sizes that follow allocate nothing. false when memory runs out (the
  // slots already grown keep their buffers; Trim frees the large ones).
  bool Reserve(const size_t (&bytes)[kNumSlots]) {
    for (int slot = 0; slot < kNumSlots; ++slot) {
      common::AlignedBuffer<uint8_t>& b = buf_[slot];
      if (bytes[slot] == 0 || b.size() >= bytes[slot]) continue;
      b = common::AlignedBuffer<uint8_t>();  // the old buffer goes first: no peak of both
      absl::StatusOr<common::AlignedBuffer<uint8_t>> nb =
          common::AlignedBuffer<uint8_t>::Allocate(std::max<size_t>(64, bytes[slot]));
      if (!nb.ok()) return false;
      b = std::move(*nb);
    }
    return true;
  }

  // Frees the buffers larger than kKeepBytes.
  void Trim() {
    for (common::AlignedBuffer<uint8_t>& b : buf_) {
      if (b.size() > kKeepBytes) b = common::AlignedBuffer<uint8_t>();
    }
  }

 private:
  common::AlignedBuffer<uint8_t> buf_[kNumSlots];
};

// Spins (then yields: the worker it waits for may have been preempted) until v reads 0.
template <typename T>
HWY_INLINE void WaitForZero(const std::atomic<T>& v) {
  for (int spins = 0; v.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 4096) {
      hwy::Pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// kBf16Dot: bf16 by the CPU's bf16 dot product (ForwardPlan::bf16_dot_product).
template <common::WeightFormat F, bool kBf16Dot = false>
void ForwardFormat(ForwardPlan& plan) {
  const ExpertBank& bank = *plan.bank;
  const Options& opt = *plan.options;
  const internal::Tuning& tun = *plan.tuning;
  common::ThreadPool& pool = *plan.pool;
  const size_t H = bank.hidden, I = bank.intermediate;
  const size_t R = plan.route_token.size();
  const size_t T = plan.num_tokens;
  const int workers = pool.num_workers() + 1;
  // Panel banks (Layout::kPanels): items take whole 16-row panels (the row counts rounded up).
  const bool panels = IsQuant<F>() && bank.layout == Layout::kPanels;
  auto item_rows = [panels](int rows) {
    return static_cast<size_t>(panels ? std::min(internal::Tuning::kMaxRowsPerItem, (rows + 15) / 16 * 16)
                                      : rows);
  };
  const size_t pass1_rows = item_rows(tun.pass1_rows);
  const size_t pass2_rows = item_rows(tun.pass2_rows);
  const PfDist prefetch{static_cast<size_t>(tun.prefetch_bytes),
                       static_cast<size_t>(tun.prefetch_l2_bytes)};
  // Row streams per item (Tuning::row_streams): kAuto reads four streams where a group has at
  // most two routes in the int8 formats, whose per-byte work is high enough that two streams
  // left too few bytes in flight (host, side by side: T=1 steps 6-10% faster with four), and two
  // otherwise (with more routes the four-row tiles halve the routes per decoded row, 11% slower
  // at 4 routes per expert; bf16 and fp8 gained nothing from four streams at T=1).
  // Panel banks take two (kAuto): four panels at once were 0.8-2.8% faster at T=1 but 1-4.7%
  // slower at T=8-16 side by side on the host.
  auto streams_for = [&tun, panels](int routes) {
    if (tun.row_streams != internal::Tuning::kAuto) return tun.row_streams;
    return IsQuant<F>() && !panels && routes <= 2 ? 4 : 2;
  };
  // AMX (ForwardPlan::amx): experts with at least amx_min_routes routes.
  auto amx_for = [&plan](int routes) {
    if constexpr (!kBf16Dot || (F != common::WeightFormat::kFp8Block &&
                                F != common::WeightFormat::kBf16)) {
      (void)plan;
      (void)routes;
      return false;
    } else {
      return plan.UsesAmx(routes);
    }
  };
  // fp8 through AVX512-FP16 for the experts that do not go through AMX (ForwardPlan::fp8_fp16,
  // set only for fp8 banks on this target with bf16_dot_product). Its kernels take the fp32 x
  // and h rows themselves and prepare their activations per item (Fp8F16Pass1 / 2), so the
  // activation sets below serve only AMX's packing.
  const bool f16 = kBf16Dot && F == common::WeightFormat::kFp8Block && plan.fp8_fp16;

  const size_t global_stride = static_cast<size_t>(bank.global_scale_stride);
  MatrixRef gate_up{bank.gate_up_weights, bank.gate_up_scales, bank.gate_up_global_scales,
                    2 * I, H, prefetch, tun.block_lane, global_stride};
  if (bank.up_global_scales != nullptr) {
    gate_up.globals_hi = bank.up_global_scales;
    gate_up.globals_hi_row = I;
  }
  const MatrixRef down{bank.down_weights, bank.down_scales, bank.down_global_scales, H, I,
                       prefetch, tun.block_lane, global_stride};
  // fp8's fp16 kernels for experts with few routes (ForwardPlan::few_routes_max): the same
  // matrices read with deeper prefetches.
  const PfDist prefetch_few{static_cast<size_t>(plan.few_routes_prefetch_l1),
                            static_cast<size_t>(plan.few_routes_prefetch_l2)};
  MatrixRef gate_up_few = gate_up, down_few = down;
  gate_up_few.prefetch = down_few.prefetch = prefetch_few;

  using Clock = std::chrono::steady_clock;
  auto lap = [&plan, t = Clock::now()](int phase) mutable {
    const Clock::time_point now = Clock::now();
    plan.phase_seconds[phase] = std::chrono::duration<double>(now - t).count();
    t = now;
  };
  CallScratch& scratch = CallScratch::ForThisThread();
  struct TrimAtEnd {
    CallScratch& s;
    ~TrimAtEnd() { s.Trim(); }
  } trim_at_end{scratch};
  // Tokens that have at least one route, and the x activations of those.
  std::vector<int> token_slot(T, -1);
  std::vector<int> active_tokens;
  active_tokens.reserve(T);
  for (size_t t = 0; t < T; ++t) {
    if (plan.token_route_begin[t + 1] > plan.token_route_begin[t]) {
      token_slot[t] = static_cast<int>(active_tokens.size());
      active_tokens.push_back(static_cast<int>(t));
    }
  }
  const size_t NT = active_tokens.size();
  // AMX groups' activations, packed once per call for their tiles (AmxPackGroup): x for pass 1,
  // and h for pass 2, which the pass-1 items write as they finish their rows (AmxPutBf16). Route
  // columns: amx_col[g] to amx_col[g + 1] (0 wide for the other groups).
  std::vector<size_t> amx_col(plan.groups.size() + 1, 0);
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const int n = plan.groups[gi].end - plan.groups[gi].begin;
    amx_col[gi + 1] = amx_col[gi] + (amx_for(n) ? n : 0);
  }
  const size_t nch_h = (H + 63) / 64, nch_i = (I + 63) / 64;
  const size_t nhb = (H + pass2_rows - 1) / pass2_rows;
  // Every scratch buffer of the call grows with its tokens and routes: all of them are reserved
  // here, before any work, so that a call whose scratch cannot be had reads and writes nothing
  // and Forward returns ResourceExhausted (plan.scratch_bytes_missing).
  {
    size_t bytes[CallScratch::kNumSlots] = {};
    bytes[CallScratch::kXActs] = ActSet<F, kBf16Dot>::Bytes(NT, H);
    if (plan.x_dtype == DType::kBf16) bytes[CallScratch::kXFloat] = workers * H * sizeof(float);
    if (f16 && plan.x_dtype == DType::kBf16) bytes[CallScratch::kX32] = NT * H * sizeof(float);
    bytes[CallScratch::kAmxX] = amx_col.back() * 32 * nch_h * sizeof(uint32_t);
    bytes[CallScratch::kAmxH] = amx_col.back() * 32 * nch_i * sizeof(uint32_t);
    bytes[CallScratch::kH] = R * I * sizeof(float);
    bytes[CallScratch::kU] = R * I * sizeof(float);
    bytes[CallScratch::kHActs] = ActSet<F, kBf16Dot>::Bytes(R, I);
    bytes[CallScratch::kPart] = R * H * sizeof(float);
    bytes[CallScratch::kSync] = (plan.groups.size() + nhb) * sizeof(std::atomic<int>);
    if (!scratch.Reserve(bytes)) {
      for (size_t b : bytes) plan.scratch_bytes_missing += b;
      return;
    }
  }
  ActSet<F, kBf16Dot> xacts(NT, H, tun.block_lane,
                            scratch.Get(CallScratch::kXActs, ActSet<F, kBf16Dot>::Bytes(NT, H)),
                            panels);
  // x is prepared in items of kXChunk columns while there are fewer tokens than workers (whole
  // rows otherwise), so that at T=1 the workers share it instead of waiting for one of them.
  constexpr size_t kXChunk = 256;
  static_assert(kXChunk % 64 == 0, "x chunks must hold whole activation blocks (Granule)");
  const size_t x_chunks = NT >= static_cast<size_t>(workers) ? 1 : (H + kXChunk - 1) / kXChunk;
  const size_t x_chunk_cols = x_chunks == 1 ? H : kXChunk;
  const size_t nx = NT * x_chunks;
  float* const x_float =
      plan.x_dtype == DType::kBf16 ? scratch.Get<float>(CallScratch::kXFloat, workers * H) : nullptr;
  // fp16 path with bf16 x: each active token's row in fp32, kept for the pass-1 items.
  float* const x32 = f16 && plan.x_dtype == DType::kBf16
                         ? scratch.Get<float>(CallScratch::kX32, NT * H)
                         : nullptr;
  [[maybe_unused]] auto x_row32 = [&](size_t t) -> const float* {
    return x32 == nullptr ? static_cast<const float*>(plan.x) + t * H : x32 + token_slot[t] * H;
  };
  // The fp16 path reads x itself (x_row32); its activation set only feeds AMX's packing.
  const bool need_xacts = !f16 || amx_col.back() > 0;
  auto prep_x_item = [&](size_t item, int worker) {
    const size_t i = item / x_chunks;
    const size_t c0 = (item % x_chunks) * x_chunk_cols, c1 = std::min(H, c0 + x_chunk_cols);
    const size_t t = active_tokens[i];
    const float* xr;
    if (plan.x_dtype == DType::kF32) {
      xr = static_cast<const float*>(plan.x) + t * H;
    } else {
      // This worker's, at the row's offsets (the fp16 path: the token's own row).
      float* buf = x32 != nullptr ? x32 + i * H : x_float + worker * H;
      const uint16_t* xb = static_cast<const uint16_t*>(plan.x) + t * H;
      for (size_t j = c0; j < c1; ++j) buf[j] = common::Bf16ToFloat(xb[j]);
      xr = buf;
    }
    if (need_xacts) xacts.PrepareRange(i, xr, c0, c1);
  };
  // Overlapped passes (Tuning::overlap_passes): a pass-1 item also prepares its rows of h for
  // pass 2, which takes whole activation blocks (ActSet::Granule) per item.
  const bool overlap = tun.overlap_passes && pass1_rows % ActSet<F>::Granule() == 0;
  // With the passes overlapped and no AMX packing (which reads all of x first), preparing x is
  // part of the same fork-join: the pass-1 items start their weight streams and then wait for
  // it. Otherwise it is a fork-join of its own.
  const bool fuse_x = overlap && amx_col.back() == 0;
  if (!fuse_x) pool.ParallelFor(nx, [&](uint64_t item, int worker) { prep_x_item(item, worker); });
  // Uninitialized: every element is written before it is read (AmxPackGroup; AmxPutBf16 for
  // every column of h, AmxZeroTail for the rows of a short last chunk that hold none).
  [[maybe_unused]] uint32_t* const amx_bx =
      scratch.Get<uint32_t>(CallScratch::kAmxX, amx_col.back() * 32 * nch_h);
  [[maybe_unused]] uint32_t* const amx_bh =
      scratch.Get<uint32_t>(CallScratch::kAmxH, amx_col.back() * 32 * nch_i);
#if HWY_TARGET == HWY_AVX3_DL
  if constexpr (kBf16Dot) {
    if (amx_col.back() > 0) {
      constexpr bool kFp8Order = F == common::WeightFormat::kFp8Block;
      pool.ParallelFor(plan.groups.size(), [&](uint64_t gi, int) {
        if (amx_col[gi + 1] == amx_col[gi]) return;
        const internal::ExpertGroup& g = plan.groups[gi];
        const int n = g.end - g.begin;
        std::vector<ActView> acts(n);
        for (int i = 0; i < n; ++i) {
          acts[i] = xacts.View(token_slot[plan.route_token[plan.group_routes[g.begin + i]]]);
        }
        AmxPackGroup<kFp8Order>(acts.data(), n, H, amx_bx + amx_col[gi] * 32 * nch_h);
        AmxZeroTail(n, I, amx_bh + amx_col[gi] * 32 * nch_i);
      });
    }
  }
#endif
  lap(0);

  // Pass 1: h[route, I] = act(gate x, up x); the up dots go to u first.
  float* const h = scratch.Get<float>(CallScratch::kH, R * I);
  float* const u = scratch.Get<float>(CallScratch::kU, R * I);
  ActSet<F, kBf16Dot> hacts(R, I, tun.block_lane,
                            scratch.Get(CallScratch::kHActs, ActSet<F, kBf16Dot>::Bytes(R, I)),
                            panels);
  const size_t G = plan.groups.size();
  const size_t nrb = (I + pass1_rows - 1) / pass1_rows;
  const size_t row_bytes1 = RowBytes(F, H);
  std::atomic<size_t> x_left{fuse_x ? nx : 0};  // x items not yet done (fuse_x)
  auto pass1_item = [&](size_t item) {
    const internal::ExpertGroup& g = plan.groups[item / nrb];
    const size_t r0 = (item % nrb) * pass1_rows;
    const size_t r1 = std::min(I, r0 + pass1_rows);
    const int n = g.end - g.begin;
    ActView acts[64];
    size_t route_of[64];
    float* hrow[64];  // h and u rows of the chunk's routes
    float* urow[64];
    float gs[64], us[64], gs2[64], us2[64];
    float* const out[4] = {gs, us, gs2, us2};
    const int streams = streams_for(n);
    const bool use_amx = amx_for(n);
    const bool f16_item = f16 && !use_amx;
    const bool vec_done = use_amx || f16_item;  // rows not dotted by the loops below
    const MatrixRef& gate_up_f16 = n <= plan.few_routes_max ? gate_up_few : gate_up;
    // Panel banks with four streams: gate and up panels of r and of r + panel_half together
    // (whole panels; a last odd panel of the item goes with its up panel alone).
    const size_t panel_half = panels && streams == 4 ? (r1 - r0) / 32 * 16 : 0;
    if constexpr (IsQuant<F>()) {
      if (panels) {
        PrefetchPanel<F>(gate_up, g.expert, r0 / 16);
        PrefetchPanel<F>(gate_up, g.expert, (I + r0) / 16);
        if (panel_half > 0) {
          PrefetchPanel<F>(gate_up, g.expert, (r0 + panel_half) / 16);
          PrefetchPanel<F>(gate_up, g.expert, (I + r0 + panel_half) / 16);
        }
      }
    }
    if (f16_item) {
      // Its first two streams (Fp8F16RowRange: rows p and p + n/2 of the gate half first).
      PrefetchRow(gate_up_f16, g.expert, r0, row_bytes1);
      PrefetchRow(gate_up_f16, g.expert,
                  r0 + std::min<size_t>(r1 - r0, common::kFp8BlockSize) / 2, row_bytes1);
    } else if (!use_amx && !panels) {
      PrefetchRow(gate_up, g.expert, r0, row_bytes1);
      PrefetchRow(gate_up, g.expert, I + r0, row_bytes1);
    }
    if (streams == 4 && !vec_done && !panels) {
      PrefetchRow(gate_up, g.expert, r0 + (r1 - r0) / 2, row_bytes1);
      PrefetchRow(gate_up, g.expert, I + r0 + (r1 - r0) / 2, row_bytes1);
    }
    // With fuse_x, the x items come first in the fork-join and were claimed by workers that
    // wait on nothing; the weight streams above are already under way meanwhile.
    WaitForZero(x_left);
    for (int c0 = 0; c0 < n; c0 += 64) {
      const int nc = std::min(64, n - c0);
      for (int i = 0; i < nc; ++i) {
        const size_t route = plan.group_routes[g.begin + c0 + i];
        route_of[i] = route;
        acts[i] = xacts.View(token_slot[plan.route_token[route]]);
        hrow[i] = h + route * I;
        urow[i] = u + route * I;
      }
#if HWY_TARGET == HWY_AVX3_DL
      if constexpr (kBf16Dot) {
        if (use_amx) {
          // (Groups of more than 64 routes: the subgroups of this chunk of 64.)
          AmxDotRows<F>(gate_up, g.expert, r0, static_cast<long>(I + r0), r1 - r0,
                        amx_bx + (amx_col[item / nrb] + c0) * 32 * nch_h, nc,
                        [&](int set, size_t j, int i, float v) {
                          (set == 0 ? hrow : urow)[i][r0 + j] = v;
                        });
        }
        if (f16_item) {
          const float* xr[64];
          for (int i = 0; i < nc; ++i) xr[i] = x_row32(plan.route_token[route_of[i]]);
          Fp8F16Pass1(gate_up_f16, g.expert, I, r0, r1, xr, nc, hrow, urow);
        }
      }
#endif
      if constexpr (IsQuant<F>()) {
        if (panels) {
          // A gate panel with its up panel: 16 rows of each per PanelDot.
          float post[64], post_up[64];
          std::fill(post, post + nc, PanelPost<F>(gate_up, g.expert));
          std::fill(post_up, post_up + nc, PanelPost<F>(gate_up, g.expert, I));
          float* o[256];
          for (size_t r = r0; r < r0 + panel_half; r += 16) {
            const size_t pn[4] = {r / 16, (I + r) / 16, (r + panel_half) / 16,
                                  (I + r + panel_half) / 16};
            for (int i = 0; i < nc; ++i) {
              o[i] = hrow[i] + r;
              o[nc + i] = urow[i] + r;
              o[2 * nc + i] = hrow[i] + r + panel_half;
              o[3 * nc + i] = urow[i] + r + panel_half;
            }
            PanelDotMany<F, 4>(gate_up, g.expert, pn, acts, post, nc, o, post_up);
          }
          for (size_t r = r0 + 2 * panel_half; r < r1; r += 16) {
            const size_t pn[2] = {r / 16, (I + r) / 16};
            for (int i = 0; i < nc; ++i) {
              o[i] = hrow[i] + r;
              o[nc + i] = urow[i] + r;
            }
            PanelDotMany<F, 2>(gate_up, g.expert, pn, acts, post, nc, o, post_up);
          }
        }
      }
      // With four streams, gate and up rows of r and of r + half go together (rows [r0, r1)
      // split in two halves; an odd last row goes alone with its up row).
      const size_t half = streams == 4 && !vec_done && !panels ? (r1 - r0) / 2 : 0;
      for (size_t r = r0; r < r0 + half; ++r) {
        const size_t rows[4] = {r, I + r, r + half, I + r + half};
        DotRowsMany<F, 4, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          hrow[i][r] = gs[i];
          urow[i][r] = us[i];
          hrow[i][r + half] = gs2[i];
          urow[i][r + half] = us2[i];
        }
      }
      for (size_t r = vec_done || panels ? r1 : r0 + 2 * half; r < r1; ++r) {
        // The gate and up rows of r together: one pass over the activations for both.
        const size_t rows[2] = {r, I + r};
        if constexpr (kFuseRows<F>) {
          DotRowsMany<F, 2, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
        } else {
          DotRowsMany<F, 1, kBf16Dot>(gate_up, g.expert, rows, acts, nc, out);
          DotRowsMany<F, 1, kBf16Dot>(gate_up, g.expert, rows + 1, acts, nc, out + 1);
        }
        for (int i = 0; i < nc; ++i) {
          hrow[i][r] = gs[i];
          urow[i][r] = us[i];
        }
      }
      for (int i = 0; i < nc; ++i) {
        ApplyActivation(opt, hrow[i] + r0, urow[i] + r0, r1 - r0);
#if HWY_TARGET == HWY_AVX3_DL
        if constexpr (kBf16Dot) {
          if (use_amx) {
            AmxPutBf16<F == common::WeightFormat::kFp8Block>(
                amx_bh + amx_col[item / nrb] * 32 * nch_i, n, I, c0 + i, r0, r1, hrow[i]);
            continue;
          }
        }
#endif
        if (overlap && !f16) hacts.PrepareRange(route_of[i], hrow[i], r0, r1);
      }
    }
  };

  // Pass 2: y[t, H-block] = sum over routes of w * down_e h.
  // Split like pass 1: one item per (group, H-block), so an expert's down rows are read once and
  // reused across its routes; each route's weighted dots of the block go to its own row of `part`
  // (written by exactly one item: no reduction between workers), then every token's y sums its
  // routes' rows in route order (a fixed order: results do not depend on the split). This
  // replaced an earlier pass 2 (one item per H-block owning every token's outputs and visiting
  // every expert): there the item count tied the rows per item to H / workers, and short
  // per-expert streams ran pass 2 at 0.55-0.73 of DRAM on the GPU machine's host; with 128-row
  // blocks of one expert per item the host's T=64 steps ran 5-9% faster side by side.
  const size_t row_bytes2 = RowBytes(F, I);
  float* const part = scratch.Get<float>(CallScratch::kPart, R * H);
  auto pass2_item = [&](size_t item) {
    const internal::ExpertGroup& g = plan.groups[item / nhb];
    const size_t h0 = (item % nhb) * pass2_rows, h1 = std::min(H, h0 + pass2_rows);
    // Rows dotted together: p, p + q, p + 2q, p + 3q (four streams) for p < q = nb / 4, then
    // pairs p, p + h (h = what is left / 2) of the rest; with two streams only the pairs.
    const int n = g.end - g.begin;
    const bool use_amx = amx_for(n);
    const bool f16_item = f16 && !use_amx;
    const MatrixRef& down_f16 = n <= plan.few_routes_max ? down_few : down;
    const size_t q = streams_for(n) == 4 && !use_amx && !panels && !f16_item ? (h1 - h0) / 4 : 0;
    const size_t p0 = h0 + 4 * q;
    const size_t half = use_amx || panels ? 0 : (h1 - p0) / 2;
    // Panel banks: the np panels of the block from ph0 on; with four streams P, P + pq,
    // P + 2 pq, P + 3 pq for P < pq = np / 4 first; then of the rest (from pb on), P with
    // P + phalf (an odd last one alone).
    const size_t ph0 = h0 / 16, np = (h1 - h0) / 16;
    const size_t pq = panels && streams_for(n) == 4 ? np / 4 : 0, pb = ph0 + 4 * pq;
    const size_t phalf = panels ? (np - 4 * pq) / 2 : 0;
    if constexpr (IsQuant<F>()) {
      if (panels) {
        for (size_t j = 0; j < (pq > 0 ? 4 : 0); ++j) PrefetchPanel<F>(down, g.expert, ph0 + j * pq);
        PrefetchPanel<F>(down, g.expert, pb);
        if (phalf > 0) PrefetchPanel<F>(down, g.expert, pb + phalf);
      }
    }
    for (size_t j = 0; j < (q > 0 ? 4 : 0); ++j) PrefetchRow(down, g.expert, h0 + j * q, row_bytes2);
    if (!use_amx && !panels) {
      PrefetchRow(f16_item ? down_f16 : down, g.expert, p0, row_bytes2);
      PrefetchRow(f16_item ? down_f16 : down, g.expert, p0 + half, row_bytes2);
    }
    ActView acts[64];
    [[maybe_unused]] const float* hin[64];  // fp32 h rows (the fp16 path)
    float* dst[64];
    float wt[64];
    float dots[4][64];
    float* const out[4] = {dots[0], dots[1], dots[2], dots[3]};
    for (int c0 = 0; c0 < n; c0 += 64) {
      const int nc = std::min(64, n - c0);
      for (int i = 0; i < nc; ++i) {
        const size_t route = plan.group_routes[g.begin + c0 + i];
        acts[i] = hacts.View(route);
        hin[i] = h + route * I;
        dst[i] = part + route * H;
        wt[i] = plan.route_weight[route];
      }
#if HWY_TARGET == HWY_AVX3_DL
      if constexpr (kBf16Dot) {
        if (use_amx) {
          // Rows [h0, h0 + nb/2) and [h0 + nb/2, h1) as the two sets (nb = h1 - h0 is even).
          const size_t hb = (h1 - h0) / 2;
          AmxDotRows<F>(down, g.expert, h0, static_cast<long>(h0 + hb), hb,
                        amx_bh + (amx_col[item / nhb] + c0) * 32 * nch_i, nc,
                        [&](int set, size_t j, int i, float v) {
                          dst[i][h0 + set * hb + j] = wt[i] * v;
                        });
        }
        if (f16_item) {
          Fp8F16Pass2(down_f16, g.expert, h0, h1, hin, wt, nc, dst);
          continue;
        }
      }
#endif
      if constexpr (IsQuant<F>()) {
        if (panels) {
          float scale[64];
          const float post = PanelPost<F>(down, g.expert);
          for (int i = 0; i < nc; ++i) scale[i] = post * wt[i];
          float* o[256];
          for (size_t p = 0; p < pq; ++p) {
            const size_t pn[4] = {ph0 + p, ph0 + pq + p, ph0 + 2 * pq + p, ph0 + 3 * pq + p};
            for (int j = 0; j < 4; ++j) {
              for (int i = 0; i < nc; ++i) o[j * nc + i] = dst[i] + 16 * pn[j];
            }
            PanelDotMany<F, 4>(down, g.expert, pn, acts, scale, nc, o);
          }
          for (size_t p = 0; p < phalf; ++p) {
            const size_t pn[2] = {pb + p, pb + phalf + p};
            for (int i = 0; i < nc; ++i) {
              o[i] = dst[i] + 16 * pn[0];
              o[nc + i] = dst[i] + 16 * pn[1];
            }
            PanelDotMany<F, 2>(down, g.expert, pn, acts, scale, nc, o);
          }
          if ((np - 4 * pq) % 2 != 0) {
            const size_t pn[1] = {ph0 + np - 1};
            for (int i = 0; i < nc; ++i) o[i] = dst[i] + 16 * pn[0];
            PanelDotMany<F, 1>(down, g.expert, pn, acts, scale, nc, o);
          }
        }
      }
      for (size_t p = 0; p < q; ++p) {
        const size_t rows[4] = {h0 + p, h0 + q + p, h0 + 2 * q + p, h0 + 3 * q + p};
        DotRowsMany<F, 4, kBf16Dot>(down, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          for (int j = 0; j < 4; ++j) dst[i][rows[j]] = wt[i] * dots[j][i];
        }
      }
      for (size_t p = 0; p < half; ++p) {
        const size_t rows[2] = {p0 + p, p0 + half + p};
        DotRowsMany<F, 2, kBf16Dot>(down, g.expert, rows, acts, nc, out);
        for (int i = 0; i < nc; ++i) {
          dst[i][rows[0]] = wt[i] * dots[0][i];
          dst[i][rows[1]] = wt[i] * dots[1][i];
        }
      }
    }
  };
  // y[t, h0:h1] = (accumulate ? y : 0) + the sum of t's routes' rows of `part`, in route order.
  constexpr size_t kYBlock = 512;
  static_assert(kYBlock >= internal::Tuning::kMaxRowsPerItem, "a pass-2 block must fit in one y block");
  auto reduce_y = [&](size_t t, size_t h0, size_t h1) {
    float sum[kYBlock];
    const int rb = plan.token_route_begin[t], re = plan.token_route_begin[t + 1];
    std::copy(part + rb * H + h0, part + rb * H + h1, sum);
    for (int route = rb + 1; route < re; ++route) {
      const float* pr = part + route * H;
      for (size_t j = h0; j < h1; ++j) sum[j - h0] += pr[j];
    }
    if (plan.y_dtype == DType::kF32) {
      float* yr = static_cast<float*>(plan.y) + t * H;
      for (size_t j = h0; j < h1; ++j) yr[j] = (opt.accumulate ? yr[j] : 0.0f) + sum[j - h0];
    } else {
      uint16_t* yr = static_cast<uint16_t*>(plan.y) + t * H;
      for (size_t j = h0; j < h1; ++j) {
        const float prev = opt.accumulate ? common::Bf16ToFloat(yr[j]) : 0.0f;
        yr[j] = common::FloatToBf16(prev + sum[j - h0]);
      }
    }
  };

  if (!overlap) {
    // Four fork-joins: pass 1, prep h, pass 2, y.
    pool.ParallelFor(G * nrb, [&](uint64_t item, int) { pass1_item(item); });
    lap(1);
    if (!f16) pool.ParallelFor(R, [&](uint64_t r, int) { hacts.Prepare(r, h + r * I); });
    lap(2);
    pool.ParallelFor(G * nhb, [&](uint64_t item, int) { pass2_item(item); });
    const size_t nyb = (H + kYBlock - 1) / kYBlock;
    pool.ParallelFor(active_tokens.size() * nyb, [&](uint64_t item, int) {
      const size_t h0 = (item % nyb) * kYBlock;
      reduce_y(active_tokens[item / nyb], h0, std::min(H, h0 + kYBlock));
    });
    lap(3);
    return;
  }

  // One fork-join for both passes and the sums: items are claimed in order, all of pass 1 before
  // any of pass 2, so workers that run out of pass-1 items go on with pass-2 items of groups
  // whose pass 1 is complete (the first groups, done long before) instead of idling at a barrier
  // while the last pass-1 items finish: the weight streams never drain between the passes. A
  // pass-2 item waits (rarely) until its group's pass-1 items are all done; they were claimed
  // earlier by workers that wait on nothing, so the wait ends. The worker that completes the
  // last group of an H-block sums that block of y, so no further join is needed.
  // With fuse_x, the x items come first (see fuse_x).
  std::atomic<int>* const pending1 = static_cast<std::atomic<int>*>(
      scratch.Get(CallScratch::kSync, (G + nhb) * sizeof(std::atomic<int>)));
  std::atomic<int>* const pending2 = pending1 + G;
  for (size_t g = 0; g < G; ++g) new (&pending1[g]) std::atomic<int>(static_cast<int>(nrb));
  for (size_t b = 0; b < nhb; ++b) new (&pending2[b]) std::atomic<int>(static_cast<int>(G));
  std::atomic<size_t> pass1_left{G * nrb};
  const Clock::time_point start = Clock::now();
  Clock::time_point x_end = start;  // written by the worker that finishes the last x item
  Clock::time_point pass1_end{};    // written by the worker that finishes pass 1's last item
  const size_t n0 = fuse_x ? nx : 0;
  const size_t n1 = G * nrb;
  pool.ParallelFor(n0 + n1 + G * nhb, [&](uint64_t item, int worker) {
    if (item < n0) {
      prep_x_item(item, worker);
      if (x_left.fetch_sub(1, std::memory_order_acq_rel) == 1) x_end = Clock::now();
      return;
    }
    item -= n0;
    if (item < n1) {
      pass1_item(item);
      pending1[item / nrb].fetch_sub(1, std::memory_order_release);
      if (pass1_left.fetch_sub(1, std::memory_order_acq_rel) == 1) pass1_end = Clock::now();
      return;
    }
    item -= n1;
    WaitForZero(pending1[item / nhb]);
    pass2_item(item);
    const size_t b = item % nhb;
    if (pending2[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      const size_t h0 = b * pass2_rows, h1 = std::min(H, h0 + pass2_rows);
      for (int t : active_tokens) reduce_y(t, h0, h1);
    }
  });
  const Clock::time_point end = Clock::now();
  if (fuse_x) plan.phase_seconds[0] += std::chrono::duration<double>(x_end - start).count();
  plan.phase_seconds[1] = std::chrono::duration<double>(pass1_end - x_end).count();
  plan.phase_seconds[2] = 0.0;  // done inside pass 1
  plan.phase_seconds[3] = std::chrono::duration<double>(end - pass1_end).count();
}

void ForwardImpl(ForwardPlan& plan) {
  switch (plan.bank->format) {
    case common::WeightFormat::kBf16:
#if HWY_TARGET == HWY_AVX3_DL
      // Forward sets bf16_dot_product only when this target runs on a CPU with AVX512_BF16.
      if (plan.bf16_dot_product) return ForwardFormat<common::WeightFormat::kBf16, true>(plan);
#endif
      return ForwardFormat<common::WeightFormat::kBf16>(plan);
    case common::WeightFormat::kFp8Block:
#if HWY_TARGET == HWY_AVX3_DL
      // Forward sets bf16_dot_product only when this target runs on a CPU with AVX512_BF16.
      if (plan.bf16_dot_product) return ForwardFormat<common::WeightFormat::kFp8Block, true>(plan);
#endif
      return ForwardFormat<common::WeightFormat::kFp8Block>(plan);
    case common::WeightFormat::kQ4_0: return ForwardFormat<common::WeightFormat::kQ4_0>(plan);
    case common::WeightFormat::kNvfp4: return ForwardFormat<common::WeightFormat::kNvfp4>(plan);
    case common::WeightFormat::kMxfp4: return ForwardFormat<common::WeightFormat::kMxfp4>(plan);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu_moe
}  // namespace moe
HWY_AFTER_NAMESPACE();

#endif  // MOE_CPU_MOE_INTERNAL_FORWARD_INL_H_ toggle guard
