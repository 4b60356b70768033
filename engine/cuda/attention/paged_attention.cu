// Paged attention kernels (see paged_attention.h for the contract).
//
// One warp owns 16 query rows that share a KV head and walks key tiles of 16 positions (a tile
// never straddles a KV block: block_size is a multiple of 16 and tiles start at multiples of 16).
// Per tile, with mma.sync m16n8k16 (bf16 in, f32 accumulate):
//   S[16 rows, 16 pos] = Q[16, D] . K^T    A = Q (registers), B = K rows loaded straight from the
//                                           pool: each lane reads 16 contiguous bytes per load
//   online softmax in the log2 domain (FlashAttention-2's running max / sum per row)
//   O[16, D] += P[16, 16] . V              A = P, reusing S's accumulator layout; B = V, whose
//                                           pairs of positions are packed with byte permutes
// The dot products are order-free in the head dimension, so each lane's k-slots are mapped to
// dimensions that make its loads contiguous; Q uses the same map. Q and P are split into
// bf16 hi + lo (two mma each), which keeps ~16 significant bits instead of bf16's 8.
//
// Decode: rows are the query heads of one (sequence, KV head); a block of 4 warps covers one
// split of the sequence, merges its warps through shared memory and writes a normalized
// partial output and its log2-sum-exp; the reduce kernel combines the splits.
// Prefill: rows are (token, head-in-group) pairs of one KV head; each warp walks the tiles up to
// its last row's position, masking causally, and writes the normalized output.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/cuda/attention/paged_attention.h"

namespace moe::engine::gpu {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;
constexpr int kRows = 16;
constexpr float kLog2e = 1.4426950408889634f;

int Log2(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

// The pool geometry every kernel needs.
struct Pool {
  const uint16_t* k;
  const uint16_t* v;
  int num_kv_heads;
  int block_shift;  // log2(block_size)
};

// Start of the 16-row tile at position `pos` (a multiple of 16) of KV head `kvh`, given the
// tile's block id. Rows are head_dim apart.
template <int D>
__device__ __forceinline__ int64_t TileOffset(const Pool& p, int block, int kvh, int pos) {
  const int bs_mask = (1 << p.block_shift) - 1;
  return ((static_cast<int64_t>(block) * p.num_kv_heads + kvh) << p.block_shift |
          (pos & bs_mask)) *
         D;
}

__device__ __forceinline__ uint32_t AsU32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// (a, b) -> bf16 pair hi (low half = a) and the pair of what hi leaves out.
__device__ __forceinline__ void SplitBf16(float a, float b, uint32_t* hi, uint32_t* lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  *hi = AsU32(h);
  *lo = AsU32(__floats2bfloat162_rn(a - hf.x, b - hf.y));
}

__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Loads N consecutive 32-bit words (N in 1, 2, 4, 8) from a 4N-byte aligned address with the
// widest loads, or zeros when !valid.
template <int N>
__device__ __forceinline__ void LoadWords(const uint16_t* src, bool valid, uint32_t (&w)[N]) {
  if (!valid) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = 0;
    return;
  }
  if constexpr (N >= 4) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + i / 4);
      w[i] = x.x;
      w[i + 1] = x.y;
      w[i + 2] = x.z;
      w[i + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(src));
    w[0] = x.x;
    w[1] = x.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
  }
}

// Dimension of the first element of the lane's k-word w (t = lane % 4). For D >= 32, words come
// in groups of four covering 8 contiguous dimensions per lane (one 16-byte load): word 4j + e
// holds dims 32j + 8t + 2e, +1. For D = 16 a lane's two words are dims 4t .. 4t + 3.
template <int D>
__device__ __forceinline__ int KDim(int w, int t) {
  if constexpr (D == 16) {
    return 4 * t + 2 * w;
  } else {
    return 32 * (w >> 2) + 8 * t + 2 * (w & 3);
  }
}

