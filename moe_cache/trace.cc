#include "moe_cache/trace.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/npy.h"
#include "common/status.h"

namespace moe {
namespace moe_cache {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("bad .npy trace: ", what));
}

// A parsed .npy array as a trace: integer ids of rank 3 [tokens, layers, k]; any negative id
// becomes -1.
absl::StatusOr<Trace> TraceFromArray(const common::NpyArray& a) {
  if (a.dtype != common::NpyDtype::kInt32) {
    return Bad("dtype float32: a trace holds integer ids ('<i2', '<i4', '<i8' or '|i1')");
  }
  const std::string shape = absl::StrCat("(", absl::StrJoin(a.shape, ", "), ")");
  if (a.shape.size() != 3) return Bad(absl::StrCat("shape ", shape, " is not 3-D [tokens, layers, k]"));
  if (a.shape[0] > (1 << 30) || a.shape[1] > (1 << 20) || a.shape[2] > (1 << 20) ||
      a.numel() > (int64_t{1} << 32)) {
    return Bad(absl::StrCat("shape ", shape, " too large"));
  }
  Trace t;
  t.tokens = static_cast<int32_t>(a.shape[0]);
  t.layers = static_cast<int32_t>(a.shape[1]);
  t.k = static_cast<int32_t>(a.shape[2]);
  t.ids = a.i32;
  for (int32_t& id : t.ids) id = id < 0 ? -1 : id;
  return t;
}

}  // namespace

int32_t Trace::MaxId() const {
  int32_t m = -1;
  for (int32_t v : ids) m = std::max(m, v);
  return m;
}

absl::StatusOr<Trace> ParseNpyTrace(const std::string& bytes) {
  ASSIGN_OR_RETURN(common::NpyArray a, common::ParseNpy(bytes, ".npy trace"));
  return TraceFromArray(a);
}

absl::StatusOr<Trace> ReadNpyTrace(const std::string& path) {
  ASSIGN_OR_RETURN(common::NpyArray a, common::ReadNpy(path));
  absl::StatusOr<Trace> t = TraceFromArray(a);
  if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", t.status().message()));
  return t;
}

std::string SerializeNpyTrace(const Trace& trace) {
  bool fits16 = true;
  for (int32_t v : trace.ids) fits16 &= (v >= -32768 && v <= 32767);
  const int width = fits16 ? 2 : 4;
  std::string header = absl::StrFormat(
      "{'descr': '%s', 'fortran_order': False, 'shape': (%d, %d, %d), }", fits16 ? "<i2" : "<i4",
      trace.tokens, trace.layers, trace.k);
  // Pad so that magic + version + len + header + '\n' is a multiple of 64.
  size_t total = kMagicLen + 2 + 2 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string out(kMagic, kMagicLen);
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.reserve(out.size() + trace.ids.size() * width);
  for (int32_t v : trace.ids) {
    const uint32_t u = static_cast<uint32_t>(v);
    for (int b = 0; b < width; ++b) out.push_back(static_cast<char>((u >> (8 * b)) & 0xff));
  }
  return out;
}

absl::Status WriteNpyTrace(const Trace& trace, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write trace file ", path));
  const std::string bytes = SerializeNpyTrace(trace);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

absl::Status TraceRecorder::Append(int32_t layer, absl::Span<const int32_t> ids, int32_t tokens) {
  if (layer < 0 || layer >= layers_) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d out of range [0, %d)", layer, layers_));
  }
  if (tokens <= 0 || static_cast<int64_t>(tokens) * k_ != static_cast<int64_t>(ids.size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ids has %d entries, expected tokens * k = %d * %d", ids.size(), tokens, k_));
  }
  if (step_tokens_ < 0) {
    step_tokens_ = tokens;
    step_.assign(static_cast<size_t>(tokens) * layers_ * k_, -1);
  } else if (tokens != step_tokens_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer %d has %d tokens but this step started with %d", layer, tokens, step_tokens_));
  }
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t j = 0; j < k_; ++j) {
      const int32_t v = ids[static_cast<size_t>(t) * k_ + j];
      step_[(static_cast<size_t>(t) * layers_ + layer) * k_ + j] = v < 0 ? -1 : v;
    }
  }
  return absl::OkStatus();
}

absl::Status TraceRecorder::EndStep() {
  if (step_tokens_ < 0) return absl::FailedPreconditionError("EndStep with no Append in the step");
  trace_.layers = layers_;
  trace_.k = k_;
  trace_.tokens += step_tokens_;
  trace_.ids.insert(trace_.ids.end(), step_.begin(), step_.end());
  step_tokens_ = -1;
  step_.clear();
  return absl::OkStatus();
}

Trace TraceRecorder::Take() {
  Trace t = std::move(trace_);
  trace_ = Trace();
  return t;
}

}  // namespace moe_cache
}  // namespace moe
