#include <cuda_runtime.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/cuda/hybrid/handoff_kernels.h"
#include "moe_cache/policy_core.h"

namespace moe::engine::hybrid {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 64;

struct Counters {
  uint32_t* seq;
  uint32_t* posted;
  uint32_t* blocks_done;
  uint32_t* cpu_routes;
  uint32_t* row_has_cpu;  // [max_rows]
};

Counters Split(uint32_t* c) { return Counters{c, c + 1, c + 2, c + 3, c + 4}; }

__global__ void __launch_bounds__(kThreads)
    PostKernel(HandoffView v, Counters d, int layer, int rows, const int32_t* __restrict__ ids,
               const int32_t* __restrict__ slot_ids, const float* __restrict__ w,
               const float* __restrict__ x) {
  const int K = v.shape.top_k, H = v.shape.hidden;
  __shared__ int row_routes;
  int block_routes = 0;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    if (threadIdx.x == 0) row_routes = 0;
    __syncthreads();
    if (threadIdx.x < K) {
      const int i = r * K + threadIdx.x;
      const bool cpu = slot_ids[i] == moe_cache::kCpuSlot;
      v.ids[i] = cpu ? ids[i] : -1;
      v.weights[i] = w[i];
      if (cpu) atomicAdd(&row_routes, 1);
    }
    __syncthreads();
    const int n = row_routes;
    if (n > 0) {
      const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(r) * H);
      float4* dst = reinterpret_cast<float4*>(v.x + static_cast<int64_t>(r) * H);
      for (int c = threadIdx.x; c < H / 4; c += blockDim.x) dst[c] = src[c];
    }
    if (threadIdx.x == 0) {
      d.row_has_cpu[r] = n > 0;
      block_routes += n;
    }
    __syncthreads();  // row_routes is reused
  }
  // Every thread's writes to the exchange reach the host before this block counts as done.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (block_routes != 0) atomicAdd(d.cpu_routes, static_cast<uint32_t>(block_routes));
  __threadfence();
  if (atomicAdd(d.blocks_done, 1u) != gridDim.x - 1) return;
  // The last block: every other block's payload and route count are in.
  __threadfence();
  const uint32_t total = atomicExch(d.cpu_routes, 0u);
  *d.blocks_done = 0;
  if (total == 0) {
    *d.posted = 0;
    return;
  }
  v.ctrl->layer = layer;
  v.ctrl->num_tokens = rows;
  v.ctrl->cpu_routes = static_cast<int32_t>(total);
  const uint32_t seq = *d.seq + 1;
  *d.seq = seq;
  *d.posted = 1;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&v.ctrl->request_seq) = seq;
}

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads)
    WaitAddKernel(HandoffView v, Counters d, int rows, float* __restrict__ y, int64_t timeout_ns,
                  int wait) {
  if (*d.posted == 0) return;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    int good = 1;
    if (wait) {
      const uint32_t want = *d.seq;
      volatile uint32_t* done = &v.ctrl->done_seq;
      volatile uint32_t* timeouts = &v.ctrl->gpu_timeouts;
      if (*timeouts != 0) {
        good = 0;  // an earlier wait of this step gave up: do not wait again
      } else {
        const uint64_t t0 = GlobalTimer();
        while (*done != want) {
          if (GlobalTimer() - t0 > static_cast<uint64_t>(timeout_ns)) {
            *timeouts = 1;
            good = 0;
            break;
          }
          __nanosleep(200);
        }
      }
      __threadfence_system();
    }
    ok = good;
  }
  __syncthreads();
  if (!ok) return;
  const int H = v.shape.hidden;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    if (d.row_has_cpu[r] == 0) continue;
    const float* src = v.y + static_cast<int64_t>(r) * H;
    float* dst = y + static_cast<int64_t>(r) * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) dst[c] += __ldcv(src + c);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuHandoff>> GpuHandoff::Create(const HandoffShape& shape,
                                                               HandoffCompute compute) {
  if (shape.max_rows <= 0 || shape.top_k <= 0 || shape.top_k > kThreads || shape.hidden <= 0 ||
      shape.hidden % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid handoff: bad shape (", shape.max_rows, " rows, top-", shape.top_k, ", hidden ",
        shape.hidden, "; hidden must be a multiple of 4, top-k at most ", kThreads, ")"));
  }
  RETURN_IF_ERROR(common::CudaAvailable());
  std::unique_ptr<GpuHandoff> h(new GpuHandoff());
  const size_t bytes = HandoffBytes(shape);
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&h->block_, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(h->block_, 0, bytes);
  void* dev = nullptr;
  CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev, h->block_, 0));
  h->host_ = MakeHandoffView(h->block_, shape);
  h->device_ = MakeHandoffView(dev, shape);
  const size_t counter_bytes = sizeof(uint32_t) * (4 + static_cast<size_t>(shape.max_rows));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&h->counters_, counter_bytes));
  CUDA_RETURN_IF_ERROR(cudaMemset(h->counters_, 0, counter_bytes));
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  h->worker_ = std::make_unique<CpuWorker>(h->host_, std::move(compute));
  return h;
}

GpuHandoff::~GpuHandoff() {
  worker_.reset();
  if (counters_ != nullptr) cudaFree(counters_);
  if (block_ != nullptr) cudaFreeHost(block_);
}

absl::Status GpuHandoff::Post(int layer, int rows, const int32_t* ids, const int32_t* slot_ids,
                              const float* route_weights, const float* x, CUstream_st* stream) {
  if (rows <= 0 || rows > device_.shape.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("hybrid handoff: ", rows, " rows; at most ",
                                                   device_.shape.max_rows));
  }
  const int blocks = rows < kMaxBlocks ? rows : kMaxBlocks;
  PostKernel<<<blocks, kThreads, 0, stream>>>(device_, Split(counters_), layer, rows, ids,
                                               slot_ids, route_weights, x);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status GpuHandoff::WaitAndAdd(int rows, float* y, CUstream_st* stream, bool wait) {
  if (rows <= 0 || rows > device_.shape.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("hybrid handoff: ", rows, " rows; at most ",
                                                   device_.shape.max_rows));
  }
  const int blocks = rows < kMaxBlocks ? rows : kMaxBlocks;
  WaitAddKernel<<<blocks, kThreads, 0, stream>>>(device_, Split(counters_), rows, y, timeout_ns_,
                                                  wait ? 1 : 0);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status GpuHandoff::TakeError() {
  absl::Status st = worker_->TakeError();
  volatile uint32_t* timeouts = &host_.ctrl->gpu_timeouts;
  if (*timeouts != 0) {
    *timeouts = 0;
    if (st.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "hybrid experts: the CPU worker did not answer layer ", host_.ctrl->layer, " within ",
          timeout_ns_ / 1000000, " ms"));
    }
  }
  return st;
}

}  // namespace moe::engine::hybrid
