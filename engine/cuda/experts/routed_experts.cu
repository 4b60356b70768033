// Routed-expert kernels and ExpertWorkspace: see routed_experts.h.
//
// Every weight pass is a set of warps, each dotting a few "row blocks" of an expert (bf16 and
// fp8: one row; q4_0 and nvfp4: one 16-row panel) with up to TC activation vectors staged in
// shared memory, over a strided subset of "steps" along the contraction dimension (bf16: 256
// columns, one 16-byte load per lane; fp8: 512 columns, one 16-byte load of codes and one f32
// block scale per lane; q4_0 and nvfp4: one 64-column group of a panel, one 16-byte load of
// codes and one 8-byte (q4_0) or 4-byte (nvfp4) load of scales per lane). Each lane keeps f32
// partial sums for its rows and tokens; a warp
// reduction (and, where several warps split a row, a reduction through shared memory in warp
// order) finishes them. All loads of a batch of U steps are issued before any arithmetic, so a
// warp keeps U * (row blocks) 16-byte loads in flight.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/cuda/experts/q4_panels.h"
#include "engine/cuda/experts/routed_experts.h"

namespace moe::engine::gpu {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// What the kernels read and write; passed by value.
struct Args {
  const uint8_t* gate_up;
  uint64_t gate_up_pitch;
  const uint8_t* down;
  uint64_t down_pitch;
  const uint8_t* gate_up_scales;  // fp8_block
  uint64_t gate_up_scales_pitch;
  const uint8_t* down_scales;
  uint64_t down_scales_pitch;
  const uint8_t* gate_global;  // nvfp4
  uint64_t gate_global_pitch;
  const uint8_t* up_global;
  uint64_t up_global_pitch;
  const uint8_t* down_global;
  uint64_t down_global_pitch;
  int32_t num_slots;
  int32_t hidden;  // H
  int32_t inter;   // I
  int32_t top_k;
  int32_t num_routes;  // T * k
  const float* x;             // [T, H]
  const int32_t* slot_ids;    // [T * k]
  const float* route_weights; // [T * k]
  float* y;                   // [T, H]
  float* h;                   // [T * k, I]: w * silu(gate) * up per route (nvfp4: times
                              // down's global scale)
  float* route_out;           // [T * k, H]: down(h) per route (kBySlot)
  const int32_t* order;       // [T * k] routes sorted by slot (kBySlot)
  const int32_t* group_slot;  // [groups]
  const int32_t* group_start; // [groups + 1] into order
  const int32_t* num_groups;  // [1]
  bool by_slot;
};

__device__ __forceinline__ int32_t ValidSlot(const Args& a, int32_t s) {
  return s >= 0 && s < a.num_slots ? s : -1;
}

// One slot's routes: order[start, start + count) in kBySlot, route `start` alone in kPerRoute.
struct Group {
  int32_t slot;  // -1: nothing to do
  int32_t start;
  int32_t count;
};

__device__ __forceinline__ int NumGroups(const Args& a) {
  return a.by_slot ? *a.num_groups : a.num_routes;
}

__device__ __forceinline__ Group GetGroup(const Args& a, int g) {
  if (!a.by_slot) return {ValidSlot(a, a.slot_ids[g]), g, 1};
  const int32_t start = a.group_start[g];
  return {a.group_slot[g], start, a.group_start[g + 1] - start};
}

__device__ __forceinline__ int RouteOf(const Args& a, const Group& gr, int i) {
  return a.by_slot ? a.order[gr.start + i] : gr.start;
}

// Activation vectors of length K in shared memory, as P planes of K/(4P) float4 each:
// plane p holds v[4Pm + 4p .. 4Pm + 4p + 3] at m. With P = 2 (A[m] = v[8m .. 8m+3],
// B[m] = v[8m+4 .. 8m+7]) a warp's lanes load the 8 columns that match their weights, with P = 4
// the 16 columns of fp8's 16 bytes, without bank conflicts. Vector i starts at float4 i * K/4.
// Copies src + row(i) * K for i < n (row(i) < 0: left as it is, never read).
template <int P, class RowFn>
__device__ void StageVectors(float4* dst, const float* src, int K, int n, RowFn row) {
  const int q = K / 4;  // float4 per vector
  for (int e = threadIdx.x; e < n * q; e += blockDim.x) {
    const int i = e / q, c = e - i * q;
    const int r = row(i);
    if (r < 0) continue;
    const float4 v = reinterpret_cast<const float4*>(src + static_cast<int64_t>(r) * K)[c];
    dst[i * q + (c % P) * (q / P) + c / P] = v;
  }
}

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

// ---------------------------------------------------------------------------------------------
// Formats. Each gives: kRowsPerBlock (rows of a row block), kLaneRows (rows whose partial sums
// one lane holds), kPlanes (activation planes, see StageVectors), kGlobalScales (per-tensor
// scales of gate, up and down), Row / RowAt (where row block rb of a slot's gate_up or down
// matrix lives), Steps(K), Chunk (the chunk m of 4 * kPlanes columns a lane's step covers, -1
// past the end), Load, Fma (acc += weights . activations for the TC vectors), Reduce (sum the
// lanes), Holds / RowOf (which lanes hold which rows after Reduce).

// The slot's row of a gate_up (down = false) or down bank.
__device__ __forceinline__ const uint8_t* SlotRow(const Args& a, bool down, int32_t slot) {
  return down ? a.down + static_cast<uint64_t>(slot) * a.down_pitch
              : a.gate_up + static_cast<uint64_t>(slot) * a.gate_up_pitch;
}

// A format whose rows are found by their bytes alone (scales, if any, inside).
template <class F>
struct PlainRows {
  using Row = const uint8_t*;
  __device__ static Row RowAt(const Args& a, bool down, int32_t slot, int rb, int K) {
    return SlotRow(a, down, slot) + static_cast<uint64_t>(rb) * F::RowBlockBytes(K);
  }
};

struct Bf16Format : PlainRows<Bf16Format> {
  static constexpr int kRowsPerBlock = 1;
  static constexpr int kLaneRows = 1;
  static constexpr int kPlanes = 2;
  static constexpr bool kGlobalScales = false;
  struct Frag {
    uint4 w;  // 8 bf16 of columns 8m .. 8m+7
  };
  __device__ static uint64_t RowBlockBytes(int K) { return static_cast<uint64_t>(K) * 2; }
  __device__ static int Steps(int K) { return (K / 8 + 31) / 32; }
  __device__ static int Chunk(int K, int s, int lane) {
    const int m = s * 32 + lane;
    return m < K / 8 ? m : -1;
  }
  __device__ static Frag Load(const uint8_t* row, int /*K*/, int s, int lane) {
    return {__ldcs(reinterpret_cast<const uint4*>(row) + s * 32 + lane)};
  }
  __device__ static float Lo(uint32_t w) { return __uint_as_float(w << 16); }
  __device__ static float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  template <int TC>
  __device__ static void Fma(const Frag& f, const float4* act, int stride, int M, int m, int n,
                             float (&acc)[1][TC]) {
    const float w0 = Lo(f.w.x), w1 = Hi(f.w.x), w2 = Lo(f.w.y), w3 = Hi(f.w.y);
    const float w4 = Lo(f.w.z), w5 = Hi(f.w.z), w6 = Lo(f.w.w), w7 = Hi(f.w.w);
#pragma unroll
    for (int t = 0; t < TC; ++t) {
      if (t < n) {
        const float4 A = act[t * stride + m], B = act[t * stride + M + m];
        float s = w0 * A.x;
        s = fmaf(w1, A.y, s);
        s = fmaf(w2, A.z, s);
        s = fmaf(w3, A.w, s);
        s = fmaf(w4, B.x, s);
        s = fmaf(w5, B.y, s);
        s = fmaf(w6, B.z, s);
        s = fmaf(w7, B.w, s);
        acc[0][t] += s;
      }
    }
  }
  __device__ static float Reduce(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
    return v;
  }
  __device__ static bool Holds(int lane) { return lane == 0; }
  __device__ static int RowOf(int /*lane*/, int /*r*/) { return 0; }
};

// q4_0 in cpu_moe's panels: addressing in q4_panels.h. A step is one group of two 32-column
// blocks; each lane reads one word of codes for each of 4 rows, and their 4 fp16 scales.
struct Q4Format : PlainRows<Q4Format> {
  static constexpr int kRowsPerBlock = q4_panels::kRows;
  static constexpr int kLaneRows = 4;
  static constexpr int kPlanes = 2;
  static constexpr bool kGlobalScales = false;
  struct Frag {
    uint4 w;  // rows FirstRow .. +3, 8 codes each
    uint2 d;  // their fp16 scales
  };
  __device__ static uint64_t RowBlockBytes(int K) { return q4_panels::PanelBytes(K); }
  __device__ static int Steps(int K) { return q4_panels::Steps(K); }
  // FirstColumn / 8: the lane's 8 columns are one chunk of the activation planes.
  __device__ static int Chunk(int K, int s, int lane) {
    return q4_panels::Block(s, lane) < K / 32 ? q4_panels::FirstColumn(s, lane) / 8 : -1;
  }
  __device__ static Frag Load(const uint8_t* panel, int K, int s, int lane) {
    Frag f;
    f.w = __ldcs(reinterpret_cast<const uint4*>(panel + q4_panels::CodesOffset(s, lane)));
    f.d = __ldcs(reinterpret_cast<const uint2*>(panel + q4_panels::ScalesOffset(K, s, lane)));
    return f;
  }
  // The 8 codes of one row's word as floats q - 8, exactly: the code goes into the low mantissa
  // byte of 2^23, and 2^23 + 8 is subtracted.
  __device__ static void Decode(uint32_t word, float (&c)[8]) {
    const uint32_t lo = word & 0x0f0f0f0fu, hi = (word >> 4) & 0x0f0f0f0fu;
    constexpr float kBias = 8388616.0f;  // 2^23 + 8
    c[0] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7440)) - kBias;
    c[1] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7441)) - kBias;
    c[2] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7442)) - kBias;
    c[3] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7443)) - kBias;
    c[4] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7440)) - kBias;
    c[5] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7441)) - kBias;
    c[6] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7442)) - kBias;
    c[7] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7443)) - kBias;
  }
  template <int TC>
  __device__ static void Fma(const Frag& f, const float4* act, int stride, int M, int m, int n,
                             float (&acc)[4][TC]) {
    __half2 d01, d23;
    memcpy(&d01, &f.d.x, 4);
    memcpy(&d23, &f.d.y, 4);
    const float2 s01 = __half22float2(d01), s23 = __half22float2(d23);
    const float d[4] = {s01.x, s01.y, s23.x, s23.y};
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
    float4 A[TC], B[TC];
#pragma unroll
    for (int t = 0; t < TC; ++t) {
      if (t < n) {
        A[t] = act[t * stride + m];
        B[t] = act[t * stride + M + m];
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float c[8];
      Decode(words[r], c);
#pragma unroll
      for (int t = 0; t < TC; ++t) {
        if (t < n) {
          float s = c[0] * A[t].x;
          s = fmaf(c[1], A[t].y, s);
          s = fmaf(c[2], A[t].z, s);
          s = fmaf(c[3], A[t].w, s);
          s = fmaf(c[4], B[t].x, s);
          s = fmaf(c[5], B[t].y, s);
          s = fmaf(c[6], B[t].z, s);
          s = fmaf(c[7], B[t].w, s);
          acc[r][t] = fmaf(d[r], s, acc[r][t]);
        }
      }
    }
  }
  // Lanes with the same q (l & 3) hold the same rows.
  __device__ static float Reduce(float v) {
    v += __shfl_xor_sync(kFullMask, v, 4);
    v += __shfl_xor_sync(kFullMask, v, 8);
    v += __shfl_xor_sync(kFullMask, v, 16);
    return v;
  }
  __device__ static bool Holds(int lane) { return lane < 4; }
  __device__ static int RowOf(int lane, int r) { return q4_panels::FirstRow(lane) + r; }
};

