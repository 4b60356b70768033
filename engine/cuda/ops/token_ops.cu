// Kernels of token_ops.h. Reductions use warp shuffles and, across warps, shared memory in a
// fixed order, so every result depends only on its own row's inputs and the launch shape: runs
// are bit-identical, eager or replayed from a graph.
#include "engine/cuda/ops/token_ops.h"

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

namespace moe::engine::gpu {
namespace {

constexpr int kWarp = 32;

// common/formats.h's FloatToBf16 on the device: round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// (value, index) candidates: b beats a when larger, or equal with a lower index. NaN values
// never beat anything.
__device__ __forceinline__ bool Beats(float bv, int bi, float av, int ai) {
  return bv > av || (bv == av && bi < ai);
}

__device__ __forceinline__ void WarpArgmax(float& v, int& i) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, o);
    if (Beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats.
__device__ float BlockSum(float v, float* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = WarpSum(v);
  __syncthreads();  // `shared` may still be read from an earlier call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float s = lane < warps ? shared[lane] : 0.0f;
  return WarpSum(s);
}

absl::Status LaunchStatus(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return common::CudaErrorToStatus(static_cast<int>(e), what, __FILE__, __LINE__);
}

// Grid for an elementwise kernel over n items with a grid-stride loop.
unsigned ElementwiseBlocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 8192 ? b : 8192);
}

// ---------------------------------------------------------------------------------------------

__global__ void EmbeddingKernel(const uint16_t* __restrict__ table, int vocab, int hidden,
                                const int32_t* __restrict__ ids, float* __restrict__ out) {
  const int t = blockIdx.x;
  const int id = ids[t];
  float* o = out + static_cast<int64_t>(t) * hidden;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
    return;
  }
  const uint16_t* r = table + static_cast<int64_t>(id) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = Bf16ToFloat(r[i]);
}

constexpr int kNormThreads = 256;

__global__ void RmsNormKernel(const float* x, int n, const float* __restrict__ weight, float eps,
                              float* out_f32, uint16_t* __restrict__ out_bf16) {
  __shared__ float shared[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const float* xr = x + base;
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
  const float ms = BlockSum(s, shared) / static_cast<float>(n);
  const float inv = 1.0f / sqrtf(ms + eps);
  // Each thread rewrites only the elements it read, so out_f32 may alias x.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = weight[i] * (xr[i] * inv);
    if (out_f32 != nullptr) out_f32[base + i] = v;
    if (out_bf16 != nullptr) out_bf16[base + i] = FloatToBf16(v);
  }
}

// One warp per head row; rows [0, num_tokens * num_q_heads) are q's, the rest k's. Lane l
// handles the pairs (i, i + half) for i = l, l + 32, ...
constexpr int kQkWarpsPerBlock = 4;

__global__ void QkNormRopeKernel(QkNormRopeArgs a) {
  const int64_t q_rows = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  const int64_t rows = q_rows + static_cast<int64_t>(a.num_tokens) * a.num_kv_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQkWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const int d = a.head_dim, half = d / 2;
  const bool is_q = row < q_rows;
  const int t = is_q ? static_cast<int>(row / a.num_q_heads)
                     : static_cast<int>((row - q_rows) / a.num_kv_heads);
  float* x = is_q ? a.q + row * d : a.k + (row - q_rows) * d;
  const float* w = is_q ? a.q_norm : a.k_norm;
  float inv = 1.0f;
  if (w != nullptr) {
    float s = 0.0f;
    for (int i = lane; i < half; i += kWarp) s += x[i] * x[i] + x[i + half] * x[i + half];
    inv = 1.0f / sqrtf(WarpSum(s) / static_cast<float>(d) + a.eps);
  }
  const int pos = a.cos != nullptr ? a.positions[t] : -1;
  const bool rotate = pos >= 0 && pos < a.max_positions;
  const int rh = (a.rotary_dim > 0 ? a.rotary_dim : d) / 2;
  if (rh == half) {
    // Full rotary: each lane normalises and rotates its own pairs.
    const float* c = rotate ? a.cos + static_cast<int64_t>(pos) * half : nullptr;
    const float* sn = rotate ? a.sin + static_cast<int64_t>(pos) * half : nullptr;
    for (int i = lane; i < half; i += kWarp) {
      float lo = x[i], hi = x[i + half];
      if (w != nullptr) {
        lo = w[i] * (lo * inv);
        hi = w[i + half] * (hi * inv);
      }
      if (rotate) {
        // Separately rounded products, as the CPU's RopeTable::Apply.
        const float ci = c[i], si = sn[i];
        const float nlo = __fsub_rn(__fmul_rn(lo, ci), __fmul_rn(hi, si));
        const float nhi = __fadd_rn(__fmul_rn(hi, ci), __fmul_rn(lo, si));
        lo = nlo;
        hi = nhi;
      }
      x[i] = lo;
      x[i + half] = hi;
    }
    return;
  }
  // Partial rotary: normalise the whole head, then rotate the pairs (i, i + rh) of its first
  // 2 rh dimensions (other lanes' elements: the warp synchronises between the two).
  if (w != nullptr) {
    for (int i = lane; i < d; i += kWarp) x[i] = w[i] * (x[i] * inv);
    __syncwarp();
  }
  if (rotate) {
    const float* c = a.cos + static_cast<int64_t>(pos) * rh;
    const float* sn = a.sin + static_cast<int64_t>(pos) * rh;
    for (int i = lane; i < rh; i += kWarp) {
      const float lo = x[i], hi = x[i + rh], ci = c[i], si = sn[i];
      x[i] = __fsub_rn(__fmul_rn(lo, ci), __fmul_rn(hi, si));
      x[i + rh] = __fadd_rn(__fmul_rn(hi, ci), __fmul_rn(lo, si));
    }
  }
}