// Query fragments of 16 rows (A operand of S = Q K^T), scaled by head_dim^-0.5 * log2(e) and
// split hi + lo. k-step j uses words 2j (regs 0/1: rows g / g+8) and 2j+1 (regs 2/3).
template <int D>
struct QFrag {
  uint32_t hi[D / 16][4];
  uint32_t lo[D / 16][4];
};

// row0 / row1: f32 query rows for rows g and g + 8 (nullptr: a row that does not exist).
template <int D>
__device__ __forceinline__ void LoadQ(const float* row0, const float* row1, float qscale, int t,
                                      QFrag<D>& q) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int dim = KDim<D>(2 * j + half, t);
      float2 a = make_float2(0.f, 0.f), b = make_float2(0.f, 0.f);
      if (row0 != nullptr) a = *reinterpret_cast<const float2*>(row0 + dim);
      if (row1 != nullptr) b = *reinterpret_cast<const float2*>(row1 + dim);
      SplitBf16(a.x * qscale, a.y * qscale, &q.hi[j][2 * half], &q.lo[j][2 * half]);
      SplitBf16(b.x * qscale, b.y * qscale, &q.hi[j][2 * half + 1], &q.lo[j][2 * half + 1]);
    }
  }
}

// Running state of one warp: per lane, rows g (index 0) and g + 8 (index 1).
template <int D>
struct WarpAcc {
  float o[D / 8][4];  // n-tile i: c0,c1 = row g dims (D/8)*2t + i, (D/8)*(2t+1) + i; c2,c3 row g+8
  float m[2];         // running max (log2 domain), -inf before any valid score
  float l[2];         // this lane's share of the running sum
};

template <int D>
__device__ __forceinline__ void InitAcc(WarpAcc<D>& acc) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc.o[i][c] = 0.f;
  }
  acc.m[0] = acc.m[1] = -INFINITY;
  acc.l[0] = acc.l[1] = 0.f;
}

// One key tile at position `base`. kt / vt: the tile's first row in the pools. Position p is
// used for row r iff p < kend and p <= lim[r]; rows at or past `valid_end` are not read (their
// bytes may be stale and not finite). kTwoRows: rows g + 8 exist (else their work is skipped).
template <int D, bool kTwoRows>
__device__ __forceinline__ void AttendTile(const QFrag<D>& q, const uint16_t* kt,
                                           const uint16_t* vt, int base, int valid_end, int kend,
                                           int lim0, int lim1, WarpAcc<D>& acc) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int kKWords = D / 8;   // per lane per key row
  constexpr int kVWords = D / 16;  // per lane per value row

  // Issue every load of the tile first: K rows g and g+8, V rows 2t, 2t+1, 2t+8, 2t+9.
  uint32_t kw[2][kKWords];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int r = 8 * nt + g;
    const bool ok = base + r < valid_end;
    if constexpr (D == 16) {
      LoadWords<2>(kt + r * D + 4 * t, ok, reinterpret_cast<uint32_t(&)[2]>(kw[nt][0]));
    } else {
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {
        LoadWords<4>(kt + r * D + 32 * j + 8 * t, ok,
                     reinterpret_cast<uint32_t(&)[4]>(kw[nt][4 * j]));
      }
    }
  }
  uint32_t vw[4][kVWords];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int r = 2 * t + (s & 1) + 8 * (s >> 1);
    LoadWords<kVWords>(vt + r * D + (D / 8) * g, base + r < valid_end, vw[s]);
  }

  // S = Q K^T, two n-tiles of 8 positions.
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s[nt][c] = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const uint32_t b0 = kw[nt][2 * j], b1 = kw[nt][2 * j + 1];
      Mma(s[nt], q.hi[j][0], kTwoRows ? q.hi[j][1] : 0u, q.hi[j][2], kTwoRows ? q.hi[j][3] : 0u,
          b0, b1);
      Mma(s[nt], q.lo[j][0], kTwoRows ? q.lo[j][1] : 0u, q.lo[j][2], kTwoRows ? q.lo[j][3] : 0u,
          b0, b1);
    }
  }

  // Mask and online softmax. Element c of n-tile nt: row (c < 2 ? g : g + 8), position
  // base + 8 nt + 2t + (c & 1).
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int pos = base + 8 * nt + 2 * t + (c & 1);
      const int lim = c < 2 ? lim0 : lim1;
      if (pos >= kend || pos > lim) s[nt][c] = -INFINITY;
      mx[c >> 1] = fmaxf(mx[c >> 1], s[nt][c]);
    }
  }
  float base_m[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (r == 1 && !kTwoRows) {
      base_m[1] = 0.f;
      continue;
    }
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(acc.m[r], mx[r]);
    base_m[r] = m_new == -INFINITY ? 0.f : m_new;
    const float corr = exp2f(acc.m[r] - base_m[r]);
    acc.m[r] = m_new;
    acc.l[r] *= corr;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      acc.o[i][2 * r] *= corr;
      acc.o[i][2 * r + 1] *= corr;
    }
  }
  uint32_t phi[4], plo[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float p0 = 0.f, p1 = 0.f;
      if (r == 0 || kTwoRows) {
        p0 = exp2f(s[nt][2 * r] - base_m[r]);
        p1 = exp2f(s[nt][2 * r + 1] - base_m[r]);
        acc.l[r] += p0 + p1;
      }
      // A of P V: reg 0 = row g, k 2t..; reg 1 = row g+8; reg 2 / 3 = the same for k 2t+8...
      SplitBf16(p0, p1, &phi[2 * nt + r], &plo[2 * nt + r]);
    }
  }

  // O += P V. n-tile i, column g is dimension (D/8) g + i, the lane's word i/2 of each V row.
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const uint32_t sel = (i & 1) ? 0x7632u : 0x5410u;
    const uint32_t b0 = __byte_perm(vw[0][i >> 1], vw[1][i >> 1], sel);
    const uint32_t b1 = __byte_perm(vw[2][i >> 1], vw[3][i >> 1], sel);
    Mma(acc.o[i], phi[0], kTwoRows ? phi[1] : 0u, phi[2], kTwoRows ? phi[3] : 0u, b0, b1);
    Mma(acc.o[i], plo[0], kTwoRows ? plo[1] : 0u, plo[2], kTwoRows ? plo[3] : 0u, b0, b1);
  }
}

