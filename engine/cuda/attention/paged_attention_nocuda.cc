// Paged attention without CUDA: the same entry points, reporting that the build has no GPU code.
#include "engine/cuda/attention/paged_attention.h"

namespace moe::engine::gpu {

absl::Status LaunchAppendKv(const PagedKvLayer&, const AppendKvArgs&, CUstream_st*) {
  return absl::UnavailableError("append_kv: built without CUDA");
}

absl::Status LaunchDecodeAttention(const PagedKvLayer&, const DecodeArgs&, const DecodeWorkspace&,
                                   CUstream_st*) {
  return absl::UnavailableError("decode attention: built without CUDA");
}

absl::Status LaunchPrefillAttention(const PagedKvLayer&, const PrefillArgs&, CUstream_st*) {
  return absl::UnavailableError("prefill attention: built without CUDA");
}

}  // namespace moe::engine::gpu
