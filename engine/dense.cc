#include "engine/dense.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/aligned_buffer.h"
#include "common/formats.h"
#include "dnnl.hpp"
#include "engine/kernels.h"

namespace moe::engine {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

struct DenseLinear::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // (m, k, n, bf16) -> primitive. Prefill chunks give a bounded set of m values; the cache is
  // dropped when it grows past kMaxPrimitives anyway.
  static constexpr size_t kMaxPrimitives = 512;
  std::map<std::tuple<int, int, int, bool>, dnnl::matmul> primitives;
  common::AlignedBuffer<uint16_t> x_bf16;
  std::vector<float> y_tmp;

  dnnl::matmul& Get(int m, int k, int n, bool bf16) {
    auto key = std::make_tuple(m, k, n, bf16);
    auto it = primitives.find(key);
    if (it != primitives.end()) return it->second;
    if (primitives.size() >= kMaxPrimitives) primitives.clear();
    const dt in = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc src_md({m, k}, in, tag::ab);
    dnnl::memory::desc wei_md({k, n}, in, tag::ba);  // W [n, k] row-major read as [k, n]
    dnnl::memory::desc dst_md({m, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), engine);
    return primitives.emplace(key, dnnl::matmul(pd)).first->second;
  }
};

DenseLinear::DenseLinear(common::ThreadPool* pool, bool deterministic, int onednn_min_rows)
    : pool_(pool),
      deterministic_(deterministic),
      onednn_min_rows_(onednn_min_rows),
      impl_(std::make_unique<Impl>()) {
  if (onednn_min_rows_ < 0) {
    onednn_min_rows_ = kOnednnMinRows;
    const char* env = std::getenv("MOE_ENGINE_ONEDNN_MIN_ROWS");
    int v;
    if (env != nullptr && absl::SimpleAtoi(env, &v) && v >= 1) onednn_min_rows_ = v;
  }
}

DenseLinear::~DenseLinear() = default;

absl::Status DenseLinear::Apply(const Tensor& w, const float* x, int m, float* y, bool accumulate) {
  const int k = static_cast<int>(w.cols), n = static_cast<int>(w.rows);
  const bool bf16 = w.dtype == DType::kBf16;
  const void* wp = bf16 ? static_cast<const void*>(w.bf16()) : static_cast<const void*>(w.f32());
  if (m <= 0) return absl::OkStatus();
  if (deterministic_ || m < onednn_min_rows_) {
    Gemv(x, m, k, wp, bf16, n, y, accumulate, *pool_);
    return absl::OkStatus();
  }
  try {
    dnnl::matmul& mm = impl_->Get(m, k, n, bf16);
    const void* src = x;
    if (bf16) {
      const size_t count = static_cast<size_t>(m) * k;
      if (impl_->x_bf16.size() < count) impl_->x_bf16 = common::AlignedBuffer<uint16_t>(count);
      for (size_t i = 0; i < count; ++i) impl_->x_bf16.data()[i] = common::FloatToBf16(x[i]);
      src = impl_->x_bf16.data();
    }
    float* dst = y;
    if (accumulate) {
      impl_->y_tmp.resize(static_cast<size_t>(m) * n);
      dst = impl_->y_tmp.data();
    }
    const dt in = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory src_m({{m, k}, in, tag::ab}, impl_->engine, const_cast<void*>(src));
    dnnl::memory wei_m({{k, n}, in, tag::ba}, impl_->engine, const_cast<void*>(wp));
    dnnl::memory dst_m({{m, n}, dt::f32, tag::ab}, impl_->engine, dst);
    mm.execute(impl_->stream,
               {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, wei_m}, {DNNL_ARG_DST, dst_m}});
    impl_->stream.wait();
    if (accumulate) {
      for (size_t i = 0; i < impl_->y_tmp.size(); ++i) y[i] += impl_->y_tmp[i];
    }
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul [", m, " x ", k, "] x [", k, " x ", n, "]: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace moe::engine