__global__ void SiluMulKernel(const float* __restrict__ gate_up, int64_t n, int inter,
                              float* __restrict__ out_f32, uint16_t* __restrict__ out_bf16) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = j / inter, i = j % inter;
    const float g = gate_up[t * 2 * inter + i];
    const float u = gate_up[t * 2 * inter + inter + i];
    const float v = g / (1.0f + expf(-g)) * u;
    if (out_f32 != nullptr) out_f32[j] = v;
    if (out_bf16 != nullptr) out_bf16[j] = FloatToBf16(v);
  }
}

__global__ void AddKernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[j] += x[j];
  }
}

__global__ void AddBiasKernel(float* __restrict__ y, int64_t total, int n,
                              const float* __restrict__ bias) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[j] += bias[j % n];
  }
}

// One warp per token. The token's probabilities sit in shared memory; each of the top_k rounds
// takes the best remaining (value, lower id) over the warp and marks it taken (-1, below every
// probability).
constexpr int kRouterWarpsPerBlock = 4;

__global__ void RouterTopKKernel(const float* __restrict__ logits, int num_tokens, int E, int K,
                                 bool renormalize, int32_t* __restrict__ ids,
                                 float* __restrict__ weights) {
  __shared__ float probs[kRouterWarpsPerBlock][kMaxRouterExperts];
  __shared__ float chosen[kRouterWarpsPerBlock][kMaxRouterTopK];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int t = blockIdx.x * kRouterWarpsPerBlock + warp;
  if (t >= num_tokens) return;
  const float* l = logits + static_cast<int64_t>(t) * E;
  float* p = probs[warp];
  float mx = -INFINITY;
  for (int e = lane; e < E; e += kWarp) mx = fmaxf(mx, l[e]);
  mx = WarpMax(mx);
  float s = 0.0f;
  for (int e = lane; e < E; e += kWarp) {
    p[e] = expf(l[e] - mx);
    s += p[e];
  }
  s = WarpSum(s);
  for (int e = lane; e < E; e += kWarp) {
    const float v = p[e] / s;
    p[e] = v == v ? v : -0.5f;  // NaN (from NaN logits) ranks below every probability
  }
  __syncwarp();
  for (int j = 0; j < K; ++j) {
    float bv = -2.0f;
    int bi = INT_MAX;
    for (int e = lane; e < E; e += kWarp) {
      if (Beats(p[e], e, bv, bi)) {
        bv = p[e];
        bi = e;
      }
    }
    WarpArgmax(bv, bi);
    if (lane == 0) {
      ids[static_cast<int64_t>(t) * K + j] = bi;
      chosen[warp][j] = bv;
      p[bi] = -1.0f;
    }
    __syncwarp();
  }
  if (lane == 0) {
    float topsum = 0.0f;
    for (int j = 0; j < K; ++j) topsum += chosen[warp][j];
    for (int j = 0; j < K; ++j) {
      weights[static_cast<int64_t>(t) * K + j] =
          renormalize ? chosen[warp][j] / topsum : chosen[warp][j];
    }
  }
}

__global__ void SharedCombineKernel(float* __restrict__ h, const float* __restrict__ shared,
                                    const float* __restrict__ gate_logit, int hidden) {
  const int t = blockIdx.y;
  const float g = 1.0f / (1.0f + expf(-gate_logit[t]));
  const int64_t base = static_cast<int64_t>(t) * hidden;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x) {
    h[base + i] += g * shared[base + i];
  }
}

