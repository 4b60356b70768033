#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace moe::engine {
namespace {

using Json = nlohmann::json;

struct DtypeInfo {
  StDtype dtype;
  const char* name;
  int size;
};
constexpr DtypeInfo kDtypes[] = {
    {StDtype::kF64, "F64", 8},   {StDtype::kF32, "F32", 4},        {StDtype::kF16, "F16", 2},
    {StDtype::kBf16, "BF16", 2}, {StDtype::kF8E4M3, "F8_E4M3", 1}, {StDtype::kF8E5M2, "F8_E5M2", 1},
    {StDtype::kI64, "I64", 8},   {StDtype::kI32, "I32", 4},        {StDtype::kI16, "I16", 2},
    {StDtype::kI8, "I8", 1},     {StDtype::kU8, "U8", 1},          {StDtype::kBool, "BOOL", 1},
};

// The reference implementation's limit: a header above 100 MB is refused (and a lying length
// field must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxRank = 8;

std::string ReadWholeFile(const std::string& path, bool* ok) {
  std::ifstream in(path, std::ios::binary);
  *ok = static_cast<bool>(in);
  if (!*ok) return "";
  std::ostringstream ss;
  ss << in.rdbuf();
  *ok = !in.bad();
  return ss.str();
}

}  // namespace

const char* StDtypeName(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

absl::StatusOr<StDtype> ParseStDtype(std::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown safetensors dtype \"", std::string(name), "\""));
}

int StDtypeSize(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string StTensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated: ", f->size_,
                                                   " bytes, less than the 8-byte header length"));
  }
  // MAP_PRIVATE + PROT_READ: the loader copies tensors straight from the page cache into their
  // final place; nothing is read twice or held in an intermediate buffer.
  void* map = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  f->map_ = map;
  f->base_ = static_cast<const uint8_t*>(map);
  RETURN_IF_ERROR(f->Parse());
  return f;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string bytes, const std::string& origin) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = origin;
  f->owned_ = std::move(bytes);
  f->size_ = f->owned_.size();
  f->base_ = reinterpret_cast<const uint8_t*>(f->owned_.data());
  if (f->size_ < 8) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": truncated: ", f->size_,
                                                   " bytes, less than the 8-byte header length"));
  }
  RETURN_IF_ERROR(f->Parse());
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

const StTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::Parse() {
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base_[i];  // little-endian
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": header length ", header_len, " exceeds the 100 MB limit"));
  }
  if (header_len > size_ - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": truncated: header of ", header_len,
                                                   " bytes but the file has ", size_, " bytes"));
  }
  const char* hp = reinterpret_cast<const char*>(base_ + 8);
  Json header = Json::parse(hp, hp + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header is not a JSON object"));
  }
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = size_ - data_begin;
  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path_, ": __metadata__ must be an object"));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path_, ": __metadata__ value of \"", m.key(), "\" must be a string"));
        }
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor \"", name, "\": ", what));
    };
    if (!v.is_object()) return bad("entry must be an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string \"dtype\"");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array \"shape\"");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return bad("\"data_offsets\" must be [begin, end]");
    }
    StTensor t;
    t.name = name;
    absl::StatusOr<StDtype> dtype = ParseStDtype(dt->get<std::string>());
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    t.dtype = *dtype;
    if (sh->size() > static_cast<size_t>(kMaxRank)) return bad("rank above 8");
    // numel * size must not overflow: a product above the data size is refused before it can.
    bool any_zero = false;
    for (const Json& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        return bad("shape must hold non-negative integers");
      }
      if (d.get<uint64_t>() > (uint64_t{1} << 40)) return bad("dimension above 2^40");
      if (d.get<uint64_t>() == 0) any_zero = true;
    }
    uint64_t numel = any_zero ? 0 : 1;
    for (const Json& d : *sh) {
      const uint64_t dim = d.get<uint64_t>();
      if (!any_zero && numel > data_size / dim) {
        return bad(absl::StrCat("shape ", sh->dump(), " needs more bytes than the file holds (",
                                data_size, " bytes of data; file truncated or header lies)"));
      }
      if (!any_zero) numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t bytes = numel * static_cast<uint64_t>(StDtypeSize(t.dtype));
    for (const Json& o : *off) {
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0)) {
        return bad("data_offsets must be non-negative integers");
      }
    }
    const uint64_t begin = (*off)[0].get<uint64_t>();
    const uint64_t end = (*off)[1].get<uint64_t>();
    if (begin > end) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] end before they begin"));
    }
    if (end > data_size) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end,
                              "] run past the end of the data (", data_size,
                              " bytes; file truncated or header lies)"));
    }
    if (end - begin != bytes) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] hold ", end - begin,
                              " bytes but ", StDtypeName(t.dtype), " ", sh->dump(), " needs ",
                              bytes));
    }
    t.data = base_ + data_begin + begin;
    t.bytes = bytes;
    t.file = &path_;
    ranges.push_back({begin, end, tensors_.size()});
    tensors_.push_back(std::move(t));
  }
  // Overlap check over the ranges sorted by start (unsorted input is fine); empty tensors
  // overlap nothing.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (prev != nullptr && r.begin < prev->end) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": tensors \"", tensors_[prev->tensor].name, "\" [", prev->begin, ", ", prev->end,
          ") and \"", tensors_[r.tensor].name, "\" [", r.begin, ", ", r.end, ") overlap"));
    }
    prev = &r;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> c(new Checkpoint());
  const std::string index_path = dir + "/model.safetensors.index.json";
  bool ok = false;
  const std::string index_text = ReadWholeFile(index_path, &ok);
  if (!ok) {
    const std::string single = dir + "/model.safetensors";
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(single);
    if (!f.ok()) {
      if (absl::IsNotFound(f.status())) {
        return absl::NotFoundError(absl::StrCat(dir,
                                                ": neither model.safetensors nor "
                                                "model.safetensors.index.json can be opened"));
      }
      return f.status();
    }
    c->description_ = single;
    for (const StTensor& t : (*f)->tensors()) {
      c->tensors_[t.name] = &t;
      c->total_bytes_ += t.bytes;
    }
    c->files_.push_back(std::move(*f));
    return c;
  }
  c->description_ = index_path;
  Json index = Json::parse(index_text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
  }
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": missing \"weight_map\" object"));
  }
  std::unordered_map<std::string, SafetensorsFile*> shards;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry \"", it.key(), "\" must name a file"));
    }
    const std::string shard = it.value().get<std::string>();
    // A shard is a file in this folder: a path in it could read anything on the machine.
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry \"", it.key(),
                                                     "\" names \"", shard,
                                                     "\", not a file name in the folder"));
    }
    auto found = shards.find(shard);
    if (found == shards.end()) {
      ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f,
                       SafetensorsFile::Open(dir + "/" + shard));
      found = shards.emplace(shard, f.get()).first;
      c->files_.push_back(std::move(f));
    }
    const StTensor* t = found->second->Find(it.key());
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", it.key(),
                                                     "\" is mapped to ", found->second->path(),
                                                     ", which does not hold it"));
    }
    c->tensors_[it.key()] = t;
    c->total_bytes_ += t->bytes;
  }
  return c;
}

const StTensor* Checkpoint::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : it->second;
}

absl::Status SafetensorsWriter::Add(const std::string& name, StDtype dtype,
                                    std::vector<int64_t> shape, absl::Span<const uint8_t> bytes) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(absl::StrCat("bad tensor name \"", name, "\""));
  }
  for (const Entry& e : entries_) {
    if (e.name == name) return absl::InvalidArgumentError(absl::StrCat("duplicate tensor ", name));
  }
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative dimension"));
    numel *= static_cast<uint64_t>(d);
  }
  if (numel * StDtypeSize(dtype) != bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", bytes.size(), " bytes for ", numel,
                                                   " elements of ", StDtypeName(dtype)));
  }
  Entry e{name, dtype, std::move(shape), data_.size(), data_.size() + bytes.size()};
  data_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  entries_.push_back(std::move(e));
  return absl::OkStatus();
}

std::string SafetensorsWriter::Serialize() const {
  // nlohmann's default object is sorted by key; build the text by hand to keep insertion order
  // (which is also the data order, as the reference writer produces).
  std::string header = "{";
  bool first = true;
  if (!metadata_.empty()) {
    header += "\"__metadata__\":" + Json(metadata_).dump();
    first = false;
  }
  for (const Entry& e : entries_) {
    if (!first) header += ",";
    first = false;
    Json v = Json::object();
    v["dtype"] = std::string(StDtypeName(e.dtype));
    v["shape"] = e.shape;
    v["data_offsets"] = {e.begin, e.end};
    header += Json(e.name).dump() + ":" + v.dump();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += header;
  out += data_;
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  const std::string bytes = Serialize();
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace moe::engine
