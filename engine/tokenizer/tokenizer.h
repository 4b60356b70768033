// Tokenizer: a Hugging Face tokenizer.json read into a pipeline of small parts, mirroring the
// reference library's shape: normalizer -> pre-tokenizer -> model (BPE) -> post-processor, and a
// decoder. Added tokens are matched before the pipeline and never merged.
//
// Immutable after construction: every const method is thread-safe.
#ifndef MOE_ENGINE_TOKENIZER_TOKENIZER_H_
#define MOE_ENGINE_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe::tokenizer {

class Tokenizer {
 public:
  // Reads a tokenizer.json. InvalidArgument (naming the file and the JSON path) for anything the
  // file gets wrong or that this implementation does not support.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json);
  // Reads DIR/tokenizer.json.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDirectory(const std::string& dir);

  virtual ~Tokenizer() = default;

  // Text (any bytes: invalid UTF-8 is replaced by U+FFFD as Python's 'replace' does) to ids, as
  // HF tokenizers' encode(text, add_special_tokens) does.
  virtual std::vector<int32_t> Encode(std::string_view text,
                                      bool add_special_tokens = false) const = 0;
  // Ids to text, as HF tokenizers' decode(ids, skip_special_tokens). Ids outside the vocabulary
  // are skipped.
  virtual std::string Decode(absl::Span<const int32_t> ids,
                             bool skip_special_tokens = false) const = 0;

  // Vocabulary size including added tokens (largest id + 1).
  virtual int vocab_size() const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  // The token's string as stored in the vocabulary ("" for an unknown id).
  virtual std::string IdToToken(int32_t id) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
};

// Streaming detokenization: feed ids one at a time, get back text pieces that never split a
// UTF-8 sequence; the pieces of a stream concatenated equal Decode() of all its ids.
// Not thread-safe (one per stream); the tokenizer must outlive it.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  // Text that became final with this id (may be empty while a UTF-8 sequence is incomplete).
  std::string Add(int32_t id);
  // Whatever is still held back (incomplete UTF-8 at the end of the stream, as U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;
  size_t read_offset_ = 0;
};

}  // namespace moe::tokenizer

#endif  // MOE_ENGINE_TOKENIZER_TOKENIZER_H_
