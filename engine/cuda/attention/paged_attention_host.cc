// Host side of the paged attention kernels: shape validation, the decode split plan, and the
// owners of the device pools and the decode workspace. Compiled with and without CUDA.
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/cuda/attention/paged_attention.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::engine::gpu {
namespace {

bool IsPow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

absl::Status DeviceAlloc(uint64_t bytes, const char* what, void** out) {
  *out = nullptr;
#if MOE_HAVE_CUDA
  const cudaError_t err = cudaMalloc(out, bytes);
  if (err != cudaSuccess) {
    *out = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes for ", what,
                                                     " failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  (void)bytes;
  return absl::UnavailableError(absl::StrCat(what, ": built without CUDA"));
#endif
}

void DeviceFree(void* p) {
#if MOE_HAVE_CUDA
  if (p != nullptr) cudaFree(p);
#else
  (void)p;
#endif
}

}  // namespace

absl::Status ValidateLayer(const PagedKvLayer& l) {
  if (l.head_dim != 16 && l.head_dim != 32 && l.head_dim != 64 && l.head_dim != 128 &&
      l.head_dim != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged attention: head_dim must be 16, 32, 64, 128 or 256, got ", l.head_dim));
  }
  if (!IsPow2(l.block_size) || l.block_size < 16 || l.block_size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged attention: block_size must be a power of two in [16, 1024], got ", l.block_size));
  }
  if (l.num_kv_heads <= 0 || l.num_blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: num_kv_heads ",
                                                   l.num_kv_heads, " and num_blocks ",
                                                   l.num_blocks, " must be positive"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PagedKvPool>> PagedKvPool::Create(int num_layers, int num_kv_heads,
                                                                 int head_dim, int block_size,
                                                                 int num_blocks) {
  PagedKvLayer shape;
  shape.num_kv_heads = num_kv_heads;
  shape.head_dim = head_dim;
  shape.block_size = block_size;
  shape.num_blocks = num_blocks;
  RETURN_IF_ERROR(ValidateLayer(shape));
  if (num_layers <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be > 0, got ", num_layers));
  }
  RETURN_IF_ERROR(common::CudaAvailable());
  std::unique_ptr<PagedKvPool> pool(new PagedKvPool());
  pool->layers_.assign(num_layers, shape);
  const uint64_t bytes = pool->layer_bytes();
  for (PagedKvLayer& l : pool->layers_) {
    void* k = nullptr;
    void* v = nullptr;
    RETURN_IF_ERROR(DeviceAlloc(bytes, "KV pool keys", &k));
    l.k = static_cast<uint16_t*>(k);
    RETURN_IF_ERROR(DeviceAlloc(bytes, "KV pool values", &v));
    l.v = static_cast<uint16_t*>(v);
  }
  return pool;
}

PagedKvPool::~PagedKvPool() {
  for (PagedKvLayer& l : layers_) {
    DeviceFree(l.k);
    DeviceFree(l.v);
  }
}

uint64_t PagedKvPool::layer_bytes() const {
  if (layers_.empty()) return 0;
  const PagedKvLayer& l = layers_[0];
  return static_cast<uint64_t>(l.num_blocks) * l.num_kv_heads * l.block_size * l.head_dim *
         sizeof(uint16_t);
}

int SplitChunk(int len, int splits, int min_chunk) {
  int c = (len + splits - 1) / splits;
  c = (c + 15) & ~15;
  return std::max(c, min_chunk);
}

int DecodePlan::SplitsForBatch(int batch) const {
  const int per_seq = num_kv_heads * std::max(batch, 1);
  const int wanted = (target_blocks + per_seq - 1) / per_seq;
  return std::clamp(wanted, 1, max_splits);
}

int64_t DecodePlan::PartialCapacity() const {
  int64_t most = 0;
  for (int b = 1; b <= max_batch; ++b) {
    most = std::max<int64_t>(most, static_cast<int64_t>(b) * SplitsForBatch(b));
  }
  return most * num_q_heads;
}

absl::StatusOr<DecodePlan> MakeDecodePlan(const DecodeWorkspaceConfig& c, int sm_count) {
  if (c.max_batch <= 0 || c.num_q_heads <= 0 || c.num_kv_heads <= 0 || c.max_context <= 0 ||
      c.num_q_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode workspace: bad sizes (max_batch ", c.max_batch, ", heads ", c.num_q_heads, "/",
        c.num_kv_heads, ", max_context ", c.max_context, ")"));
  }
  if (c.min_chunk <= 0 || c.min_chunk % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode workspace: min_chunk must be a positive multiple of 16, got ",
                     c.min_chunk));
  }
  PagedKvLayer shape;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.block_size = 16;
  shape.num_blocks = 1;
  RETURN_IF_ERROR(ValidateLayer(shape));
  DecodePlan p;
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.max_batch = c.max_batch;
  p.min_chunk = c.min_chunk;
  p.target_blocks = c.target_blocks > 0 ? c.target_blocks : 4 * std::max(sm_count, 1);
  const int64_t splits = (static_cast<int64_t>(c.max_context) + c.min_chunk - 1) / c.min_chunk;
  p.max_splits = static_cast<int>(std::clamp<int64_t>(splits, 1, DecodePlan::kMaxSplits));
  return p;
}

absl::StatusOr<std::unique_ptr<DecodeWorkspace>> DecodeWorkspace::Create(
    const DecodeWorkspaceConfig& config) {
  RETURN_IF_ERROR(common::CudaAvailable());
  int sm_count = 0;
#if MOE_HAVE_CUDA
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
#endif
  ASSIGN_OR_RETURN(DecodePlan plan, MakeDecodePlan(config, sm_count));
  std::unique_ptr<DecodeWorkspace> ws(new DecodeWorkspace());
  ws->plan_ = plan;
  const uint64_t partials = static_cast<uint64_t>(plan.PartialCapacity());
  void* o = nullptr;
  void* lse = nullptr;
  RETURN_IF_ERROR(DeviceAlloc(partials * plan.head_dim * sizeof(float), "decode partials", &o));
  ws->partial_out_ = static_cast<float*>(o);
  RETURN_IF_ERROR(DeviceAlloc(partials * sizeof(float), "decode partial lse", &lse));
  ws->partial_lse_ = static_cast<float*>(lse);
  return ws;
}

DecodeWorkspace::~DecodeWorkspace() {
  DeviceFree(partial_out_);
  DeviceFree(partial_lse_);
}

uint64_t DecodeWorkspace::bytes() const {
  return static_cast<uint64_t>(plan_.PartialCapacity()) * (plan_.head_dim + 1) * sizeof(float);
}

}  // namespace moe::engine::gpu
