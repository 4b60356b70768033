// Routing traces: the expert ids chosen per token and MoE layer, as an int array
// [tokens, layers, k] with -1 (any negative id) for padding; read from .npy files (NumPy format
// 1.0-3.0, little-endian int8/int16/int32/int64, C order) through common/npy.h, written as
// int16 or int32 .npy, and recorded step by step by TraceRecorder.
//
// Thread-safety: plain values; TraceRecorder is not thread-safe.
#ifndef MOE_MOE_CACHE_TRACE_H_
#define MOE_MOE_CACHE_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe {
namespace moe_cache {

struct Trace {
  int32_t tokens = 0;
  int32_t layers = 0;
  int32_t k = 0;
  std::vector<int32_t> ids;  // [tokens, layers, k] row-major

  const int32_t* Row(int32_t token, int32_t layer) const {
    return ids.data() + (static_cast<size_t>(token) * layers + layer) * k;
  }
  // Largest id in the trace, -1 if all padding.
  int32_t MaxId() const;
};

// Parses .npy bytes. InvalidArgument naming the problem (magic, version, header, dtype, order,
// shape, size) on bad input.
absl::StatusOr<Trace> ParseNpyTrace(const std::string& bytes);
absl::StatusOr<Trace> ReadNpyTrace(const std::string& path);
// Serializes as NumPy 1.0: '<i2' when every id fits in int16, else '<i4'.
std::string SerializeNpyTrace(const Trace& trace);
absl::Status WriteNpyTrace(const Trace& trace, const std::string& path);

// Records routing as it happens: Append(layer, ids [T, k]) for each layer of a step, then EndStep().
// A batched step (T tokens) becomes T consecutive trace tokens; layers never appended in a step are
// recorded as padding. Not thread-safe.
class TraceRecorder {
 public:
  TraceRecorder(int32_t layers, int32_t k) : layers_(layers), k_(k) {}
  absl::Status Append(int32_t layer, absl::Span<const int32_t> ids, int32_t tokens);
  absl::Status EndStep();
  const Trace& trace() const { return trace_; }
  Trace Take();

 private:
  int32_t layers_;
  int32_t k_;
  int32_t step_tokens_ = -1;  // T of the current step, -1 before its first Append
  std::vector<int32_t> step_;  // [T, layers, k] of the current step
  Trace trace_;
};

}  // namespace moe_cache
}  // namespace moe

#endif  // MOE_MOE_CACHE_TRACE_H_