// Argmax: block (c, t) reduces chunk c of row t to one candidate; then one block per row.
constexpr int kArgmaxThreads = 256;

// One partial maximum in ArgmaxScratchBytes' layout: [num_tokens, chunks] of these.
struct Candidate {
  float v;
  int i;
};
static_assert(sizeof(Candidate) == kArgmaxCandidateBytes, "scratch layout");

int ArgmaxChunks(int vocab) { return (vocab + kArgmaxChunk - 1) / kArgmaxChunk; }

__device__ Candidate BlockArgmax(float v, int i) {
  __shared__ float sv[kWarp];
  __shared__ int si[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  WarpArgmax(v, i);
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / kWarp;
    v = lane < warps ? sv[lane] : -INFINITY;
    i = lane < warps ? si[lane] : INT_MAX;
    WarpArgmax(v, i);
  }
  return {v, i};  // valid in thread 0
}

__global__ void ArgmaxPartialKernel(const float* __restrict__ logits, int vocab,
                                    Candidate* __restrict__ partial) {
  const int c = blockIdx.x, t = blockIdx.y;
  const float* row = logits + static_cast<int64_t>(t) * vocab;
  const int begin = c * kArgmaxChunk;
  const int end = min(vocab, begin + kArgmaxChunk);
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float v = row[j];
    if (Beats(v, j, bv, bi)) {
      bv = v;
      bi = j;
    }
  }
  const Candidate best = BlockArgmax(bv, bi);
  if (threadIdx.x == 0) partial[static_cast<int64_t>(t) * gridDim.x + c] = best;
}

__global__ void ArgmaxFinalKernel(const Candidate* __restrict__ partial, int chunks,
                                  int32_t* __restrict__ out) {
  const int t = blockIdx.x;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const Candidate p = partial[static_cast<int64_t>(t) * chunks + c];
    if (Beats(p.v, p.i, bv, bi)) {
      bv = p.v;
      bi = p.i;
    }
  }
  const Candidate best = BlockArgmax(bv, bi);
  if (threadIdx.x == 0) out[t] = best.i == INT_MAX ? 0 : best.i;
}

__global__ void F32ToBf16Kernel(const float* __restrict__ x, int64_t n,
                                uint16_t* __restrict__ out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[j] = FloatToBf16(x[j]);
  }
}

__global__ void SplitGatedQueryKernel(const float* __restrict__ qg, int64_t n, int hd,
                                      float* __restrict__ q, float* __restrict__ gate) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t head = j / hd, i = j % hd;
    q[j] = qg[head * 2 * hd + i];
    gate[j] = qg[head * 2 * hd + hd + i];
  }
}

__global__ void SigmoidGateToBf16Kernel(const float* __restrict__ x,
                                        const float* __restrict__ gate, int64_t n,
                                        uint16_t* __restrict__ out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[j] = FloatToBf16(x[j] * (1.0f / (1.0f + expf(-gate[j]))));
  }
}

__device__ float HashUniform(uint64_t seed, int64_t i) {
  // splitmix64 of (seed, i): 24 high bits as a fraction in [0, 1).
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

__global__ void FillUniformKernel(float* __restrict__ f32, uint16_t* __restrict__ bf16, int64_t n,
                                  float lo, float span, uint64_t seed) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = lo + span * HashUniform(seed, j);
    if (f32 != nullptr) f32[j] = v;
    if (bf16 != nullptr) bf16[j] = FloatToBf16(v);
  }
}

__global__ void Bf16ToF32Kernel(const uint16_t* __restrict__ x, int64_t n,
                                float* __restrict__ out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[j] = Bf16ToFloat(x[j]);
  }
}

constexpr int kElementwiseThreads = 256;

}  // namespace

absl::Status LaunchEmbeddingGather(const uint16_t* table, int vocab, int hidden, const int32_t* ids,
                                   int num_tokens, float* out, CUstream_st* stream) {
  if (vocab <= 0 || hidden <= 0 || num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding: vocab ", vocab, ", hidden ", hidden, ", tokens ", num_tokens));
  }
  if (num_tokens == 0) return absl::OkStatus();
  EmbeddingKernel<<<num_tokens, kNormThreads, 0, stream>>>(table, vocab, hidden, ids, out);
  return LaunchStatus("EmbeddingKernel");
}

