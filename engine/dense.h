// Dense linear layers y[m, n] = x[m, k] . W[n, k]^T for the weights of model_weights.h (bf16 or
// f32, row-major [out, in]): through oneDNN matmul (bf16 with AMX where the CPU has it, f32 when
// the weights are f32) for batches of rows, and through the fixed-order per-row GEMV of
// kernels.h for single rows and in the deterministic mode, whose results must not depend on the
// batch (oneDNN picks its kernels and blocking by the batch size).
//
// Owns oneDNN primitives (cached by shape) and scratch; not thread-safe (one per engine, used by
// its Step thread). oneDNN runs on its own OpenMP threads; the GEMV on the given pool.
#ifndef MOE_ENGINE_DENSE_H_
#define MOE_ENGINE_DENSE_H_

#include <memory>

#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "engine/model_weights.h"

namespace moe::engine {

class DenseLinear {
 public:
  // deterministic: always the per-row GEMV. Otherwise batches of at least onednn_min_rows rows
  // go through oneDNN (-1: $MOE_ENGINE_ONEDNN_MIN_ROWS, else kOnednnMinRows).
  DenseLinear(common::ThreadPool* pool, bool deterministic, int onednn_min_rows = -1);
  ~DenseLinear();
  DenseLinear(const DenseLinear&) = delete;
  DenseLinear& operator=(const DenseLinear&) = delete;

  // y[m, w.rows] = x[m, w.cols] . w^T (+ y when accumulate). Internal on a oneDNN failure.
  absl::Status Apply(const Tensor& w, const float* x, int m, float* y, bool accumulate = false);

  // Rows at or above which a non-deterministic Apply goes through oneDNN by default.
  static constexpr int kOnednnMinRows = 4;
  int onednn_min_rows() const { return onednn_min_rows_; }

 private:
  struct Impl;
  common::ThreadPool* pool_;
  bool deterministic_;
  int onednn_min_rows_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_DENSE_H_
