// Host-side sizes of token_ops.h, the same with and without CUDA.
#include "engine/cuda/ops/token_ops.h"

namespace moe::engine::gpu {

int64_t ArgmaxScratchBytes(int num_tokens, int vocab) {
  if (num_tokens <= 0 || vocab <= 0) return 0;
  const int64_t chunks = (static_cast<int64_t>(vocab) + kArgmaxChunk - 1) / kArgmaxChunk;
  return static_cast<int64_t>(num_tokens) * chunks * kArgmaxCandidateBytes;
}

}  // namespace moe::engine::gpu
