#include "common/npy.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe::common {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// A cursor over the header's Python dict literal, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class DictParser {
 public:
  explicit DictParser(std::string_view s) : s_(s) {}

  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n')) ++i_;
  }
  bool Eat(char c) {
    SkipSpace();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool Peek(char c) {
    SkipSpace();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool String(std::string* out) {
    SkipSpace();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) return false;
    const char q = s_[i_++];
    const size_t start = i_;
    while (i_ < s_.size() && s_[i_] != q) ++i_;
    if (i_ >= s_.size()) return false;
    *out = std::string(s_.substr(start, i_ - start));
    ++i_;
    return true;
  }
  bool Word(std::string* out) {
    SkipSpace();
    const size_t start = i_;
    while (i_ < s_.size() && std::isalpha(static_cast<unsigned char>(s_[i_]))) ++i_;
    *out = std::string(s_.substr(start, i_ - start));
    return !out->empty();
  }
  bool Int(int64_t* out) {
    SkipSpace();
    const size_t start = i_;
    uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (v > (uint64_t{1} << 50)) return false;  // no real dimension is this large
      v = v * 10 + (s_[i_] - '0');
      ++i_;
    }
    if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 longs in old files
    *out = static_cast<int64_t>(v);
    return i_ > start;
  }
  bool Done() {
    SkipSpace();
    return i_ == s_.size();
  }

 private:
  std::string_view s_;
  size_t i_ = 0;
};

absl::Status Bad(const std::string& origin, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": bad .npy file: ", what));
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes, const std::string& origin) {
  if (bytes.size() < kMagicLen + 4 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    return Bad(origin, "missing the \\x93NUMPY magic");
  }
  const int major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len =
        static_cast<uint8_t>(bytes[8]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Bad(origin, "truncated header length");
    for (int i = 3; i >= 0; --i)
      header_len = (header_len << 8) | static_cast<uint8_t>(bytes[8 + i]);
    header_start = 12;
  } else {
    return Bad(origin, absl::StrCat("unsupported format version ", major));
  }
  if (header_len > bytes.size() - header_start) {
    return Bad(origin, absl::StrCat("header of ", header_len, " bytes runs past the end of the ",
                                    bytes.size(), "-byte file"));
  }
  DictParser p(bytes.substr(header_start, header_len));
  std::string descr;
  bool have_descr = false, have_order = false, have_shape = false, fortran = false;
  NpyArray a;
  if (!p.Eat('{')) return Bad(origin, "header is not a dict");
  while (!p.Eat('}')) {
    std::string key;
    if (!p.String(&key) || !p.Eat(':')) return Bad(origin, "malformed header dict");
    if (key == "descr") {
      if (!p.String(&descr)) return Bad(origin, "descr must be a string");
      have_descr = true;
    } else if (key == "fortran_order") {
      std::string w;
      if (!p.Word(&w) || (w != "True" && w != "False")) {
        return Bad(origin, "fortran_order must be True or False");
      }
      fortran = w == "True";
      have_order = true;
    } else if (key == "shape") {
      if (!p.Eat('(')) return Bad(origin, "shape must be a tuple");
      while (!p.Eat(')')) {
        int64_t d = 0;
        if (!p.Int(&d)) return Bad(origin, "shape must hold non-negative integers");
        a.shape.push_back(d);
        if (a.shape.size() > 32) return Bad(origin, "rank above 32");
        if (!p.Eat(',') && !p.Peek(')')) return Bad(origin, "malformed shape tuple");
      }
      have_shape = true;
    } else {
      return Bad(origin, absl::StrCat("unexpected header key '", key, "'"));
    }
    if (!p.Eat(',') && !p.Peek('}')) return Bad(origin, "malformed header dict");
  }
  if (!p.Done()) return Bad(origin, "text after the header dict");
  if (!have_descr || !have_order || !have_shape) {
    return Bad(origin, "header needs descr, fortran_order and shape");
  }
  if (fortran) return Bad(origin, "Fortran-order arrays are not supported (save C order)");
  int itemsize = 0;
  if (descr == "<f4") {
    a.dtype = NpyDtype::kFloat32;
    itemsize = 4;
  } else if (descr == "<i4") {
    a.dtype = NpyDtype::kInt32;
    itemsize = 4;
  } else if (descr == "<i8") {
    a.dtype = NpyDtype::kInt32;
    itemsize = 8;
  } else if (descr == "<i2") {
    a.dtype = NpyDtype::kInt32;
    itemsize = 2;
  } else if (descr == "|i1") {
    a.dtype = NpyDtype::kInt32;
    itemsize = 1;
  } else {
    return Bad(origin, absl::StrCat("dtype '", descr,
                                    "' is not supported (supported: '<f4', '<i4', '<i8', '<i2', "
                                    "'|i1')"));
  }
  // Element count without overflow: each factor is checked against the bytes available.
  const size_t data_start = header_start + header_len;
  const uint64_t avail = bytes.size() - data_start;
  uint64_t numel = 1;
  bool zero = false;
  for (int64_t d : a.shape) zero = zero || d == 0;
  if (zero) numel = 0;
  for (int64_t d : a.shape) {
    if (zero) break;
    if (numel > avail / static_cast<uint64_t>(d)) {
      return Bad(origin, absl::StrCat("shape (", absl::StrJoin(a.shape, ", "),
                                      ") needs more data than the file holds"));
    }
    numel *= static_cast<uint64_t>(d);
  }
  if (numel * itemsize != avail) {
    return Bad(origin,
               absl::StrCat("shape (", absl::StrJoin(a.shape, ", "), ") of ", descr, " needs ",
                            numel * itemsize, " data bytes, the file has ", avail));
  }
  const char* data = bytes.data() + data_start;
  if (a.dtype == NpyDtype::kFloat32) {
    a.f32.resize(numel);
    std::memcpy(a.f32.data(), data, numel * 4);
  } else if (itemsize == 4) {
    a.i32.resize(numel);
    std::memcpy(a.i32.data(), data, numel * 4);
  } else if (itemsize == 2) {
    a.i32.resize(numel);
    for (uint64_t i = 0; i < numel; ++i) {
      int16_t v;
      std::memcpy(&v, data + 2 * i, 2);
      a.i32[i] = v;
    }
  } else if (itemsize == 1) {
    a.i32.resize(numel);
    for (uint64_t i = 0; i < numel; ++i) a.i32[i] = static_cast<int8_t>(data[i]);
  } else {
    a.i32.resize(numel);
    for (uint64_t i = 0; i < numel; ++i) {
      int64_t v;
      std::memcpy(&v, data + 8 * i, 8);
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
        return Bad(origin, absl::StrCat("int64 element ", i, " = ", v, " does not fit int32"));
      }
      a.i32[i] = static_cast<int32_t>(v);
    }
  }
  return a;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ParseNpy(ss.str(), path);
}