// Sums each row's l over the lane quad (all four lanes then hold the row total).
template <int D>
__device__ __forceinline__ void ReduceL(WarpAcc<D>& acc) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc.l[r] += __shfl_xor_sync(0xffffffffu, acc.l[r], 1);
    acc.l[r] += __shfl_xor_sync(0xffffffffu, acc.l[r], 2);
  }
}

// Writes rows g / g+8 of o * scale[r] into dst0 / dst1 (f32 rows of D; nullptr skips a row).
template <int D>
__device__ __forceinline__ void StoreRows(const WarpAcc<D>& acc, float scale0, float scale1,
                                          float* dst0, float* dst1) {
  const int t = (threadIdx.x & 31) & 3;
  constexpr int kPer = D / 8;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float* dst = r == 0 ? dst0 : dst1;
    if (dst == nullptr) continue;
    const float sc = r == 0 ? scale0 : scale1;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float* d = dst + kPer * (2 * t + c);
#pragma unroll
      for (int i = 0; i < kPer; i += 2) {
        *reinterpret_cast<float2*>(d + i) =
            make_float2(acc.o[i][2 * r + c] * sc, acc.o[i + 1][2 * r + c] * sc);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode.

__host__ __device__ __forceinline__ int DeviceSplitChunk(int len, int splits, int min_chunk) {
  int c = (len + splits - 1) / splits;
  c = (c + 15) & ~15;
  return c > min_chunk ? c : min_chunk;
}

// Grid (splits, num_kv_heads, batch), kThreads threads. Writes, for each query head of the
// group, o / l of this split to partial_out and log2(l) + m to partial_lse.
template <int D, bool kTwoRows>
__global__ void __launch_bounds__(kThreads) DecodePartialKernel(
    Pool pool, const float* __restrict__ q, const int32_t* __restrict__ seq_lens,
    const int32_t* __restrict__ block_tables, int max_blocks_per_seq, int num_q_heads,
    int group, float qscale, int min_chunk, float* __restrict__ partial_out,
    float* __restrict__ partial_lse) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int splits = gridDim.x;
  const int len = seq_lens[b];
  if (len <= 0) return;
  const int chunk = DeviceSplitChunk(len, splits, min_chunk);
  const int s0 = split * chunk;
  if (s0 >= len) return;
  const int s1 = min(s0 + chunk, len);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const float* qb = q + (static_cast<int64_t>(b) * num_q_heads + kvh * group) * D;
  QFrag<D> qf;
  LoadQ<D>(g < group ? qb + g * D : nullptr, g + 8 < group ? qb + (g + 8) * D : nullptr, qscale,
           t, qf);
  WarpAcc<D> acc;
  InitAcc(acc);
  const int32_t* table = block_tables + static_cast<int64_t>(b) * max_blocks_per_seq;
  for (int pos = s0 + kTile * warp; pos < s1; pos += kTile * kWarps) {
    const int64_t off = TileOffset<D>(pool, table[pos >> pool.block_shift], kvh, pos);
    AttendTile<D, kTwoRows>(qf, pool.k + off, pool.v + off, pos, len, s1, len - 1, len - 1, acc);
  }
  ReduceL(acc);

  // Rows g + 8 only where they exist (16 rows of 256 floats per warp would not fit).
  __shared__ float sm_o[kWarps][kTwoRows ? kRows : kRows / 2][D];
  __shared__ float sm_m[kWarps][kRows];
  __shared__ float sm_l[kWarps][kRows];
  if constexpr (kTwoRows) {
    StoreRows<D>(acc, 1.f, 1.f, &sm_o[warp][g][0], &sm_o[warp][g + 8][0]);
  } else {
    StoreRows<D>(acc, 1.f, 1.f, &sm_o[warp][g][0], nullptr);
  }
  if (t == 0) {
    sm_m[warp][g] = acc.m[0];
    sm_l[warp][g] = acc.l[0];
    sm_m[warp][g + 8] = kTwoRows ? acc.m[1] : -INFINITY;
    sm_l[warp][g + 8] = kTwoRows ? acc.l[1] : 0.f;
  }
  __syncthreads();

  // Warp 0 always has positions (its first tile starts at s0 < len), so m_all is finite.
  for (int idx = threadIdx.x; idx < group * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm_m[w][r]);
    float l_all = 0.f, o_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm_m[w][r] - m_all);
      l_all += sm_l[w][r] * f;
      o_all += sm_o[w][r][d] * f;
    }
    const int64_t row = (static_cast<int64_t>(b) * num_q_heads + kvh * group + r) * splits + split;
    partial_out[row * D + d] = o_all / l_all;
    if (d == 0) partial_lse[row] = m_all + log2f(l_all);
  }
}