// Two e4m3 bytes (the low 16 bits of v) as floats, exactly: every e4m3 value is an fp16 value
// (sm_89+: one cvt for both).
__device__ __forceinline__ float2 E4m3x2ToFloat2(uint32_t v) {
  const __half2_raw raw =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(raw));
}

// fp8_block: e4m3 rows (row-major) and f32 scales per 128x128 block in a bank of their own.
// A step is 512 columns: lane l reads 16 codes (columns 16m .. 16m+15, m = 32s + l, inside one
// 128-column block) and that block's scale for the row; the 16 products are summed, then scaled.
struct Fp8Format {
  static constexpr int kRowsPerBlock = 1;
  static constexpr int kLaneRows = 1;
  static constexpr int kPlanes = 4;
  static constexpr bool kGlobalScales = false;
  struct Row {
    const uint8_t* w;     // the row's K codes
    const float* scales;  // its 128-row block's ceil(K / 128) scales
  };
  struct Frag {
    uint4 w;  // 16 e4m3 of columns 16m .. 16m+15
    float d;  // their block scale
  };
  __device__ static Row RowAt(const Args& a, bool down, int32_t slot, int rb, int K) {
    const uint8_t* sc =
        down ? a.down_scales + static_cast<uint64_t>(slot) * a.down_scales_pitch
             : a.gate_up_scales + static_cast<uint64_t>(slot) * a.gate_up_scales_pitch;
    const int scols = (K + 127) / 128;
    return {SlotRow(a, down, slot) + static_cast<uint64_t>(rb) * K,
            reinterpret_cast<const float*>(sc) + (rb / 128) * scols};
  }
  __device__ static int Steps(int K) { return (K / 16 + 31) / 32; }
  __device__ static int Chunk(int K, int s, int lane) {
    const int m = s * 32 + lane;
    return m < K / 16 ? m : -1;
  }
  __device__ static Frag Load(const Row& row, int /*K*/, int s, int lane) {
    const int m = s * 32 + lane;
    return {__ldcs(reinterpret_cast<const uint4*>(row.w) + m), __ldg(row.scales + (m >> 3))};
  }
  template <int TC>
  __device__ static void Fma(const Frag& f, const float4* act, int stride, int M, int m, int n,
                             float (&acc)[1][TC]) {
    float c[16];
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 lo = E4m3x2ToFloat2(words[i]), hi = E4m3x2ToFloat2(words[i] >> 16);
      c[4 * i] = lo.x;
      c[4 * i + 1] = lo.y;
      c[4 * i + 2] = hi.x;
      c[4 * i + 3] = hi.y;
    }
#pragma unroll
    for (int t = 0; t < TC; ++t) {
      if (t < n) {
        const float4* v = act + t * stride + m;
        const float4 p[4] = {v[0], v[M], v[2 * M], v[3 * M]};
        float s = c[0] * p[0].x;
        s = fmaf(c[1], p[0].y, s);
        s = fmaf(c[2], p[0].z, s);
        s = fmaf(c[3], p[0].w, s);
#pragma unroll
        for (int q = 1; q < 4; ++q) {
          s = fmaf(c[4 * q], p[q].x, s);
          s = fmaf(c[4 * q + 1], p[q].y, s);
          s = fmaf(c[4 * q + 2], p[q].z, s);
          s = fmaf(c[4 * q + 3], p[q].w, s);
        }
        acc[0][t] = fmaf(f.d, s, acc[0][t]);
      }
    }
  }
  __device__ static float Reduce(float v) { return Bf16Format::Reduce(v); }
  __device__ static bool Holds(int lane) { return lane == 0; }
  __device__ static int RowOf(int /*lane*/, int /*r*/) { return 0; }
};

