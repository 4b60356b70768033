// safetensors: a reader that maps checkpoint files (one file, or a sharded folder through
// model.safetensors.index.json) and validates every header before anything reads a tensor, and
// a writer for tools and tests.
//
// The reader never trusts a file: the header length, the JSON, every dtype, shape and offset pair
// are checked against the file size (overlapping ranges, ranges past the end, a byte count that
// does not match the shape are InvalidArgument naming the file and the tensor; unsorted ranges
// and holes are allowed, as the format's reference loader allows them). A validated tensor's
// bytes lie inside the mapping, so nothing downstream can read past it.
//
// Thread-safety: SafetensorsFile and Checkpoint are immutable after Open; concurrent readers need
// no locks. SafetensorsWriter is not thread-safe.
#ifndef MOE_ENGINE_SAFETENSORS_H_
#define MOE_ENGINE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe::engine {

enum class StDtype {
  kF64,
  kF32,
  kF16,
  kBf16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
};

// "F32", "BF16", "F8_E4M3", ... as safetensors spells them.
const char* StDtypeName(StDtype dtype);
absl::StatusOr<StDtype> ParseStDtype(std::string_view name);
int StDtypeSize(StDtype dtype);

// One validated tensor: `data` points into its file's mapping, `bytes` = numel * dtype size.
struct StTensor {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
  const std::string* file = nullptr;  // the path it came from (owned by its SafetensorsFile)

  int64_t numel() const;
  // "[2, 3]"
  std::string ShapeString() const;
};

// One .safetensors file, memory-mapped read-only (or held in memory, for FromBytes). Owns the
// mapping; StTensor pointers stay valid while it lives.
class SafetensorsFile {
 public:
  // NotFound if the file cannot be opened; InvalidArgument for a malformed file.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Parses bytes held in memory (tests, fuzzing); `origin` names them in errors.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string bytes,
                                                                    const std::string& origin);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  // nullptr when absent.
  const StTensor* Find(std::string_view name) const;
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string path_;
  std::string owned_;  // FromBytes only
  void* map_ = nullptr;
  uint64_t size_ = 0;
  const uint8_t* base_ = nullptr;
  std::vector<StTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A model folder's weights: model.safetensors, or model.safetensors.index.json and its shards.
// Owns the open files.
class Checkpoint {
 public:
  // The index wins when both exist (as transformers decides). NotFound when neither exists,
  // InvalidArgument for a bad index (bad JSON, a shard name with a path in it, a tensor the index
  // names that its shard lacks) or a bad shard.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // nullptr when absent.
  const StTensor* Find(std::string_view name) const;
  // Sum of every tensor's bytes (for progress reports).
  uint64_t total_tensor_bytes() const { return total_bytes_; }
  // Where errors about a missing tensor point: the index or the single file.
  const std::string& description() const { return description_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const StTensor*> tensors_;
  uint64_t total_bytes_ = 0;
  std::string description_;
};

// Builds a .safetensors file in memory, tensors in the order added, and writes it. The header is
// padded with spaces to a multiple of 8 bytes so that the data of every tensor whose offset is
// aligned stays aligned.
class SafetensorsWriter {
 public:
  // InvalidArgument for a duplicate name, "__metadata__", or bytes that do not match the shape.
  absl::Status Add(const std::string& name, StDtype dtype, std::vector<int64_t> shape,
                   absl::Span<const uint8_t> bytes);
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // The whole file's bytes.
  std::string Serialize() const;
  absl::Status WriteFile(const std::string& path) const;
  uint64_t data_bytes() const { return data_.size(); }

 private:
  struct Entry {
    std::string name;
    StDtype dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries_;
  std::string data_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moe::engine

#endif  // MOE_ENGINE_SAFETENSORS_H_