// Grid (num_q_heads, batch), kThreads threads: combines the active splits of each head.
template <int D>
__global__ void __launch_bounds__(kThreads) DecodeReduceKernel(
    const float* __restrict__ partial_out, const float* __restrict__ partial_lse,
    const int32_t* __restrict__ seq_lens, int splits, int min_chunk, float* __restrict__ out) {
  const int h = blockIdx.x, b = blockIdx.y, num_q_heads = gridDim.x;
  float* dst = out + (static_cast<int64_t>(b) * num_q_heads + h) * D;
  const int len = seq_lens[b];
  if (len <= 0) {
    for (int d = threadIdx.x; d < D; d += kThreads) dst[d] = 0.f;
    return;
  }
  const int chunk = DeviceSplitChunk(len, splits, min_chunk);
  const int active = (len + chunk - 1) / chunk;
  const int64_t row0 = (static_cast<int64_t>(b) * num_q_heads + h) * splits;

  __shared__ float sm_w[DecodePlan::kMaxSplits];
  __shared__ float sm_red[kWarps];
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < active; s += kThreads) {
    sm_w[s] = partial_lse[row0 + s];
    mx = fmaxf(mx, sm_w[s]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) sm_red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = sm_red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, sm_red[w]);
  __syncthreads();
  float sum = 0.f;
  for (int s = threadIdx.x; s < active; s += kThreads) {
    sm_w[s] = exp2f(sm_w[s] - mx);
    sum += sm_w[s];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) sm_red[threadIdx.x >> 5] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += sm_red[w];
  const float inv = 1.f / sum;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < active; ++s) acc += sm_w[s] * partial_out[(row0 + s) * D + d];
    dst[d] = acc * inv;
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill.

