// BpeModel: the "model" stage of a tokenizer.json whose model.type is "BPE": turns one
// pre-tokenized word into token ids by applying the ranked merges, as Hugging Face tokenizers'
// BPE does (lowest rank first, leftmost first among equal ranks), with byte_fallback, unk_token
// (fuse_unk), ignore_merges, continuing_subword_prefix and end_of_word_suffix.
//
// Owns its vocabulary, merge table and a word -> ids cache. Immutable after construction apart
// from the cache, which is internally synchronized (sharded mutexes): Tokenize is thread-safe.
#ifndef MOE_ENGINE_TOKENIZER_BPE_H_
#define MOE_ENGINE_TOKENIZER_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace moe::tokenizer {

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object. InvalidArgument for a malformed or unsupported
  // one (dropout > 0, a merge naming a token not in the vocabulary).
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model);

  // Appends the ids of `word` (one pre-tokenized piece, valid UTF-8) to *ids.
  void Tokenize(std::string_view word, std::vector<int32_t>* ids) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // nullptr for an id outside the vocabulary.
  const std::string* IdToToken(int32_t id) const;
  // Largest id + 1.
  int32_t size() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  BpeModel() = default;
  void Merge(std::string_view word, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;  // "" for ids the vocabulary skips
  std::vector<bool> id_present_;
  // (left id, right id) packed as left << 32 | right -> (rank, merged id).
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  // Byte-fallback ids of "<0x00>".."<0xFF>", -1 where absent.
  std::array<int32_t, 256> byte_ids_{};

  // The word cache: most words of running text repeat, and a hit skips the merge loop.
  static constexpr int kCacheShards = 16;
  static constexpr size_t kCacheEntriesPerShard = 4096;
  static constexpr size_t kMaxCachedWordBytes = 256;
  struct CacheShard {
    absl::Mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> map ABSL_GUARDED_BY(mu);
  };
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace moe::tokenizer

#endif  // MOE_ENGINE_TOKENIZER_BPE_H_
