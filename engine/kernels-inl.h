// Per-target bodies of kernels.h, included once per Highway target by kernels.cc.
#if defined(MOE_ENGINE_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_ENGINE_KERNELS_INL_H_
#undef MOE_ENGINE_KERNELS_INL_H_
#else
#define MOE_ENGINE_KERNELS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/thread_pool.h"
#include "engine/kernels.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace moe::engine {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Four accumulators over full vectors, then a scalar tail: a fixed order for a given target.
inline float DotF32(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int n) {
  const hn::ScalableTag<float> d;
  const int N = static_cast<int>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  int i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
    s1 = hn::MulAdd(hn::LoadU(d, a + i + N), hn::LoadU(d, b + i + N), s1);
    s2 = hn::MulAdd(hn::LoadU(d, a + i + 2 * N), hn::LoadU(d, b + i + 2 * N), s2);
    s3 = hn::MulAdd(hn::LoadU(d, a + i + 3 * N), hn::LoadU(d, b + i + 3 * N), s3);
  }
  for (; i + N <= n; i += N) s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
  float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// a f32 . b bf16 (bits): b is widened exactly to f32.
inline float DotBf16(const float* HWY_RESTRICT a, const uint16_t* HWY_RESTRICT b, int n) {
  const hn::ScalableTag<float> d;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const hn::RebindToUnsigned<decltype(d)> du;
  const int N = static_cast<int>(hn::Lanes(d));
  auto widen = [&](const uint16_t* p) {
    return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
  };
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  int i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 = hn::MulAdd(hn::LoadU(d, a + i), widen(b + i), s0);
    s1 = hn::MulAdd(hn::LoadU(d, a + i + N), widen(b + i + N), s1);
  }
  for (; i + N <= n; i += N) s0 = hn::MulAdd(hn::LoadU(d, a + i), widen(b + i), s0);
  float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(b[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    sum += a[i] * f;
  }
  return sum;
}

// y += alpha * x
inline void Axpy(float alpha, const float* HWY_RESTRICT x, float* HWY_RESTRICT y, int n) {
  const hn::ScalableTag<float> d;
  const int N = static_cast<int>(hn::Lanes(d));
  const auto va = hn::Set(d, alpha);
  int i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::MulAdd(va, hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
  for (; i < n; ++i) y[i] += alpha * x[i];
}

inline void GemvImpl(const float* x, int m, int k, const void* w, bool w_bf16, int n, float* y,
                     bool accumulate, common::ThreadPool& pool) {
  // Tasks of 16 output columns for every row: each output is one dot product, so the order
  // does not depend on how tasks land on threads.
  constexpr int kCols = 16;
  const int col_tasks = (n + kCols - 1) / kCols;
  pool.ParallelFor(static_cast<uint64_t>(col_tasks), [&](uint64_t task, int) {
    const int c0 = static_cast<int>(task) * kCols;
    const int c1 = std::min(n, c0 + kCols);
    for (int r = 0; r < m; ++r) {
      const float* xr = x + static_cast<int64_t>(r) * k;
      float* yr = y + static_cast<int64_t>(r) * n;
      for (int c = c0; c < c1; ++c) {
        const float v =
            w_bf16 ? DotBf16(xr, static_cast<const uint16_t*>(w) + static_cast<int64_t>(c) * k, k)
                   : DotF32(xr, static_cast<const float*>(w) + static_cast<int64_t>(c) * k, k);
        yr[c] = accumulate ? yr[c] + v : v;
      }
    }
  });
}

inline void RmsNormRowsImpl(const float* x, int rows, int n, const float* weight, float eps,
                            float* out) {
  const hn::ScalableTag<float> d;
  const int N = static_cast<int>(hn::Lanes(d));
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * n;
    float* o = out + static_cast<int64_t>(r) * n;
    const float ms = DotF32(xr, xr, n) / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(ms + eps);
    const auto vinv = hn::Set(d, inv);
    int i = 0;
    // HF: weight * (x * rsqrt(...)), in that order.
    for (; i + N <= n; i += N) {
      hn::StoreU(hn::Mul(hn::LoadU(d, weight + i), hn::Mul(hn::LoadU(d, xr + i), vinv)), d, o + i);
    }
    for (; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

inline void AttentionImpl(const AttentionArgs& a, common::ThreadPool& pool) {
  const int group = a.num_heads / a.num_kv_heads;
  const int hd = a.head_dim;
  std::vector<std::vector<float>> scratch(pool.num_workers());
  pool.ParallelFor(static_cast<uint64_t>(a.rows) * a.num_heads, [&](uint64_t task, int worker) {
    const int r = static_cast<int>(task / a.num_heads);
    const int h = static_cast<int>(task % a.num_heads);
    const int kvh = h / group;
    const int len = a.positions[r] + 1;
    std::vector<float>& s = scratch[worker];
    if (static_cast<int>(s.size()) < len) s.resize(std::max(len, a.max_positions));
    const float* q = a.q + (static_cast<int64_t>(r) * a.num_heads + h) * hd;
    const int32_t* table = a.block_tables[r];
    float mx = -INFINITY;
    for (int j = 0; j < len; ++j) {
      const int64_t off = table[j / a.block_size] * a.block_stride +
                          (static_cast<int64_t>(kvh) * a.block_size + j % a.block_size) * hd;
      s[j] = DotF32(q, a.k_cache + off, hd) * a.scale;
      mx = std::max(mx, s[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    const float inv = 1.0f / sum;
    float* o = a.out + (static_cast<int64_t>(r) * a.num_heads + h) * hd;
    std::fill(o, o + hd, 0.0f);
    for (int j = 0; j < len; ++j) {
      const int64_t off = table[j / a.block_size] * a.block_stride +
                          (static_cast<int64_t>(kvh) * a.block_size + j % a.block_size) * hd;
      Axpy(s[j] * inv, a.v_cache + off, o, hd);
    }
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace moe::engine
HWY_AFTER_NAMESPACE();

#endif  // MOE_ENGINE_KERNELS_INL_H_ toggle