absl::StatusOr<std::string> SerializeNpy(const NpyArray& a) {
  for (int64_t d : a.shape) {
    if (d < 0) return absl::InvalidArgumentError("npy: negative dimension");
  }
  const bool f32 = a.dtype == NpyDtype::kFloat32;
  const size_t n = f32 ? a.f32.size() : a.i32.size();
  if (static_cast<int64_t>(n) != a.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: ", n, " elements for shape (", absl::StrJoin(a.shape, ", "), ")"));
  }
  // numpy's repr of the shape tuple: "(3,)" for rank 1, "()" for a scalar.
  std::string shape = "(" + absl::StrJoin(a.shape, ", ");
  if (a.shape.size() == 1) shape += ",";
  shape += ")";
  std::string header = absl::StrCat("{'descr': '", f32 ? "<f4" : "<i4",
                                    "', 'fortran_order': False, 'shape': ", shape, ", }");
  // numpy pads with spaces so that magic + version + length + header + '\n' is a multiple of 64.
  int major = 1;
  size_t prefix = kMagicLen + 2 + 2;
  if (((header.size() + 1 + prefix + 63) / 64) * 64 - prefix > 65535) {
    major = 2;
    prefix = kMagicLen + 2 + 4;
  }
  const size_t total = ((prefix + header.size() + 1 + 63) / 64) * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header += '\n';
  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(major);
  out += '\0';
  const size_t hl = header.size();
  for (int i = 0; i < (major == 1 ? 2 : 4); ++i) out += static_cast<char>((hl >> (8 * i)) & 0xFF);
  out += header;
  if (f32) {
    out.append(reinterpret_cast<const char*>(a.f32.data()), n * 4);
  } else {
    out.append(reinterpret_cast<const char*>(a.i32.data()), n * 4);
  }
  return out;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  absl::StatusOr<std::string> bytes = SerializeNpy(array);
  if (!bytes.ok()) return bytes.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

absl::Status WriteNpyFloat32(const std::string& path, std::vector<int64_t> shape,
                             absl::Span<const float> data) {
  NpyArray a;
  a.dtype = NpyDtype::kFloat32;
  a.shape = std::move(shape);
  a.f32.assign(data.begin(), data.end());
  return WriteNpy(path, a);
}

absl::Status WriteNpyInt32(const std::string& path, std::vector<int64_t> shape,
                           absl::Span<const int32_t> data) {
  NpyArray a;
  a.dtype = NpyDtype::kInt32;
  a.shape = std::move(shape);
  a.i32.assign(data.begin(), data.end());
  return WriteNpy(path, a);
}

}  // namespace moe::common
