// Kernels of delta_net.h. Every reduction has a fixed order set by the launch shape, so results
// are bit-identical from run to run, eager or replayed from a graph.
//
// The delta rule keeps a piece's recurrent state in registers: a block serves one (piece, value
// head, tile of 32 value columns); its 128 threads are 32 columns x 4 row groups, thread (g, c)
// holding rows g, g + 4, g + 8, ... of column c. Per token, q and k go to shared memory, the
// column sums S^T k and S^T q are reduced over the four row groups in shared memory, and S is
// written back once after the piece's last token.
#include "engine/cuda/ops/delta_net.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

namespace moe::engine::gpu {
namespace {

constexpr int kWarp = 32;
constexpr int kRowGroups = 4;                      // delta rule: threads per column
constexpr int kRuleThreads = kWarp * kRowGroups;   // delta rule block
constexpr int kConvThreads = 128;                  // conv: channels per block
constexpr int kGateThreads = 128;                  // gates: one row per block
constexpr int kMaxConvKernel = 8;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float Silu(float x) { return x / (1.0f + expf(-x)); }

// common/formats.h's FloatToBf16: round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Grid (pieces, ceil(C / kConvThreads)); thread: one channel of one piece, its window of the
// last kernel inputs in registers.
__global__ void ConvKernel(const float* __restrict__ in, int64_t in_stride, int C, int kernel,
                           const float* __restrict__ weight, DeltaNetPieces pieces,
                           DeltaNetState state, float* __restrict__ out) {
  const int p = blockIdx.x;
  const int c = blockIdx.y * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int first = pieces.first_row[p], n = pieces.num_rows[p], start = pieces.start_pos[p];
  if (start < 0) {
    for (int t = 0; t < n; ++t) out[static_cast<int64_t>(first + t) * C + c] = 0.0f;
    return;
  }
  const int hist = kernel - 1;
  float* st = state.conv + static_cast<int64_t>(pieces.state_slot[p]) * state.slot_stride;
  float w[kMaxConvKernel], win[kMaxConvKernel];  // win[j]: input t - hist + j
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j) {
    w[j] = j < kernel ? weight[static_cast<int64_t>(j) * C + c] : 0.0f;
    win[j] = (j < hist && start > 0) ? st[static_cast<int64_t>(j) * C + c] : 0.0f;
  }
  for (int t = 0; t < n; ++t) {
    const int64_t r = first + t;
    // The window's slot `hist` takes the new input; the sum runs over taps 0..hist in order.
    const float x = in[r * in_stride + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvKernel; ++j) {
      if (j < hist) acc += w[j] * win[j];
      if (j == hist) acc += w[j] * x;
    }
    out[r * C + c] = Silu(acc);
#pragma unroll
    for (int j = 0; j + 1 < kMaxConvKernel; ++j) {
      if (j + 1 < hist) win[j] = win[j + 1];
      if (j + 1 == hist) win[j] = x;
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j) {
    if (j < hist) st[static_cast<int64_t>(j) * C + c] = win[j];
  }
}

// Grid: rows; block kGateThreads. Warps take the 2 nk q and k heads in turn; then threads take
// the nv gates.
__global__ void GatesKernel(float* __restrict__ qkv, int C, int nk, int dk, int nv,
                            const int32_t* __restrict__ positions, const float* __restrict__ proj,
                            int64_t proj_stride, int b_offset, int a_offset,
                            const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                            float* __restrict__ g, float* __restrict__ beta) {
  const int r = blockIdx.x;
  if (positions[r] < 0) return;
  float* row = qkv + static_cast<int64_t>(r) * C;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const float q_scale = rsqrtf(static_cast<float>(dk));
  for (int head = warp; head < 2 * nk; head += kGateThreads / kWarp) {
    float* x = row + head * dk;  // heads 0..nk-1: q, nk..2nk-1: k
    float ss = 0.0f;
    for (int i = lane; i < dk; i += kWarp) ss += x[i] * x[i];
    ss = WarpSum(ss);
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = lane; i < dk; i += kWarp) {
      // As the CPU engine: normalise, then scale q (two roundings, not one).
      const float y = x[i] * inv;
      x[i] = head < nk ? y * q_scale : y;
    }
  }
  const float* pr = proj + static_cast<int64_t>(r) * proj_stride;
  for (int h = threadIdx.x; h < nv; h += kGateThreads) {
    const float b = pr[b_offset + h], a = pr[a_offset + h] + dt_bias[h];
    const float sp = a > 20.0f ? a : log1pf(expf(a));
    beta[static_cast<int64_t>(r) * nv + h] = 1.0f / (1.0f + expf(-b));
    g[static_cast<int64_t>(r) * nv + h] = -expf(a_log[h]) * sp;
  }
}

// Grid (pieces, nv, ceil(dv / 32)); block kRuleThreads. kRows: rows of S per thread, at least
// ceil(dk / kRowGroups).
template <int kRows>
__global__ void __launch_bounds__(kRuleThreads)
    DeltaRuleKernel(const float* __restrict__ qkv, int C, const float* __restrict__ g,
                    const float* __restrict__ beta, int nk, int nv, int dk, int dv,
                    DeltaNetPieces pieces, DeltaNetState state, float* __restrict__ out) {
  __shared__ float sq[kMaxDeltaHeadDim], sk[kMaxDeltaHeadDim];
  __shared__ float red[kRowGroups][kWarp];
  const int p = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x % kWarp, grp = threadIdx.x / kWarp;
  const int c = blockIdx.z * kWarp + lane;
  const bool col = c < dv;
  const int Vd = nv * dv, Kd = nk * dk, kh = h / (nv / nk);
  const int first = pieces.first_row[p], n = pieces.num_rows[p], start = pieces.start_pos[p];
  if (start < 0) {
    if (grp == 0 && col) {
      for (int t = 0; t < n; ++t) out[static_cast<int64_t>(first + t) * Vd + h * dv + c] = 0.0f;
    }
    return;
  }
  float* S = state.recurrent + static_cast<int64_t>(pieces.state_slot[p]) * state.slot_stride +
             static_cast<int64_t>(h) * dk * dv;
  float s[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int rr = grp + i * kRowGroups;
    s[i] = (start > 0 && col && rr < dk) ? S[static_cast<int64_t>(rr) * dv + c] : 0.0f;
  }
  for (int t = 0; t < n; ++t) {
    const int64_t r = first + t;
    const float* row = qkv + r * C;
    for (int i = threadIdx.x; i < dk; i += kRuleThreads) {
      sq[i] = row[kh * dk + i];
      sk[i] = row[Kd + kh * dk + i];
    }
    __syncthreads();
    const float decay = expf(g[r * nv + h]), b = beta[r * nv + h];
    const float v = col ? row[2 * Kd + h * dv + c] : 0.0f;
    // S <- decay S; kv = S^T k.
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int rr = grp + i * kRowGroups;
      if (rr < dk) {
        s[i] *= decay;
        kv += s[i] * sk[rr];
      }
    }
    red[grp][lane] = kv;
    __syncthreads();
    kv = 0.0f;
#pragma unroll
    for (int j = 0; j < kRowGroups; ++j) kv += red[j][lane];
    const float delta = (v - kv) * b;
    // S += k delta^T; o = S^T q.
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int rr = grp + i * kRowGroups;
      if (rr < dk) {
        s[i] += sk[rr] * delta;
        o += s[i] * sq[rr];
      }
    }
    __syncthreads();  // every thread has read red (kv) before it is overwritten
    red[grp][lane] = o;
    __syncthreads();
    if (grp == 0 && col) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowGroups; ++j) sum += red[j][lane];
      out[r * Vd + h * dv + c] = sum;
    }
    __syncthreads();  // red, sq and sk are free for the next token
  }
  if (col) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int rr = grp + i * kRowGroups;
      if (rr < dk) S[static_cast<int64_t>(rr) * dv + c] = s[i];
    }
  }
}

