#include "engine/cuda/ops/rope_table.h"

#include <cmath>
#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::engine::gpu {

absl::StatusOr<RopeCosSin> BuildRopeCosSin(const RopeParams& params, int head_dim,
                                           int max_positions) {
  if (head_dim <= 0 || head_dim % 2 != 0 || params.inv_freq.empty() ||
      static_cast<int>(params.inv_freq.size()) > head_dim / 2 || max_positions <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope table: head_dim ", head_dim, " (even, with 1 to head_dim / 2 "
                     "frequencies, not ", params.inv_freq.size(), "), max_positions ",
                     max_positions));
  }
  RopeCosSin t;
  t.head_dim = head_dim;
  t.rotary_dim = 2 * static_cast<int>(params.inv_freq.size());
  t.max_positions = max_positions;
  const int half = t.rotary_dim / 2;
  t.cos.resize(static_cast<size_t>(max_positions) * half);
  t.sin.resize(t.cos.size());
  for (int pos = 0; pos < max_positions; ++pos) {
    for (int i = 0; i < half; ++i) {
      // RopeTable's arithmetic: freq = position (float32) * inv_freq (float32), cos and sin in
      // float32, then times the attention factor.
      const float f = static_cast<float>(pos) * params.inv_freq[i];
      t.cos[static_cast<size_t>(pos) * half + i] = std::cos(f) * params.attention_factor;
      t.sin[static_cast<size_t>(pos) * half + i] = std::sin(f) * params.attention_factor;
    }
  }
  return t;
}

absl::StatusOr<std::unique_ptr<DeviceRopeTable>> DeviceRopeTable::Create(const RopeCosSin& host) {
#if MOE_HAVE_CUDA
  RETURN_IF_ERROR(common::CudaAvailable());
  if (host.head_dim <= 0 || host.rotary_dim <= 0 || host.rotary_dim > host.head_dim ||
      host.rotary_dim % 2 != 0 || host.max_positions <= 0 ||
      host.cos.size() != static_cast<size_t>(host.max_positions) * (host.rotary_dim / 2) ||
      host.sin.size() != host.cos.size()) {
    return absl::InvalidArgumentError("rope table: sizes do not match head_dim and positions");
  }
  std::unique_ptr<DeviceRopeTable> t(new DeviceRopeTable());
  t->head_dim_ = host.head_dim;
  t->rotary_dim_ = host.rotary_dim;
  t->max_positions_ = host.max_positions;
  const size_t bytes = host.cos.size() * sizeof(float);
  if (cudaMalloc(reinterpret_cast<void**>(&t->cos_), bytes) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&t->sin_), bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("rope table: cudaMalloc of 2 x ", bytes, " bytes failed"));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpy(t->cos_, host.cos.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(t->sin_, host.sin.data(), bytes, cudaMemcpyHostToDevice));
  return t;
#else
  (void)host;
  return absl::UnavailableError("rope table: built without CUDA");
#endif
}

DeviceRopeTable::~DeviceRopeTable() {
#if MOE_HAVE_CUDA
  if (cos_ != nullptr) cudaFree(cos_);
  if (sin_ != nullptr) cudaFree(sin_);
#endif
}

}  // namespace moe::engine::gpu