// Grid (ceil(num_tokens * group / 64), num_kv_heads), kThreads threads. Row r of a KV head is
// token r / group, query head kvh * group + r % group.
template <int D>
__global__ void __launch_bounds__(kThreads) PrefillKernel(
    Pool pool, const float* __restrict__ q, float* __restrict__ out,
    const int32_t* __restrict__ table, int num_tokens, int start, int num_q_heads, int group,
    float qscale) {
  const int kvh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = (blockIdx.x * kWarps + warp) * kRows;
  const int rows = num_tokens * group;
  if (row0 >= rows) return;  // no block-wide synchronization follows

  const float* qrow[2];
  float* orow[2];
  int lim[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row < rows) {
      const int tok = row / group, head = kvh * group + row % group;
      const int64_t off = (static_cast<int64_t>(tok) * num_q_heads + head) * D;
      qrow[r] = q + off;
      orow[r] = out + off;
      lim[r] = start + tok;
    } else {
      qrow[r] = nullptr;
      orow[r] = nullptr;
      lim[r] = -1;
    }
  }
  QFrag<D> qf;
  LoadQ<D>(qrow[0], qrow[1], qscale, t, qf);
  WarpAcc<D> acc;
  InitAcc(acc);
  const int end = start + num_tokens;
  const int last = start + min(num_tokens - 1, (row0 + kRows - 1) / group);  // warp's last pos
  for (int pos = 0; pos <= last; pos += kTile) {
    const int64_t off = TileOffset<D>(pool, table[pos >> pool.block_shift], kvh, pos);
    AttendTile<D, true>(qf, pool.k + off, pool.v + off, pos, end, end, lim[0], lim[1], acc);
  }
  ReduceL(acc);
  StoreRows<D>(acc, 1.f / acc.l[0], 1.f / acc.l[1], orow[0], orow[1]);
}

// ---------------------------------------------------------------------------------------------
// Append.

// One thread per 8 elements of one token's K or V head row: two float4 loads, one 16-byte store.
// Grid covers 2 * num_tokens * num_kv_heads * head_dim / 8 threads.
__global__ void AppendKvKernel(Pool pool, uint16_t* __restrict__ k_pool,
                               uint16_t* __restrict__ v_pool, const float* __restrict__ k,
                               const float* __restrict__ v, int num_tokens, int head_dim,
                               const int32_t* __restrict__ positions,
                               const int32_t* __restrict__ seq_ids,
                               const int32_t* __restrict__ block_tables, int max_blocks_per_seq) {
  const int chunks = head_dim / 8;
  const int64_t per_tensor = static_cast<int64_t>(num_tokens) * pool.num_kv_heads * chunks;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= 2 * per_tensor) return;
  const bool is_v = i >= per_tensor;
  const int64_t j = is_v ? i - per_tensor : i;
  const int c = static_cast<int>(j % chunks);
  const int h = static_cast<int>((j / chunks) % pool.num_kv_heads);
  const int tok = static_cast<int>(j / chunks / pool.num_kv_heads);
  const int pos = positions[tok];
  if (pos < 0) return;
  const int seq = seq_ids != nullptr ? seq_ids[tok] : 0;
  const int block = block_tables[static_cast<int64_t>(seq) * max_blocks_per_seq +
                                 (pos >> pool.block_shift)];
  const int bs_mask = (1 << pool.block_shift) - 1;
  const int64_t dst = (((static_cast<int64_t>(block) * pool.num_kv_heads + h)
                        << pool.block_shift) |
                       (pos & bs_mask)) *
                          head_dim +
                      8 * c;
  const float* src = (is_v ? v : k) + (static_cast<int64_t>(tok) * pool.num_kv_heads + h) *
                                          head_dim +
                     8 * c;
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  uint4 w;
  w.x = AsU32(__floats2bfloat162_rn(a.x, a.y));
  w.y = AsU32(__floats2bfloat162_rn(a.z, a.w));
  w.z = AsU32(__floats2bfloat162_rn(b.x, b.y));
  w.w = AsU32(__floats2bfloat162_rn(b.z, b.w));
  *reinterpret_cast<uint4*>((is_v ? v_pool : k_pool) + dst) = w;
}