// nvfp4 in cpu_moe's panels: q4_0's addressing (q4_panels.h) with e2m1 codes and, per lane and
// step, 4 e4m3 scales (one per row: the lane's 8 columns lie in one 16-column scale group).
// Codes become fp16 bits of value * 2^-14 (q4_panels::E2m1PairAsHalf2Bits), times 2^14 in fp16
// (exact: fp16 keeps its subnormals), then f32. The per-tensor global scales are applied by the
// gate_up pass (GateUpKernel).
struct Nvfp4Format : PlainRows<Nvfp4Format> {
  static constexpr int kRowsPerBlock = q4_panels::kRows;
  static constexpr int kLaneRows = 4;
  static constexpr int kPlanes = 2;
  static constexpr bool kGlobalScales = true;
  struct Frag {
    uint4 w;     // rows FirstRow .. +3, 8 codes each
    uint32_t d;  // their e4m3 scales
  };
  __device__ static uint64_t RowBlockBytes(int K) { return q4_panels::PanelBytes(K); }
  __device__ static int Steps(int K) { return q4_panels::Steps(K); }
  __device__ static int Chunk(int K, int s, int lane) { return Q4Format::Chunk(K, s, lane); }
  __device__ static Frag Load(const uint8_t* panel, int K, int s, int lane) {
    Frag f;
    f.w = __ldcs(reinterpret_cast<const uint4*>(panel + q4_panels::CodesOffset(s, lane)));
    f.d = __ldcs(
        reinterpret_cast<const unsigned int*>(panel + q4_panels::Nvfp4ScalesOffset(K, s, lane)));
    return f;
  }
  __device__ static float2 Pair(uint32_t word, int shift) {
    const uint32_t bits = q4_panels::E2m1PairAsHalf2Bits(word, shift);
    __half2 h;
    memcpy(&h, &bits, 4);
    return __half22float2(__hmul2(h, __float2half2_rn(16384.0f)));
  }
  // The 8 codes of one row's word as floats in column order.
  __device__ static void Decode(uint32_t word, float (&c)[8]) {
    float2 p = Pair(word, 0);
    c[0] = p.x;
    c[2] = p.y;
    p = Pair(word, 8);
    c[1] = p.x;
    c[3] = p.y;
    p = Pair(word, 4);
    c[4] = p.x;
    c[6] = p.y;
    p = Pair(word, 12);
    c[5] = p.x;
    c[7] = p.y;
  }
  template <int TC>
  __device__ static void Fma(const Frag& f, const float4* act, int stride, int M, int m, int n,
                             float (&acc)[4][TC]) {
    const float2 s01 = E4m3x2ToFloat2(f.d), s23 = E4m3x2ToFloat2(f.d >> 16);
    const float d[4] = {s01.x, s01.y, s23.x, s23.y};
    const uint32_t words[4] = {f.w.x, f.w.y, f.w.z, f.w.w};
    float4 A[TC], B[TC];
#pragma unroll
    for (int t = 0; t < TC; ++t) {
      if (t < n) {
        A[t] = act[t * stride + m];
        B[t] = act[t * stride + M + m];
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float c[8];
      Decode(words[r], c);
#pragma unroll
      for (int t = 0; t < TC; ++t) {
        if (t < n) {
          float s = c[0] * A[t].x;
          s = fmaf(c[1], A[t].y, s);
          s = fmaf(c[2], A[t].z, s);
          s = fmaf(c[3], A[t].w, s);
          s = fmaf(c[4], B[t].x, s);
          s = fmaf(c[5], B[t].y, s);
          s = fmaf(c[6], B[t].z, s);
          s = fmaf(c[7], B[t].w, s);
          acc[r][t] = fmaf(d[r], s, acc[r][t]);
        }
      }
    }
  }
  __device__ static float Reduce(float v) { return Q4Format::Reduce(v); }
  __device__ static bool Holds(int lane) { return lane < 4; }
  __device__ static int RowOf(int lane, int r) { return q4_panels::FirstRow(lane) + r; }
};

// acc[r] += row block r . activations over steps s_begin, s_begin + s_stride, ... (U per batch).
template <class F, int NR, int TC, int U>
__device__ __forceinline__ void WarpDot(const typename F::Row (&rows)[NR], int K, int s_begin,
                                        int s_stride, const float4* act, int stride, int n,
                                        float (&acc)[NR][F::kLaneRows][TC]) {
  const int lane = threadIdx.x & 31;
  const int S = F::Steps(K), M = K / (4 * F::kPlanes);
  for (int s0 = s_begin; s0 < S; s0 += U * s_stride) {
    typename F::Frag f[U][NR];
    int m[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * s_stride;
      m[u] = s < S ? F::Chunk(K, s, lane) : -1;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        f[u][r] = m[u] >= 0 ? F::Load(rows[r], K, s, lane) : typename F::Frag{};
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (m[u] < 0) continue;
#pragma unroll
      for (int r = 0; r < NR; ++r) F::template Fma<TC>(f[u][r], act, stride, M, m[u], n, acc[r]);
    }
  }
}

template <class F, int NR, int TC>
__device__ __forceinline__ void WarpReduce(float (&acc)[NR][F::kLaneRows][TC]) {
#pragma unroll
  for (int r = 0; r < NR; ++r) {
#pragma unroll
    for (int lr = 0; lr < F::kLaneRows; ++lr) {
#pragma unroll
      for (int t = 0; t < TC; ++t) acc[r][lr][t] = F::Reduce(acc[r][lr][t]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 1: h[route, i] = w * silu(gate_i . x) * (up_i . x); nvfp4:
// (w * down_global) * silu(gate_global * (gate_i . x)) * (up_global * (up_i . x)).
// Grid (ceil(I / (UNITS * rows per block)), groups); block UNITS * KS warps. Warp w dots gate row
// block blockIdx.x * UNITS + w / KS and the matching up row block over steps w % KS, + KS, ...
// Shared: x for TC tokens, then KS > 1's partial sums [KS][UNITS][2][rows per block][TC].
template <class F, int TC, int UNITS, int KS, int U>
__global__ void __launch_bounds__(32 * UNITS * KS) GateUpKernel(Args a) {
  extern __shared__ float4 smem[];
  constexpr int RPB = F::kRowsPerBlock;
  const int H = a.hidden, I = a.inter;
  float4* xs = smem;
  float* red = reinterpret_cast<float*>(smem + TC * (H / 4));
  __shared__ int32_t routes[TC];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int unit = warp / KS, ks = warp % KS;
  const int nrb = I / RPB;
  const int rb_raw = blockIdx.x * UNITS + unit;
  const bool active = rb_raw < nrb;
  const int rb = active ? rb_raw : nrb - 1;  // idle warps still take part in the block's syncs
  const int num_groups = NumGroups(a);
  for (int g = blockIdx.y; g < num_groups; g += gridDim.y) {
    const Group gr = GetGroup(a, g);
    if (gr.slot < 0) continue;  // the same for the whole block
    const typename F::Row rows[2] = {F::RowAt(a, false, gr.slot, rb, H),
                                     F::RowAt(a, false, gr.slot, rb + nrb, H)};
    for (int c0 = 0; c0 < gr.count; c0 += TC) {
      const int n = min(TC, gr.count - c0);
      __syncthreads();  // the previous chunk is done with routes, xs and red
      if (threadIdx.x < n) routes[threadIdx.x] = RouteOf(a, gr, c0 + threadIdx.x);
      __syncthreads();
      StageVectors<F::kPlanes>(xs, a.x, H, n, [&](int i) { return routes[i] / a.top_k; });
      __syncthreads();
      float acc[2][F::kLaneRows][TC] = {};
      WarpDot<F, 2, TC, U>(rows, H, ks, KS, xs, H / 4, n, acc);
      WarpReduce<F, 2, TC>(acc);
      if constexpr (KS > 1) {
        if (F::Holds(lane)) {
#pragma unroll
          for (int p = 0; p < 2; ++p) {
#pragma unroll
            for (int lr = 0; lr < F::kLaneRows; ++lr) {
#pragma unroll
              for (int t = 0; t < TC; ++t) {
                red[(((ks * UNITS + unit) * 2 + p) * RPB + F::RowOf(lane, lr)) * TC + t] =
                    acc[p][lr][t];
              }
            }
          }
        }
        __syncthreads();
        if (ks == 0 && F::Holds(lane)) {
#pragma unroll
          for (int p = 0; p < 2; ++p) {
#pragma unroll
            for (int lr = 0; lr < F::kLaneRows; ++lr) {
#pragma unroll
              for (int t = 0; t < TC; ++t) {
                float sum = 0.0f;
                for (int k2 = 0; k2 < KS; ++k2) {
                  sum += red[(((k2 * UNITS + unit) * 2 + p) * RPB + F::RowOf(lane, lr)) * TC + t];
                }
                acc[p][lr][t] = sum;
              }
            }
          }
        }
      }
      if (active && ks == 0 && F::Holds(lane)) {
        float gate_g = 1.0f, up_g = 1.0f, down_g = 1.0f;
        if constexpr (F::kGlobalScales) {
          const uint64_t s = static_cast<uint64_t>(gr.slot);
          gate_g = __ldg(reinterpret_cast<const float*>(a.gate_global + s * a.gate_global_pitch));
          up_g = __ldg(reinterpret_cast<const float*>(a.up_global + s * a.up_global_pitch));
          down_g = __ldg(reinterpret_cast<const float*>(a.down_global + s * a.down_global_pitch));
        }
#pragma unroll
        for (int t = 0; t < TC; ++t) {
          if (t < n) {
            const int route = routes[t];
            const float w = a.route_weights[route];
#pragma unroll
            for (int lr = 0; lr < F::kLaneRows; ++lr) {
              const int row = rb * RPB + F::RowOf(lane, lr);
              float hv;
              if constexpr (F::kGlobalScales) {
                hv = (w * down_g) * Silu(gate_g * acc[0][lr][t]) * (up_g * acc[1][lr][t]);
              } else {
                hv = w * Silu(acc[0][lr][t]) * acc[1][lr][t];
              }
              a.h[static_cast<int64_t>(route) * I + row] = hv;
            }
          }
        }
      }
    }
  }
}

// Pass 2 per slot: route_out[route, row] = down_row . h[route] for the slot's routes.
// Grid (ceil(H / (UNITS * NR * rows per block)), groups); block UNITS warps, each NR
// consecutive row blocks over every step. Shared: h for TC routes.
template <class F, int TC, int UNITS, int NR, int U>
__global__ void __launch_bounds__(32 * UNITS) DownBySlotKernel(Args a) {
  extern __shared__ float4 smem[];
  constexpr int RPB = F::kRowsPerBlock;
  const int H = a.hidden, I = a.inter;
  __shared__ int32_t routes[TC];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nrb = H / RPB;
  const int rb0 = (blockIdx.x * UNITS + warp) * NR;
  const int num_groups = NumGroups(a);
  for (int g = blockIdx.y; g < num_groups; g += gridDim.y) {
    const Group gr = GetGroup(a, g);
    if (gr.slot < 0) continue;
    typename F::Row rows[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) rows[r] = F::RowAt(a, true, gr.slot, min(rb0 + r, nrb - 1), I);
    for (int c0 = 0; c0 < gr.count; c0 += TC) {
      const int n = min(TC, gr.count - c0);
      __syncthreads();
      if (threadIdx.x < n) routes[threadIdx.x] = RouteOf(a, gr, c0 + threadIdx.x);
      __syncthreads();
      StageVectors<F::kPlanes>(smem, a.h, I, n, [&](int i) { return routes[i]; });
      __syncthreads();
      float acc[NR][F::kLaneRows][TC] = {};
      WarpDot<F, NR, TC, U>(rows, I, 0, 1, smem, I / 4, n, acc);
      WarpReduce<F, NR, TC>(acc);
      if (F::Holds(lane)) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          if (rb0 + r >= nrb) continue;
#pragma unroll
          for (int t = 0; t < TC; ++t) {
            if (t < n) {
#pragma unroll
              for (int lr = 0; lr < F::kLaneRows; ++lr) {
                a.route_out[static_cast<int64_t>(routes[t]) * H + (rb0 + r) * RPB +
                            F::RowOf(lane, lr)] = acc[r][lr][t];
              }
            }
          }
        }
      }
    }
  }
}

// Pass 2 per token: y[t, rows] += sum_j down_{s_j}[rows] . h[t*k + j].
// Grid (H / (NR * rows per block), T); block W warps sharing NR row blocks; the (route, step)
// pairs of the token are dealt to the warps round-robin, U at a time, and the warps' sums are
// added in warp order. Shared: h of the token's k routes, then [W][NR * rows per block] sums.
template <class F, int W, int NR, int U>
__global__ void __launch_bounds__(32 * W) DownByTokenKernel(Args a) {
  extern __shared__ float4 smem[];
  constexpr int RPB = F::kRowsPerBlock;
  const int H = a.hidden, I = a.inter, k = a.top_k;
  const int t = blockIdx.y;
  float* red = reinterpret_cast<float*>(smem + k * (I / 4));
  int32_t* slots = reinterpret_cast<int32_t*>(red + W * NR * RPB);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rb0 = blockIdx.x * NR;
  for (int j = threadIdx.x; j < k; j += blockDim.x) slots[j] = ValidSlot(a, a.slot_ids[t * k + j]);
  __syncthreads();
  bool any = false;
  for (int j = 0; j < k; ++j) any = any || slots[j] >= 0;
  if (!any) return;  // the whole block: y's row stays bit-identical
  StageVectors<F::kPlanes>(smem, a.h, I, k, [&](int j) { return slots[j] >= 0 ? t * k + j : -1; });
  __syncthreads();
  float acc[NR][F::kLaneRows][1] = {};
  const int S = F::Steps(I), M = I / (4 * F::kPlanes), total = k * S;
  for (int f0 = warp; f0 < total; f0 += U * W) {
    typename F::Frag f[U][NR];
    int m[U], j[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int fu = f0 + u * W;
      j[u] = fu / S;
      const int s = fu - j[u] * S;
      const int slot = fu < total ? slots[j[u]] : -1;
      m[u] = slot >= 0 ? F::Chunk(I, s, lane) : -1;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        f[u][r] = m[u] >= 0 ? F::Load(F::RowAt(a, true, max(slot, 0), rb0 + r, I), I, s, lane)
                            : typename F::Frag{};
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (m[u] < 0) continue;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        F::template Fma<1>(f[u][r], smem + j[u] * (I / 4), 0, M, m[u], 1, acc[r]);
      }
    }
  }
  WarpReduce<F, NR, 1>(acc);
  if (F::Holds(lane)) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
      for (int lr = 0; lr < F::kLaneRows; ++lr) {
        red[warp * NR * RPB + r * RPB + F::RowOf(lane, lr)] = acc[r][lr][0];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NR * RPB; i += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < W; ++w) sum += red[w * NR * RPB + i];
    a.y[static_cast<int64_t>(t) * H + rb0 * RPB + i] += sum;
  }
}

// y[t] += sum_j route_out[t*k + j] over the routes with a slot, in j order.
// Grid (ceil(H / 4 / 256), T), 256 threads, one float4 each.
__global__ void __launch_bounds__(256) SumRoutesKernel(Args a) {
  const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  const int q = a.hidden / 4;
  if (c >= q) return;
  float4* y = reinterpret_cast<float4*>(a.y) + static_cast<int64_t>(t) * q + c;
  float4 acc = *y;
  for (int j = 0; j < a.top_k; ++j) {
    const int route = t * a.top_k + j;
    if (ValidSlot(a, a.slot_ids[route]) < 0) continue;
    const float4 o = reinterpret_cast<const float4*>(a.route_out)[static_cast<int64_t>(route) * q + c];
    acc.x += o.x;
    acc.y += o.y;
    acc.z += o.z;
    acc.w += o.w;
  }
  *y = acc;
}

// Sorts the routes by (slot, route) in one block (bitonic sort of P = 2^n >= N keys in shared
// memory; routes without a slot sort last and are dropped) and writes the distinct slots in
// ascending order: group_slot[g], group_start[g] (into order), group_start[groups] = routes with
// a slot, num_groups.
__global__ void __launch_bounds__(1024) GroupRoutesKernel(Args a, int P, int32_t* order,
                                                          int32_t* group_slot,
                                                          int32_t* group_start,
                                                          int32_t* num_groups) {
  extern __shared__ unsigned long long keys[];
  __shared__ int warp_sums[32];
  __shared__ int valid_routes;
  const int tid = threadIdx.x, nt = blockDim.x;
  constexpr unsigned long long kNone = 0xffffffffull;
  for (int i = tid; i < P; i += nt) {
    unsigned long long key = ~0ull;
    if (i < a.num_routes) {
      const int32_t s = ValidSlot(a, a.slot_ids[i]);
      key = ((s >= 0 ? static_cast<unsigned long long>(s) : kNone) << 32) | static_cast<unsigned>(i);
    }
    keys[i] = key;
  }
  if (tid == 0) valid_routes = 0;
  __syncthreads();
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < P; i += nt) {
        const int partner = i ^ stride;
        if (partner > i) {
          const unsigned long long x = keys[i], y = keys[partner];
          const bool ascending = (i & size) == 0;
          if ((x > y) == ascending) {
            keys[i] = y;
            keys[partner] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  // Each thread takes P / nt consecutive keys: count the group heads, scan, write.
  const int per = P / nt, begin = tid * per;
  int heads = 0;
  for (int i = begin; i < begin + per; ++i) {
    const unsigned long long slot = keys[i] >> 32;
    if (slot == kNone) continue;
    if (i == 0 || (keys[i - 1] >> 32) != slot) ++heads;
    order[i] = static_cast<int32_t>(keys[i] & 0xffffffffull);
    if (i + 1 == P || (keys[i + 1] >> 32) == kNone) valid_routes = i + 1;
  }
  const int lane = tid & 31, warp = tid >> 5;
  int incl = heads;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = nt / 32;
    int v = lane < nw ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int u = __shfl_up_sync(kFullMask, v, off);
      if (lane >= off) v += u;
    }
    if (lane < nw) warp_sums[lane] = v;  // inclusive over warps
  }
  __syncthreads();
  int g = incl - heads + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = begin; i < begin + per; ++i) {
    const unsigned long long slot = keys[i] >> 32;
    if (slot == kNone) continue;
    if (i == 0 || (keys[i - 1] >> 32) != slot) {
      group_slot[g] = static_cast<int32_t>(slot);
      group_start[g] = i;
      ++g;
    }
  }
  if (tid == nt - 1) {
    *num_groups = g;
    group_start[g] = valid_routes;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch shapes per format.

// Pass 1: bf16 and fp8 8 warps, one gate/up row pair each, full rows; q4_0 and nvfp4 one panel
// pair per block, its 64-column groups split over 4 warps. (fp8 and nvfp4 took the shapes of the
// formats with the same row blocks; not tuned.)
template <class F>
struct GateUpShape;
template <>
struct GateUpShape<Bf16Format> {
  static constexpr int kUnits = 8, kSplit = 1, kUnroll = 8;
};
template <>
struct GateUpShape<Q4Format> {
  static constexpr int kUnits = 1, kSplit = 4, kUnroll = 4;
};
template <>
struct GateUpShape<Fp8Format> {
  static constexpr int kUnits = 8, kSplit = 1, kUnroll = 4;  // H = 2048: 4 steps
};
template <>
struct GateUpShape<Nvfp4Format> : GateUpShape<Q4Format> {};
// Pass 2 per slot: bf16 and fp8 8 warps of 4 rows; q4_0 and nvfp4 4 warps of 2 panels.
template <class F>
struct DownBySlotShape;
template <>
struct DownBySlotShape<Bf16Format> {
  static constexpr int kUnits = 8, kRowBlocks = 4, kUnroll = 4;
};
template <>
struct DownBySlotShape<Q4Format> {
  static constexpr int kUnits = 4, kRowBlocks = 2, kUnroll = 4;
};
template <>
struct DownBySlotShape<Fp8Format> {
  static constexpr int kUnits = 8, kRowBlocks = 4, kUnroll = 2;
};
template <>
struct DownBySlotShape<Nvfp4Format> : DownBySlotShape<Q4Format> {};
// Pass 2 per token: bf16 and fp8 8 warps over 4 rows; q4_0 and nvfp4 16 warps over one panel.
template <class F>
struct DownByTokenShape;
template <>
struct DownByTokenShape<Bf16Format> {
  static constexpr int kWarps = 8, kRowBlocks = 4, kUnroll = 4;
};
template <>
struct DownByTokenShape<Q4Format> {
  static constexpr int kWarps = 16, kRowBlocks = 1, kUnroll = 6;
};
template <>
struct DownByTokenShape<Fp8Format> : DownByTokenShape<Bf16Format> {};
template <>
struct DownByTokenShape<Nvfp4Format> : DownByTokenShape<Q4Format> {};

constexpr int kChunks[] = {1, 4, 8};  // token chunks (TC) compiled

template <class F, int TC>
void* GateUpFn() {
  using S = GateUpShape<F>;
  return reinterpret_cast<void*>(&GateUpKernel<F, TC, S::kUnits, S::kSplit, S::kUnroll>);
}
template <class F, int TC>
void* DownBySlotFn() {
  using S = DownBySlotShape<F>;
  return reinterpret_cast<void*>(&DownBySlotKernel<F, TC, S::kUnits, S::kRowBlocks, S::kUnroll>);
}
template <class F>
void* DownByTokenFn() {
  using S = DownByTokenShape<F>;
  return reinterpret_cast<void*>(&DownByTokenKernel<F, S::kWarps, S::kRowBlocks, S::kUnroll>);
}

template <class F>
uint64_t GateUpSmem(int H, int TC) {
  using S = GateUpShape<F>;
  uint64_t bytes = static_cast<uint64_t>(TC) * H * 4;
  if (S::kSplit > 1) bytes += uint64_t{4} * S::kSplit * S::kUnits * 2 * F::kRowsPerBlock * TC;
  return bytes;
}
uint64_t DownBySlotSmem(int I, int TC) { return static_cast<uint64_t>(TC) * I * 4; }
template <class F>
uint64_t DownByTokenSmem(int I, int k) {
  using S = DownByTokenShape<F>;
  return static_cast<uint64_t>(k) * I * 4 +
         uint64_t{4} * S::kWarps * S::kRowBlocks * F::kRowsPerBlock + uint64_t{4} * k;
}

int GroupKeys(int routes) {
  int p = 32;
  while (p < routes) p <<= 1;
  return p;
}

// Every kernel instantiation, for the shared-memory attribute.
// Raises a kernel's dynamic shared memory limit to what the device allows beside its static
// shared memory.
absl::Status AllowSmem(const void* fn, int limit) {
  cudaFuncAttributes attr;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, fn));
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            limit - static_cast<int>(attr.sharedSizeBytes)));
  return absl::OkStatus();
}

