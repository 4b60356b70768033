#include "moe_cache/trace.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace moe {
namespace moe_cache {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("bad .npy trace: ", what));
}

// Finds the value text of 'key' in the header dict (up to the next top-level comma or brace).
absl::StatusOr<std::string> HeaderValue(absl::string_view header, absl::string_view key) {
  const std::string quoted1 = absl::StrCat("'", key, "'");
  const std::string quoted2 = absl::StrCat("\"", key, "\"");
  size_t pos = header.find(quoted1);
  size_t len = quoted1.size();
  if (pos == absl::string_view::npos) {
    pos = header.find(quoted2);
    len = quoted2.size();
  }
  if (pos == absl::string_view::npos) return Bad(absl::StrCat("header has no '", key, "'"));
  size_t p = header.find(':', pos + len);
  if (p == absl::string_view::npos) return Bad(absl::StrCat("no ':' after '", key, "'"));
  ++p;
  int depth = 0;
  size_t end = p;
  for (; end < header.size(); ++end) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
    if (depth < 0) break;
  }
  return std::string(absl::StripAsciiWhitespace(header.substr(p, end - p)));
}

}  // namespace

int32_t Trace::MaxId() const {
  int32_t m = -1;
  for (int32_t v : ids) m = std::max(m, v);
  return m;
}

absl::StatusOr<Trace> ParseNpyTrace(const std::string& bytes) {
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    return Bad("missing \\x93NUMPY magic (not a .npy file)");
  }
  const uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0;
  size_t header_start = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) | (static_cast<uint8_t>(bytes[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Bad("truncated header length");
    header_len = 0;
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
    header_start = 12;
  } else {
    return Bad(absl::StrFormat("unsupported format version %d", major));
  }
  if (bytes.size() < header_start + header_len) return Bad("truncated header");
  const absl::string_view header(bytes.data() + header_start, header_len);

  auto descr_or = HeaderValue(header, "descr");
  if (!descr_or.ok()) return descr_or.status();
  std::string descr = *descr_or;
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"')) {
    return Bad(absl::StrCat("unreadable descr ", descr));
  }
  descr = descr.substr(1, descr.size() - 2);
  int width = 0;
  if (descr == "<i2" || descr == "i2") width = 2;
  else if (descr == "<i4" || descr == "i4") width = 4;
  else if (descr == "<i8" || descr == "i8") width = 8;
  else if (descr == "|i1" || descr == "i1") width = 1;
  else {
    return Bad(absl::StrCat("dtype ", descr,
                            " not supported (need little-endian signed int: <i2, <i4 or <i8)"));
  }
  auto fortran_or = HeaderValue(header, "fortran_order");
  if (!fortran_or.ok()) return fortran_or.status();
  if (*fortran_or != "False") return Bad("fortran_order arrays are not supported (need C order)");
  auto shape_or = HeaderValue(header, "shape");
  if (!shape_or.ok()) return shape_or.status();
  absl::string_view shape_text = *shape_or;
  if (!absl::ConsumePrefix(&shape_text, "(") || !absl::ConsumeSuffix(&shape_text, ")")) {
    return Bad(absl::StrCat("unreadable shape ", *shape_or));
  }
  std::vector<int64_t> dims;
  for (absl::string_view part : absl::StrSplit(shape_text, ',', absl::SkipWhitespace())) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return Bad(absl::StrCat("unreadable shape ", *shape_or));
    }
    dims.push_back(d);
  }
  if (dims.size() != 3) {
    return Bad(absl::StrCat("shape ", *shape_or, " is not 3-D [tokens, layers, k]"));
  }
  if (dims[0] > (1 << 30) || dims[1] > (1 << 20) || dims[2] > (1 << 20) ||
      dims[0] * dims[1] * dims[2] > (int64_t{1} << 32)) {
    return Bad(absl::StrCat("shape ", *shape_or, " too large"));
  }
  const int64_t count = dims[0] * dims[1] * dims[2];
  const size_t data_start = header_start + header_len;
  const size_t want = static_cast<size_t>(count) * width;
  if (bytes.size() - data_start != want) {
    return Bad(absl::StrFormat("data is %d bytes, shape %s of %d-byte ints needs %d",
                               bytes.size() - data_start, *shape_or, width, want));
  }
  Trace t;
  t.tokens = static_cast<int32_t>(dims[0]);
  t.layers = static_cast<int32_t>(dims[1]);
  t.k = static_cast<int32_t>(dims[2]);
  t.ids.resize(count);
  const unsigned char* d = reinterpret_cast<const unsigned char*>(bytes.data() + data_start);
  for (int64_t i = 0; i < count; ++i) {
    uint64_t u = 0;
    for (int b = 0; b < width; ++b) u |= static_cast<uint64_t>(d[i * width + b]) << (8 * b);
    // Sign-extend from `width` bytes.
    const int shift = 64 - 8 * width;
    const int64_t v = static_cast<int64_t>(u << shift) >> shift;
    if (v > std::numeric_limits<int32_t>::max()) {
      return Bad(absl::StrFormat("id %d at flat index %d does not fit int32", v, i));
    }
    t.ids[i] = v < 0 ? -1 : static_cast<int32_t>(v);
  }
  return t;
}

absl::StatusOr<Trace> ReadNpyTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = ParseNpyTrace(ss.str());
  if (!t.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", t.status().message()));
  }
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