absl::Status LaunchRmsNorm(const float* x, int rows, int n, const float* weight, float eps,
                           float* out_f32, uint16_t* out_bf16, CUstream_st* stream) {
  if (rows < 0 || n <= 0 || (out_f32 == nullptr && out_bf16 == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm: rows ", rows, ", n ", n, ", and at least one output"));
  }
  if (rows == 0) return absl::OkStatus();
  RmsNormKernel<<<rows, kNormThreads, 0, stream>>>(x, n, weight, eps, out_f32, out_bf16);
  return LaunchStatus("RmsNormKernel");
}

absl::Status LaunchQkNormRope(const QkNormRopeArgs& a, CUstream_st* stream) {
  if (a.num_tokens < 0 || a.num_q_heads < 0 || a.num_kv_heads < 0 || a.head_dim <= 0 ||
      a.head_dim % 2 != 0 || a.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qk_norm_rope: tokens ", a.num_tokens, ", heads ", a.num_q_heads, "/", a.num_kv_heads,
        ", head_dim ", a.head_dim, " (even, at most ", kMaxHeadDim, ")"));
  }
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr)) {
    return absl::InvalidArgumentError("qk_norm_rope: q_norm and k_norm must be set together");
  }
  if (a.cos != nullptr && (a.sin == nullptr || a.positions == nullptr || a.max_positions <= 0)) {
    return absl::InvalidArgumentError("qk_norm_rope: RoPE needs cos, sin, positions and a size");
  }
  if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("qk_norm_rope: rotary_dim ", a.rotary_dim,
                                                   " (even, at most head_dim ", a.head_dim, ")"));
  }
  const int64_t rows =
      static_cast<int64_t>(a.num_tokens) * (static_cast<int64_t>(a.num_q_heads) + a.num_kv_heads);
  if (rows == 0 || (a.q_norm == nullptr && a.cos == nullptr)) return absl::OkStatus();
  const int64_t blocks = (rows + kQkWarpsPerBlock - 1) / kQkWarpsPerBlock;
  if (blocks > INT_MAX) return absl::InvalidArgumentError("qk_norm_rope: too many rows");
  QkNormRopeKernel<<<static_cast<unsigned>(blocks), kQkWarpsPerBlock * kWarp, 0, stream>>>(a);
  return LaunchStatus("QkNormRopeKernel");
}

absl::Status LaunchSiluMul(const float* gate_up, int num_tokens, int inter, float* out_f32,
                           uint16_t* out_bf16, CUstream_st* stream) {
  if (num_tokens < 0 || inter <= 0 || (out_f32 == nullptr && out_bf16 == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("silu_mul: tokens ", num_tokens, ", inter ",
                                                   inter, ", and at least one output"));
  }
  const int64_t n = static_cast<int64_t>(num_tokens) * inter;
  if (n == 0) return absl::OkStatus();
  SiluMulKernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      gate_up, n, inter, out_f32, out_bf16);
  return LaunchStatus("SiluMulKernel");
}

absl::Status LaunchAdd(float* y, const float* x, int64_t n, CUstream_st* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("add: n ", n));
  if (n == 0) return absl::OkStatus();
  AddKernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(y, x, n);
  return LaunchStatus("AddKernel");
}

absl::Status LaunchAddBias(float* y, int rows, int n, const float* bias, CUstream_st* stream) {
  if (rows < 0 || n <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("add_bias: rows ", rows, ", n ", n));
  }
  const int64_t total = static_cast<int64_t>(rows) * n;
  if (total == 0) return absl::OkStatus();
  AddBiasKernel<<<ElementwiseBlocks(total, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      y, total, n, bias);
  return LaunchStatus("AddBiasKernel");
}

absl::Status LaunchRouterTopK(const float* logits, int num_tokens, int num_experts, int top_k,
                              bool renormalize, int32_t* ids, float* weights, CUstream_st* stream) {
  if (num_tokens < 0 || num_experts <= 0 || num_experts > kMaxRouterExperts || top_k <= 0 ||
      top_k > kMaxRouterTopK || top_k > num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router_topk: tokens ", num_tokens, ", experts ", num_experts, " (at most ",
        kMaxRouterExperts, "), top_k ", top_k, " (at most ", kMaxRouterTopK, " and the experts)"));
  }
  if (num_tokens == 0) return absl::OkStatus();
  const int blocks = (num_tokens + kRouterWarpsPerBlock - 1) / kRouterWarpsPerBlock;
  RouterTopKKernel<<<blocks, kRouterWarpsPerBlock * kWarp, 0, stream>>>(
      logits, num_tokens, num_experts, top_k, renormalize, ids, weights);
  return LaunchStatus("RouterTopKKernel");
}