// Grid (rows, num_heads); one warp.
__global__ void GatedRmsNormKernel(const float* __restrict__ core, const float* __restrict__ z,
                                   int64_t z_stride, int num_heads, int head_dim,
                                   const float* __restrict__ weight, float eps,
                                   uint16_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y, lane = threadIdx.x;
  const int64_t base = r * num_heads * head_dim + static_cast<int64_t>(h) * head_dim;
  const float* o = core + base;
  const float* zr = z + r * z_stride + static_cast<int64_t>(h) * head_dim;
  float ss = 0.0f;
  for (int i = lane; i < head_dim; i += kWarp) ss += o[i] * o[i];
  ss = WarpSum(ss);
  const float inv = 1.0f / sqrtf(ss / head_dim + eps);
  for (int i = lane; i < head_dim; i += kWarp) {
    out[base + i] = FloatToBf16(weight[i] * (o[i] * inv) * Silu(zr[i]));
  }
}

absl::Status CheckShape(const DeltaNetShape& s) {
  if (s.num_key_heads <= 0 || s.num_value_heads <= 0 ||
      s.num_value_heads % s.num_key_heads != 0 || s.key_head_dim <= 0 ||
      s.key_head_dim > kMaxDeltaHeadDim || s.value_head_dim <= 0 ||
      s.value_head_dim > kMaxDeltaHeadDim || s.conv_kernel < 2 ||
      s.conv_kernel > kMaxConvKernel) {
    return absl::InvalidArgumentError(absl::StrCat(
        "delta net shape: ", s.num_key_heads, " key heads, ", s.num_value_heads,
        " value heads (a multiple), head dims ", s.key_head_dim, " and ", s.value_head_dim,
        " (at most ", kMaxDeltaHeadDim, "), conv kernel ", s.conv_kernel, " (2 to ",
        kMaxConvKernel, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckPieces(const DeltaNetPieces& p, const DeltaNetState& st) {
  if (p.num_pieces < 0 || p.num_pieces > 65535 ||
      (p.num_pieces > 0 && (p.first_row == nullptr || p.num_rows == nullptr ||
                            p.start_pos == nullptr || p.state_slot == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("delta net: ", p.num_pieces, " pieces (at most 65535, arrays set)"));
  }
  if (p.num_pieces > 0 && (st.num_slots <= 0 || st.slot_stride <= 0)) {
    return absl::InvalidArgumentError("delta net: no state slots");
  }
  return absl::OkStatus();
}

absl::Status LastError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::Status LaunchDeltaNetConv(const float* in, int64_t in_stride, int rows,
                                const DeltaNetShape& shape, const float* weight,
                                const DeltaNetPieces& pieces, const DeltaNetState& state,
                                float* out, CUstream_st* stream) {
  RETURN_IF_ERROR(CheckShape(shape));
  RETURN_IF_ERROR(CheckPieces(pieces, state));
  const int C = shape.conv_dim();
  if (rows < 0 || in_stride < C) {
    return absl::InvalidArgumentError(
        absl::StrCat("delta net conv: ", rows, " rows, row stride ", in_stride, " < ", C));
  }
  if (pieces.num_pieces == 0 || rows == 0) return absl::OkStatus();
  const dim3 grid(pieces.num_pieces, (C + kConvThreads - 1) / kConvThreads);
  ConvKernel<<<grid, kConvThreads, 0, stream>>>(in, in_stride, C, shape.conv_kernel, weight,
                                                pieces, state, out);
  return LastError("delta net conv");
}

absl::Status LaunchDeltaNetGates(float* qkv, int rows, const DeltaNetShape& shape,
                                 const int32_t* positions, const float* proj, int64_t proj_stride,
                                 int b_offset, int a_offset, const float* a_log,
                                 const float* dt_bias, float* g, float* beta,
                                 CUstream_st* stream) {
  RETURN_IF_ERROR(CheckShape(shape));
  const int nv = shape.num_value_heads;
  if (rows < 0 || b_offset < 0 || a_offset < 0 || b_offset + nv > proj_stride ||
      a_offset + nv > proj_stride) {
    return absl::InvalidArgumentError(absl::StrCat("delta net gates: ", rows, " rows, b at ",
                                                   b_offset, ", a at ", a_offset, ", ", nv,
                                                   " heads in rows of ", proj_stride));
  }
  if (rows == 0) return absl::OkStatus();
  GatesKernel<<<rows, kGateThreads, 0, stream>>>(
      qkv, shape.conv_dim(), shape.num_key_heads, shape.key_head_dim, nv, positions, proj,
      proj_stride, b_offset, a_offset, a_log, dt_bias, g, beta);
  return LastError("delta net gates");
}

absl::Status LaunchDeltaRule(const float* qkv, const float* g, const float* beta, int rows,
                             const DeltaNetShape& shape, const DeltaNetPieces& pieces,
                             const DeltaNetState& state, float* out, CUstream_st* stream) {
  RETURN_IF_ERROR(CheckShape(shape));
  RETURN_IF_ERROR(CheckPieces(pieces, state));
  if (rows < 0) return absl::InvalidArgumentError("delta rule: negative rows");
  if (pieces.num_pieces == 0 || rows == 0) return absl::OkStatus();
  const int nk = shape.num_key_heads, nv = shape.num_value_heads;
  const int dk = shape.key_head_dim, dv = shape.value_head_dim, C = shape.conv_dim();
  const dim3 grid(pieces.num_pieces, nv, (dv + kWarp - 1) / kWarp);
  const int rows_per_thread = (dk + kRowGroups - 1) / kRowGroups;
  if (rows_per_thread <= 8) {
    DeltaRuleKernel<8><<<grid, kRuleThreads, 0, stream>>>(qkv, C, g, beta, nk, nv, dk, dv,
                                                          pieces, state, out);
  } else if (rows_per_thread <= 16) {
    DeltaRuleKernel<16><<<grid, kRuleThreads, 0, stream>>>(qkv, C, g, beta, nk, nv, dk, dv,
                                                           pieces, state, out);
  } else if (rows_per_thread <= 32) {
    DeltaRuleKernel<32><<<grid, kRuleThreads, 0, stream>>>(qkv, C, g, beta, nk, nv, dk, dv,
                                                           pieces, state, out);
  } else {
    DeltaRuleKernel<kMaxDeltaHeadDim / kRowGroups><<<grid, kRuleThreads, 0, stream>>>(
        qkv, C, g, beta, nk, nv, dk, dv, pieces, state, out);
  }
  return LastError("delta rule");
}

absl::Status LaunchGatedRmsNorm(const float* core, const float* z, int64_t z_stride, int rows,
                                int num_heads, int head_dim, const float* weight, float eps,
                                uint16_t* out, CUstream_st* stream) {
  if (rows < 0 || num_heads <= 0 || num_heads > 65535 || head_dim <= 0 ||
      z_stride < static_cast<int64_t>(num_heads) * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("gated rms norm: ", rows, " rows of ",
                                                   num_heads, " heads of ", head_dim,
                                                   ", z row stride ", z_stride));
  }
  if (rows == 0) return absl::OkStatus();
  GatedRmsNormKernel<<<dim3(rows, num_heads), kWarp, 0, stream>>>(core, z, z_stride, num_heads,
                                                                  head_dim, weight, eps, out);
  return LastError("gated rms norm");
}

}  // namespace moe::engine::gpu