template <class F>
absl::Status AllowSmem(int limit) {
  for (void* fn : {GateUpFn<F, 1>(), GateUpFn<F, 4>(), GateUpFn<F, 8>(), DownBySlotFn<F, 1>(),
                   DownBySlotFn<F, 4>(), DownBySlotFn<F, 8>(), DownByTokenFn<F>()}) {
    RETURN_IF_ERROR(AllowSmem(fn, limit));
  }
  return absl::OkStatus();
}

// Static shared memory the kernels declare beside their dynamic part (an upper bound).
constexpr int kStaticSmemBound = 1024;

uint64_t AlignUp(uint64_t v) { return (v + 255) / 256 * 256; }

template <class F>
absl::Status LaunchFormat(const Args& a, int T, int tc, const ExpertWorkspace& ws,
                          cudaStream_t stream) {
  const int H = a.hidden, I = a.inter, k = a.top_k, N = a.num_routes;
  const int groups_bound = ws.options().max_groups > 0 ? std::min(N, ws.options().max_groups) : N;
  const int gy = a.by_slot ? groups_bound : N;
  {
    using S = GateUpShape<F>;
    const int rows_per_block = S::kUnits * F::kRowsPerBlock;
    const dim3 grid((I + rows_per_block - 1) / rows_per_block, gy);
    const dim3 block(32 * S::kUnits * S::kSplit);
    const size_t smem = GateUpSmem<F>(H, tc);
    switch (tc) {
      case 1:
        GateUpKernel<F, 1, S::kUnits, S::kSplit, S::kUnroll><<<grid, block, smem, stream>>>(a);
        break;
      case 4:
        GateUpKernel<F, 4, S::kUnits, S::kSplit, S::kUnroll><<<grid, block, smem, stream>>>(a);
        break;
      default:
        GateUpKernel<F, 8, S::kUnits, S::kSplit, S::kUnroll><<<grid, block, smem, stream>>>(a);
        break;
    }
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (!a.by_slot) {
    using S = DownByTokenShape<F>;
    const dim3 grid(H / (S::kRowBlocks * F::kRowsPerBlock), T);
    DownByTokenKernel<F, S::kWarps, S::kRowBlocks, S::kUnroll>
        <<<grid, 32 * S::kWarps, DownByTokenSmem<F>(I, k), stream>>>(a);
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }
  {
    using S = DownBySlotShape<F>;
    const int rows_per_block = S::kUnits * S::kRowBlocks * F::kRowsPerBlock;
    const dim3 grid((H + rows_per_block - 1) / rows_per_block, gy);
    const size_t smem = DownBySlotSmem(I, tc);
    switch (tc) {
      case 1:
        DownBySlotKernel<F, 1, S::kUnits, S::kRowBlocks, S::kUnroll>
            <<<grid, 32 * S::kUnits, smem, stream>>>(a);
        break;
      case 4:
        DownBySlotKernel<F, 4, S::kUnits, S::kRowBlocks, S::kUnroll>
            <<<grid, 32 * S::kUnits, smem, stream>>>(a);
        break;
      default:
        DownBySlotKernel<F, 8, S::kUnits, S::kRowBlocks, S::kUnroll>
            <<<grid, 32 * S::kUnits, smem, stream>>>(a);
        break;
    }
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  SumRoutesKernel<<<dim3((H / 4 + 255) / 256, T), 256, 0, stream>>>(a);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertWorkspace>> ExpertWorkspace::Create(
    const ExpertWorkspaceOptions& o) {
  RETURN_IF_ERROR(common::CudaAvailable());
  if (o.max_tokens <= 0 || o.top_k <= 0 || o.top_k > kMaxTopK ||
      static_cast<int64_t>(o.max_tokens) * o.top_k > kMaxRoutes || o.max_groups < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert workspace: max_tokens=", o.max_tokens, " top_k=", o.top_k,
                     " max_groups=", o.max_groups, " (need T, k > 0, k <= ", kMaxTopK,
                     ", T * k <= ", kMaxRoutes, ")"));
  }
  // Shape checks are the bank helpers' (bf16 stands for every format: same rules).
  RETURN_IF_ERROR(GateUpBankBytes(WeightFormat::kBf16, o.hidden, o.intermediate).status());
  int device = 0, limit = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  limit -= kStaticSmemBound;
  const int H = o.hidden, I = o.intermediate, k = o.top_k;
  auto fits = [&](int tc) {
    return std::max({GateUpSmem<Bf16Format>(H, tc), GateUpSmem<Q4Format>(H, tc),
                     GateUpSmem<Fp8Format>(H, tc), GateUpSmem<Nvfp4Format>(H, tc),
                     DownBySlotSmem(I, tc)}) <= static_cast<uint64_t>(limit);
  };
  const uint64_t by_token =
      std::max({DownByTokenSmem<Bf16Format>(I, k), DownByTokenSmem<Q4Format>(I, k),
                DownByTokenSmem<Fp8Format>(I, k), DownByTokenSmem<Nvfp4Format>(I, k)});
  if (!fits(1) || by_token > static_cast<uint64_t>(limit) ||
      uint64_t{8} * GroupKeys(o.max_tokens * k) > static_cast<uint64_t>(limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert workspace: H=", H, " I=", I, " k=", k, " T=", o.max_tokens,
        " need more shared memory per block than the device's ", limit, " bytes"));
  }
  std::unique_ptr<ExpertWorkspace> ws(new ExpertWorkspace());
  ws->options_ = o;
  ws->token_chunk_ = 1;
  for (int tc : kChunks) {
    if (fits(tc)) ws->token_chunk_ = tc;
  }
  limit += kStaticSmemBound;
  RETURN_IF_ERROR(AllowSmem<Bf16Format>(limit));
  RETURN_IF_ERROR(AllowSmem<Q4Format>(limit));
  RETURN_IF_ERROR(AllowSmem<Fp8Format>(limit));
  RETURN_IF_ERROR(AllowSmem<Nvfp4Format>(limit));
  RETURN_IF_ERROR(AllowSmem(reinterpret_cast<const void*>(&GroupRoutesKernel), limit));

  const uint64_t N = static_cast<uint64_t>(o.max_tokens) * k;
  const uint64_t h_bytes = AlignUp(N * I * 4), out_bytes = AlignUp(N * H * 4);
  const uint64_t order_bytes = AlignUp(N * 4), gslot_bytes = AlignUp(N * 4);
  const uint64_t gstart_bytes = AlignUp((N + 1) * 4), ngroups_bytes = AlignUp(4);
  ws->block_bytes_ =
      h_bytes + out_bytes + order_bytes + gslot_bytes + gstart_bytes + ngroups_bytes;
  if (cudaMalloc(&ws->block_, ws->block_bytes_) != cudaSuccess) {
    cudaGetLastError();
    ws->block_ = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("expert workspace: cudaMalloc of ", ws->block_bytes_, " bytes failed"));
  }
  uint8_t* p = static_cast<uint8_t*>(ws->block_);
  ws->h_ = reinterpret_cast<float*>(p);
  p += h_bytes;
  ws->route_out_ = reinterpret_cast<float*>(p);
  p += out_bytes;
  ws->order_ = reinterpret_cast<int32_t*>(p);
  p += order_bytes;
  ws->group_slot_ = reinterpret_cast<int32_t*>(p);
  p += gslot_bytes;
  ws->group_start_ = reinterpret_cast<int32_t*>(p);
  p += gstart_bytes;
  ws->num_groups_ = reinterpret_cast<int32_t*>(p);
  return ws;
}

