// Dispatch of kernels.h: the bodies are in kernels-inl.h, compiled once per Highway target.
#include "engine/kernels.h"

#include <cstring>

// foreach_target.h re-includes this file once per target, so it must come first.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "engine/kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "engine/kernels-inl.h"
// clang-format on

#if HWY_ONCE
namespace moe::engine {

HWY_EXPORT(GemvImpl);
HWY_EXPORT(RmsNormRowsImpl);
HWY_EXPORT(AttentionImpl);

void Gemv(const float* x, int m, int k, const void* w, bool w_bf16, int n, float* y,
          bool accumulate, common::ThreadPool& pool) {
  HWY_DYNAMIC_DISPATCH(GemvImpl)(x, m, k, w, w_bf16, n, y, accumulate, pool);
}

void RmsNormRows(const float* x, int rows, int n, const float* weight, float eps, float* out) {
  HWY_DYNAMIC_DISPATCH(RmsNormRowsImpl)(x, rows, n, weight, eps, out);
}

void Attention(const AttentionArgs& args, common::ThreadPool& pool) {
  HWY_DYNAMIC_DISPATCH(AttentionImpl)(args, pool);
}

}  // namespace moe::engine
#endif  // HWY_ONCE
