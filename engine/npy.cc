#include "engine/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace moe::engine {
namespace {

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a supported .npy file: ", what));
}

// The value text after 'key': in the header dict.
absl::StatusOr<std::string> Field(const std::string& header, const std::string& key) {
  const std::string k = "'" + key + "':";
  const size_t p = header.find(k);
  if (p == std::string::npos) return absl::InvalidArgumentError("no " + key);
  size_t b = p + k.size();
  while (b < header.size() && header[b] == ' ') ++b;
  size_t e = b;
  if (header[b] == '(') {
    e = header.find(')', b);
    if (e == std::string::npos) return absl::InvalidArgumentError("bad shape");
    return header.substr(b + 1, e - b - 1);
  }
  if (header[b] == '\'') {
    e = header.find('\'', b + 1);
    if (e == std::string::npos) return absl::InvalidArgumentError("bad " + key);
    return header.substr(b + 1, e - b - 1);
  }
  while (e < header.size() && header[e] != ',' && header[e] != '}') ++e;
  return header.substr(b, e - b);
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::vector<int32_t>> NpyArray::AsInt32() const {
  std::vector<int32_t> out(numel());
  if (dtype == "<i4") {
    std::memcpy(out.data(), data.data(), out.size() * 4);
  } else if (dtype == "<i8") {
    for (size_t i = 0; i < out.size(); ++i) {
      int64_t v;
      std::memcpy(&v, data.data() + i * 8, 8);
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
        return absl::InvalidArgumentError(absl::StrCat("id ", v, " does not fit int32"));
      }
      out[i] = static_cast<int32_t>(v);
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("dtype ", dtype, " is not an integer"));
  }
  return out;
}

absl::StatusOr<std::vector<float>> NpyArray::AsFloat32() const {
  if (dtype != "<f4") return absl::InvalidArgumentError(absl::StrCat("dtype ", dtype, " != <f4"));
  std::vector<float> out(numel());
  std::memcpy(out.data(), data.data(), out.size() * 4);
  return out;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) return Bad(path, "magic");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Bad(path, "header");
    header_len = 0;
    for (int i = 0; i < 4; ++i)
      header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  } else {
    return Bad(path, absl::StrCat("version ", major));
  }
  if (offset + header_len > bytes.size()) return Bad(path, "header past the end");
  const std::string header = bytes.substr(offset, header_len);
  NpyArray a;
  auto descr = Field(header, "descr");
  auto order = Field(header, "fortran_order");
  auto shape = Field(header, "shape");
  if (!descr.ok() || !order.ok() || !shape.ok()) return Bad(path, "header fields");
  a.dtype = *descr;
  if (a.dtype == "|i1" || (a.dtype != "<i4" && a.dtype != "<i8" && a.dtype != "<f4")) {
    return Bad(path, absl::StrCat("dtype ", a.dtype, " (want <i4, <i8 or <f4)"));
  }
  if (absl::StripAsciiWhitespace(*order) != "False") return Bad(path, "Fortran order");
  for (absl::string_view d : absl::StrSplit(*shape, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v) || v < 0) {
      return Bad(path, absl::StrCat("shape (", *shape, ")"));
    }
    a.shape.push_back(v);
  }
  const size_t elem = a.dtype == "<i8" ? 8 : 4;
  const size_t want = static_cast<size_t>(a.numel()) * elem;
  const size_t start = offset + header_len;
  if (bytes.size() - start != want) {
    return Bad(path, absl::StrCat(bytes.size() - start, " data bytes for shape (", *shape,
                                  "), want ", want));
  }
  a.data.assign(bytes.begin() + start, bytes.end());
  return a;
}

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data) {
  std::string dims;
  int64_t n = 1;
  for (int64_t d : shape) {
    absl::StrAppend(&dims, d, ",");
    n *= d;
  }
  if (shape.size() > 1) dims.pop_back();
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // Pad so that the data starts on a 64-byte boundary; the header ends with '\n'.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("cannot write ", path));
  const uint16_t len = static_cast<uint16_t>(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  const char l[2] = {static_cast<char>(len & 0xFF), static_cast<char>(len >> 8)};
  f.write(l, 2);
  f.write(header.data(), header.size());
  f.write(reinterpret_cast<const char*>(data), n * sizeof(float));
  if (!f) return absl::InternalError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace moe::engine
