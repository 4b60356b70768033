// token_ops.h without CUDA: the same entry points, reporting that the build has no GPU code.
#include <string>

#include "engine/cuda/ops/token_ops.h"

namespace moe::engine::gpu {
namespace {
absl::Status NoCuda(const char* what) {
  return absl::UnavailableError(std::string(what) + ": built without CUDA");
}
}  // namespace

absl::Status LaunchEmbeddingGather(const uint16_t*, int, int, const int32_t*, int, float*,
                                   CUstream_st*) {
  return NoCuda("embedding");
}
absl::Status LaunchRmsNorm(const float*, int, int, const float*, float, float*, uint16_t*,
                           CUstream_st*) {
  return NoCuda("rms_norm");
}
absl::Status LaunchQkNormRope(const QkNormRopeArgs&, CUstream_st*) {
  return NoCuda("qk_norm_rope");
}
absl::Status LaunchSiluMul(const float*, int, int, float*, uint16_t*, CUstream_st*) {
  return NoCuda("silu_mul");
}
absl::Status LaunchAdd(float*, const float*, int64_t, CUstream_st*) { return NoCuda("add"); }
absl::Status LaunchAddBias(float*, int, int, const float*, CUstream_st*) {
  return NoCuda("add_bias");
}
absl::Status LaunchRouterTopK(const float*, int, int, int, bool, int32_t*, float*, CUstream_st*) {
  return NoCuda("router_topk");
}
absl::Status LaunchSharedExpertCombine(float*, const float*, const float*, int, int, CUstream_st*) {
  return NoCuda("shared_expert_combine");
}
absl::Status LaunchArgmax(const float*, int, int, void*, int32_t*, CUstream_st*) {
  return NoCuda("argmax");
}
absl::Status LaunchF32ToBf16(const float*, int64_t, uint16_t*, CUstream_st*) {
  return NoCuda("f32_to_bf16");
}
absl::Status LaunchBf16ToF32(const uint16_t*, int64_t, float*, CUstream_st*) {
  return NoCuda("bf16_to_f32");
}

absl::Status LaunchSplitGatedQuery(const float*, int, int, int, float*, float*, CUstream_st*) {
  return NoCuda("split_gated_query");
}
absl::Status LaunchSigmoidGateToBf16(const float*, const float*, int64_t, uint16_t*,
                                     CUstream_st*) {
  return NoCuda("sigmoid_gate");
}
absl::Status LaunchFillUniformF32(float*, int64_t, float, float, uint64_t, CUstream_st*) {
  return NoCuda("fill_uniform");
}
absl::Status LaunchFillUniformBf16(uint16_t*, int64_t, float, float, uint64_t, CUstream_st*) {
  return NoCuda("fill_uniform");
}

}  // namespace moe::engine::gpu