absl::Status LaunchSharedExpertCombine(float* h, const float* shared, const float* gate_logit,
                                       int num_tokens, int hidden, CUstream_st* stream) {
  if (num_tokens < 0 || num_tokens > 65535 || hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared_expert_combine: tokens ", num_tokens,
                                                   " (at most 65535), hidden ", hidden));
  }
  if (num_tokens == 0) return absl::OkStatus();
  const int x_blocks = (hidden + kElementwiseThreads - 1) / kElementwiseThreads;
  SharedCombineKernel<<<dim3(x_blocks < 64 ? x_blocks : 64, num_tokens), kElementwiseThreads, 0,
                        stream>>>(h, shared, gate_logit, hidden);
  return LaunchStatus("SharedCombineKernel");
}

absl::Status LaunchArgmax(const float* logits, int num_tokens, int vocab, void* scratch,
                          int32_t* out, CUstream_st* stream) {
  if (num_tokens < 0 || num_tokens > 65535 || vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("argmax: tokens ", num_tokens, " (at most 65535), vocab ", vocab));
  }
  if (num_tokens == 0) return absl::OkStatus();
  if (scratch == nullptr || reinterpret_cast<uintptr_t>(scratch) % alignof(Candidate) != 0) {
    return absl::InvalidArgumentError("argmax: scratch must be set and 8-byte aligned");
  }
  const int chunks = ArgmaxChunks(vocab);
  Candidate* partial = static_cast<Candidate*>(scratch);
  ArgmaxPartialKernel<<<dim3(chunks, num_tokens), kArgmaxThreads, 0, stream>>>(logits, vocab,
                                                                               partial);
  RETURN_IF_ERROR(LaunchStatus("ArgmaxPartialKernel"));
  ArgmaxFinalKernel<<<num_tokens, kArgmaxThreads, 0, stream>>>(partial, chunks, out);
  return LaunchStatus("ArgmaxFinalKernel");
}

absl::Status LaunchF32ToBf16(const float* x, int64_t n, uint16_t* out, CUstream_st* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("f32_to_bf16: n ", n));
  if (n == 0) return absl::OkStatus();
  F32ToBf16Kernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      x, n, out);
  return LaunchStatus("F32ToBf16Kernel");
}

absl::Status LaunchBf16ToF32(const uint16_t* x, int64_t n, float* out, CUstream_st* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("bf16_to_f32: n ", n));
  if (n == 0) return absl::OkStatus();
  Bf16ToF32Kernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      x, n, out);
  return LaunchStatus("Bf16ToF32Kernel");
}

absl::Status LaunchSplitGatedQuery(const float* qg, int num_tokens, int num_heads, int head_dim,
                                   float* q, float* gate, CUstream_st* stream) {
  if (num_tokens < 0 || num_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("split_gated_query: tokens ", num_tokens,
                                                   ", heads ", num_heads, ", head_dim ", head_dim));
  }
  const int64_t n = static_cast<int64_t>(num_tokens) * num_heads * head_dim;
  if (n == 0) return absl::OkStatus();
  SplitGatedQueryKernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0,
                          stream>>>(qg, n, head_dim, q, gate);
  return LaunchStatus("SplitGatedQueryKernel");
}

absl::Status LaunchSigmoidGateToBf16(const float* x, const float* gate, int64_t n, uint16_t* out,
                                     CUstream_st* stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("sigmoid_gate: n ", n));
  if (n == 0) return absl::OkStatus();
  SigmoidGateToBf16Kernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0,
                            stream>>>(x, gate, n, out);
  return LaunchStatus("SigmoidGateToBf16Kernel");
}

absl::Status LaunchFillUniformF32(float* x, int64_t n, float lo, float hi, uint64_t seed,
                                  CUstream_st* stream) {
  if (n < 0 || !(hi >= lo)) return absl::InvalidArgumentError("fill_uniform: n < 0 or hi < lo");
  if (n == 0) return absl::OkStatus();
  FillUniformKernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      x, nullptr, n, lo, hi - lo, seed);
  return LaunchStatus("FillUniformKernel");
}

absl::Status LaunchFillUniformBf16(uint16_t* x, int64_t n, float lo, float hi, uint64_t seed,
                                   CUstream_st* stream) {
  if (n < 0 || !(hi >= lo)) return absl::InvalidArgumentError("fill_uniform: n < 0 or hi < lo");
  if (n == 0) return absl::OkStatus();
  FillUniformKernel<<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      nullptr, x, n, lo, hi - lo, seed);
  return LaunchStatus("FillUniformKernel");
}

}  // namespace moe::engine::gpu