// ---------------------------------------------------------------------------------------------
// Launchers.

Pool MakePool(const PagedKvLayer& l) {
  return Pool{l.k, l.v, l.num_kv_heads, Log2(l.block_size)};
}

float QScale(int head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)) * kLog2e; }

// Query heads per KV head that one warp's 16 rows serve; head_dim 256 takes 8 (rows g alone),
// since the decode kernel's merge of 16 rows of 256 floats per warp would not fit in shared
// memory.
int MaxGroup(int head_dim) { return head_dim > 128 ? kRows / 2 : kRows; }

absl::Status CheckGroup(const PagedKvLayer& layer, int num_q_heads) {
  const int max_group = MaxGroup(layer.head_dim);
  if (num_q_heads <= 0 || num_q_heads % layer.num_kv_heads != 0 ||
      num_q_heads / layer.num_kv_heads > max_group) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged attention: num_q_heads ", num_q_heads, " must be a multiple of num_kv_heads ",
        layer.num_kv_heads, " by 1 to ", max_group, " (head_dim ", layer.head_dim, ")"));
  }
  return absl::OkStatus();
}

absl::Status LastLaunchError() {
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchDecodeD(const Pool& pool, const DecodeArgs& a, const DecodePlan& plan,
                           const DecodeWorkspace& ws, int group, cudaStream_t stream) {
  const int splits = plan.SplitsForBatch(a.batch);
  const dim3 grid(splits, pool.num_kv_heads, a.batch);
  bool two_rows = false;
  if constexpr (D <= 128) two_rows = group > 8;  // CheckGroup keeps head_dim 256 to 8
  if (two_rows) {
    if constexpr (D <= 128) {
      DecodePartialKernel<D, true><<<grid, kThreads, 0, stream>>>(
          pool, a.q, a.seq_lens, a.block_tables, a.max_blocks_per_seq, a.num_q_heads, group,
          QScale(D), plan.min_chunk, ws.partial_out(), ws.partial_lse());
    }
  } else {
    DecodePartialKernel<D, false><<<grid, kThreads, 0, stream>>>(
        pool, a.q, a.seq_lens, a.block_tables, a.max_blocks_per_seq, a.num_q_heads, group,
        QScale(D), plan.min_chunk, ws.partial_out(), ws.partial_lse());
  }
  RETURN_IF_ERROR(LastLaunchError());
  DecodeReduceKernel<D><<<dim3(a.num_q_heads, a.batch), kThreads, 0, stream>>>(
      ws.partial_out(), ws.partial_lse(), a.seq_lens, splits, plan.min_chunk, a.out);
  return LastLaunchError();
}

template <int D>
absl::Status LaunchPrefillD(const Pool& pool, const PrefillArgs& a, int group,
                            cudaStream_t stream) {
  const int rows = a.num_tokens * group;
  const dim3 grid((rows + kWarps * kRows - 1) / (kWarps * kRows), pool.num_kv_heads);
  PrefillKernel<D><<<grid, kThreads, 0, stream>>>(pool, a.q, a.out, a.block_table, a.num_tokens,
                                                  a.start, a.num_q_heads, group, QScale(D));
  return LastLaunchError();
}

}  // namespace