ExpertWorkspace::~ExpertWorkspace() {
  if (block_ != nullptr) cudaFree(block_);
}

absl::Status LaunchRoutedExperts(const SlotBanks& banks, ExpertWorkspace& ws, int num_tokens,
                                 const float* x, const int32_t* slot_ids,
                                 const float* route_weights, float* y, CUstream_st* stream,
                                 RouteGrouping grouping) {
  const ExpertWorkspaceOptions& o = ws.options();
  const WeightFormat f = banks.format;
  if (f != WeightFormat::kBf16 && f != WeightFormat::kQ4_0 && f != WeightFormat::kFp8Block &&
      f != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("routed experts on the GPU take bf16, q4_0, fp8_block and nvfp4 weights, "
                     "not ",
                     std::string(common::WeightFormatName(f))));
  }
  if (banks.hidden != o.hidden || banks.intermediate != o.intermediate) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert banks H=", banks.hidden, " I=", banks.intermediate,
                     " do not match the workspace's H=", o.hidden, " I=", o.intermediate));
  }
  if (num_tokens < 1 || num_tokens > o.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("routed experts: T=", num_tokens,
                                                   " outside [1, ", o.max_tokens, "]"));
  }
  if (banks.num_slots <= 0 || banks.gate_up == nullptr || banks.down == nullptr ||
      banks.gate_up_pitch % 16 != 0 || banks.down_pitch % 16 != 0 || !Aligned16(banks.gate_up) ||
      !Aligned16(banks.down)) {
    return absl::InvalidArgumentError("routed experts: slot banks missing or not 16-byte aligned");
  }
  // Scale banks: f32 per slot row, so 4-byte aligned rows.
  auto f32_bank = [](const uint8_t* p, uint64_t pitch) {
    return p != nullptr && pitch % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 4 == 0;
  };
  if (f == WeightFormat::kFp8Block &&
      (!f32_bank(banks.gate_up_scales, banks.gate_up_scales_pitch) ||
       !f32_bank(banks.down_scales, banks.down_scales_pitch))) {
    return absl::InvalidArgumentError(
        "routed experts: fp8_block needs gate_up_scales and down_scales banks (4-byte aligned)");
  }
  if (f == WeightFormat::kNvfp4 &&
      (!f32_bank(banks.gate_global_scale, banks.gate_global_scale_pitch) ||
       !f32_bank(banks.up_global_scale, banks.up_global_scale_pitch) ||
       !f32_bank(banks.down_global_scale, banks.down_global_scale_pitch))) {
    return absl::InvalidArgumentError(
        "routed experts: nvfp4 needs the gate, up and down global scale banks (4-byte aligned)");
  }
  if (x == nullptr || slot_ids == nullptr || route_weights == nullptr || y == nullptr ||
      !Aligned16(x) || !Aligned16(y)) {
    return absl::InvalidArgumentError(
        "routed experts: x, slot_ids, route_weights and y must be device pointers (x, y "
        "16-byte aligned)");
  }
  Args a{};
  a.gate_up = banks.gate_up;
  a.gate_up_pitch = banks.gate_up_pitch;
  a.down = banks.down;
  a.down_pitch = banks.down_pitch;
  a.gate_up_scales = banks.gate_up_scales;
  a.gate_up_scales_pitch = banks.gate_up_scales_pitch;
  a.down_scales = banks.down_scales;
  a.down_scales_pitch = banks.down_scales_pitch;
  a.gate_global = banks.gate_global_scale;
  a.gate_global_pitch = banks.gate_global_scale_pitch;
  a.up_global = banks.up_global_scale;
  a.up_global_pitch = banks.up_global_scale_pitch;
  a.down_global = banks.down_global_scale;
  a.down_global_pitch = banks.down_global_scale_pitch;
  a.num_slots = banks.num_slots;
  a.hidden = o.hidden;
  a.inter = o.intermediate;
  a.top_k = o.top_k;
  a.num_routes = num_tokens * o.top_k;
  a.x = x;
  a.slot_ids = slot_ids;
  a.route_weights = route_weights;
  a.y = y;
  a.h = ws.h();
  a.route_out = ws.route_out();
  a.order = ws.order();
  a.group_slot = ws.group_slot();
  a.group_start = ws.group_start();
  a.num_groups = ws.num_groups();
  a.by_slot = grouping == RouteGrouping::kBySlot ||
              (grouping == RouteGrouping::kAuto && num_tokens > kAutoPerRouteMaxTokens);
  int tc = 1;
  if (a.by_slot) {
    // A slot has at most T routes (top-k ids of a token are distinct; repeats only cost extra
    // chunks).
    tc = num_tokens == 1 ? 1 : num_tokens <= 4 ? 4 : 8;
    tc = std::min(tc, ws.token_chunk());
    const int P = GroupKeys(a.num_routes);
    GroupRoutesKernel<<<1, std::min(P, 1024), static_cast<size_t>(P) * 8, stream>>>(
        a, P, ws.order(), ws.group_slot(), ws.group_start(), ws.num_groups());
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  switch (f) {
    case WeightFormat::kBf16:
      return LaunchFormat<Bf16Format>(a, num_tokens, tc, ws, stream);
    case WeightFormat::kQ4_0:
      return LaunchFormat<Q4Format>(a, num_tokens, tc, ws, stream);
    case WeightFormat::kFp8Block:
      return LaunchFormat<Fp8Format>(a, num_tokens, tc, ws, stream);
    default:
      return LaunchFormat<Nvfp4Format>(a, num_tokens, tc, ws, stream);
  }
}

}  // namespace moe::engine::gpu
