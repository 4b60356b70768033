// Kernels of the dense part of the forward pass that are not matrix products oneDNN serves:
// per-row GEMV with a fixed summation order (the deterministic mode and single-row decode),
// RMSNorm, and attention over the paged KV cache. Vectorized with Highway; each call dispatches
// once to the best target the CPU supports (kernels-inl.h) and shares its rows over the pool.
//
// Every result of a row depends only on that row's inputs (never on the batch or the thread
// count): the summation order is fixed per target.
// Plain types only: no Highway types here. Thread-safe for distinct outputs.
#ifndef MOE_ENGINE_KERNELS_H_
#define MOE_ENGINE_KERNELS_H_

#include <cstdint>

#include "common/thread_pool.h"

namespace moe::engine {

// y[m, n] = x[m, k] . w[n, k]^T (w f32, or bf16 bits when w_bf16); y += ... when accumulate.
void Gemv(const float* x, int m, int k, const void* w, bool w_bf16, int n, float* y,
          bool accumulate, common::ThreadPool& pool);

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `n` (in place allowed).
void RmsNormRows(const float* x, int rows, int n, const float* weight, float eps, float* out);

// One layer's attention over a paged KV cache. Row r (a token at position positions[r] of the
// sequence whose block table is block_tables[r]) attends to that sequence's positions
// [0, positions[r]] (causal), which must already be in the cache.
struct AttentionArgs {
  int rows = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;                            // tokens per KV block
  float scale = 1.0f;                            // multiplies q . k
  const float* q = nullptr;                      // [rows, num_heads, head_dim]
  float* out = nullptr;                          // [rows, num_heads, head_dim]
  const int32_t* positions = nullptr;            // [rows]
  const int32_t* const* block_tables = nullptr;  // [rows] -> block ids of the row's sequence
  // Block b's keys are k_cache + b * block_stride: [num_kv_heads, block_size, head_dim]; same
  // for values.
  const float* k_cache = nullptr;
  const float* v_cache = nullptr;
  int64_t block_stride = 0;
  int max_positions = 0;  // bound of positions[r] + 1 (sizes the scratch)
};
void Attention(const AttentionArgs& args, common::ThreadPool& pool);

}  // namespace moe::engine

#endif  // MOE_ENGINE_KERNELS_H_