absl::Status LaunchAppendKv(const PagedKvLayer& layer, const AppendKvArgs& a,
                            CUstream_st* stream) {
  RETURN_IF_ERROR(ValidateLayer(layer));
  if (a.num_tokens < 0 || (a.num_tokens > 0 && (a.k == nullptr || a.v == nullptr ||
                                                a.positions == nullptr ||
                                                a.block_tables == nullptr))) {
    return absl::InvalidArgumentError("append_kv: missing inputs");
  }
  if (a.num_tokens == 0) return absl::OkStatus();
  const int64_t threads = 2ll * a.num_tokens * layer.num_kv_heads * (layer.head_dim / 8);
  constexpr int kBlock = 256;
  AppendKvKernel<<<static_cast<unsigned>((threads + kBlock - 1) / kBlock), kBlock, 0, stream>>>(
      MakePool(layer), layer.k, layer.v, a.k, a.v, a.num_tokens, layer.head_dim, a.positions,
      a.seq_ids, a.block_tables, a.max_blocks_per_seq);
  return LastLaunchError();
}

absl::Status LaunchDecodeAttention(const PagedKvLayer& layer, const DecodeArgs& a,
                                   const DecodeWorkspace& ws, CUstream_st* stream) {
  RETURN_IF_ERROR(ValidateLayer(layer));
  RETURN_IF_ERROR(CheckGroup(layer, a.num_q_heads));
  const DecodePlan& plan = ws.plan();
  if (plan.head_dim != layer.head_dim || plan.num_q_heads != a.num_q_heads ||
      plan.num_kv_heads != layer.num_kv_heads) {
    return absl::InvalidArgumentError("decode attention: workspace made for other heads");
  }
  if (a.batch <= 0 || a.batch > plan.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("decode attention: batch ", a.batch,
                                                   " outside [1, ", plan.max_batch, "]"));
  }
  if (a.q == nullptr || a.out == nullptr || a.seq_lens == nullptr || a.block_tables == nullptr ||
      a.max_blocks_per_seq <= 0) {
    return absl::InvalidArgumentError("decode attention: missing inputs");
  }
  const Pool pool = MakePool(layer);
  const int group = a.num_q_heads / layer.num_kv_heads;
  switch (layer.head_dim) {
    case 16:
      return LaunchDecodeD<16>(pool, a, plan, ws, group, stream);
    case 32:
      return LaunchDecodeD<32>(pool, a, plan, ws, group, stream);
    case 64:
      return LaunchDecodeD<64>(pool, a, plan, ws, group, stream);
    case 128:
      return LaunchDecodeD<128>(pool, a, plan, ws, group, stream);
    default:  // 256 (ValidateLayer)
      return LaunchDecodeD<256>(pool, a, plan, ws, group, stream);
  }
}

absl::Status LaunchPrefillAttention(const PagedKvLayer& layer, const PrefillArgs& a,
                                    CUstream_st* stream) {
  RETURN_IF_ERROR(ValidateLayer(layer));
  RETURN_IF_ERROR(CheckGroup(layer, a.num_q_heads));
  if (a.num_tokens < 0 || a.start < 0) {
    return absl::InvalidArgumentError("prefill attention: negative num_tokens or start");
  }
  if (a.num_tokens == 0) return absl::OkStatus();
  if (a.q == nullptr || a.out == nullptr || a.block_table == nullptr) {
    return absl::InvalidArgumentError("prefill attention: missing inputs");
  }
  const Pool pool = MakePool(layer);
  const int group = a.num_q_heads / layer.num_kv_heads;
  switch (layer.head_dim) {
    case 16:
      return LaunchPrefillD<16>(pool, a, group, stream);
    case 32:
      return LaunchPrefillD<32>(pool, a, group, stream);
    case 64:
      return LaunchPrefillD<64>(pool, a, group, stream);
    case 128:
      return LaunchPrefillD<128>(pool, a, group, stream);
    default:  // 256 (ValidateLayer)
      return LaunchPrefillD<256>(pool, a, group, stream);
  }
}

}  // namespace moe::engine::gpu
