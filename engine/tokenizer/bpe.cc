#include "engine/tokenizer/bpe.h"

#include <queue>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/internal/utf8.h"

namespace moe::tokenizer {
namespace {

using nlohmann::json;

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: model: ", what));
}

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const json& model) {
  if (!model.is_object()) return Invalid("not an object");
  if (model.value("type", std::string("BPE")) != "BPE") {
    return Invalid(absl::StrCat("type ", model["type"].dump(), " is not supported (only BPE)"));
  }
  std::unique_ptr<BpeModel> bpe(new BpeModel());
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    if (!model["dropout"].is_number()) return Invalid("dropout is not a number");
    if (model["dropout"].get<double>() > 0) return Invalid("dropout > 0 is not supported");
  }
  auto get_string = [&](const char* key, std::string* out) -> absl::Status {
    if (!model.contains(key) || model[key].is_null()) return absl::OkStatus();
    if (!model[key].is_string()) return Invalid(absl::StrCat(key, " is not a string"));
    *out = model[key].get<std::string>();
    return absl::OkStatus();
  };
  auto get_bool = [&](const char* key, bool* out) -> absl::Status {
    if (!model.contains(key) || model[key].is_null()) return absl::OkStatus();
    if (!model[key].is_boolean()) return Invalid(absl::StrCat(key, " is not a boolean"));
    *out = model[key].get<bool>();
    return absl::OkStatus();
  };
  std::string unk;
  if (auto s = get_string("unk_token", &unk); !s.ok()) return s;
  if (auto s = get_string("continuing_subword_prefix", &bpe->continuing_subword_prefix_); !s.ok())
    return s;
  if (auto s = get_string("end_of_word_suffix", &bpe->end_of_word_suffix_); !s.ok()) return s;
  if (auto s = get_bool("fuse_unk", &bpe->fuse_unk_); !s.ok()) return s;
  if (auto s = get_bool("byte_fallback", &bpe->byte_fallback_); !s.ok()) return s;
  if (auto s = get_bool("ignore_merges", &bpe->ignore_merges_); !s.ok()) return s;

  if (!model.contains("vocab") || !model["vocab"].is_object())
    return Invalid("vocab is not an object");
  const json& vocab = model["vocab"];
  bpe->vocab_.reserve(vocab.size());
  int32_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > (1 << 30)) {
      return Invalid(absl::StrCat("vocab[", json(it.key()).dump(), "] is not a valid id"));
    }
    const int32_t id = it.value().get<int32_t>();
    bpe->vocab_[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  bpe->id_to_token_.assign(max_id + 1, std::string());
  bpe->id_present_.assign(max_id + 1, false);
  for (const auto& [token, id] : bpe->vocab_) {
    bpe->id_to_token_[id] = token;
    bpe->id_present_[id] = true;
  }
  if (!unk.empty()) {
    auto it = bpe->vocab_.find(unk);
    if (it == bpe->vocab_.end())
      return Invalid(absl::StrCat("unk_token ", unk, " is not in vocab"));
    bpe->unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bpe->vocab_.find(absl::StrFormat("<0x%02X>", b));
    bpe->byte_ids_[b] = it == bpe->vocab_.end() ? -1 : it->second;
  }

  if (model.contains("merges") && !model["merges"].is_null()) {
    const json& merges = model["merges"];
    if (!merges.is_array()) return Invalid("merges is not an array");
    bpe->merges_.reserve(merges.size());
    const size_t prefix_len = bpe->continuing_subword_prefix_.size();
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& m = merges[rank];
      std::string a, b;
      // Two spellings exist: "a b" (older files) and ["a", "b"] (newer, allows spaces).
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          return Invalid(absl::StrCat("merges[", rank, "] is not two tokens separated by a space"));
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        return Invalid(absl::StrCat("merges[", rank, "] is neither \"a b\" nor [\"a\", \"b\"]"));
      }
      auto ia = bpe->vocab_.find(a);
      auto ib = bpe->vocab_.find(b);
      if (ia == bpe->vocab_.end() || ib == bpe->vocab_.end()) {
        return Invalid(absl::StrCat("merges[", rank, "] names a token not in vocab"));
      }
      // The merged token drops the right side's continuing-subword prefix, as the reference does.
      std::string merged = a;
      if (prefix_len > 0 && b.compare(0, prefix_len, bpe->continuing_subword_prefix_) == 0) {
        merged.append(b, prefix_len, std::string::npos);
      } else {
        merged += b;
      }
      auto im = bpe->vocab_.find(merged);
      if (im == bpe->vocab_.end()) {
        return Invalid(absl::StrCat("merges[", rank, "]: merged token is not in vocab"));
      }
      // A pair listed twice keeps its last rank (the reference builds a map the same way).
      bpe->merges_[PairKey(ia->second, ib->second)] = {static_cast<int32_t>(rank), im->second};
    }
  }
  return bpe;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(internal::Av(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= size() || !id_present_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(internal::Av(word));
    if (it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  CacheShard* shard = nullptr;
  if (cacheable) {
    shard = &cache_[absl::HashOf(internal::Av(word)) % kCacheShards];
    absl::MutexLock lock(&shard->mu);
    auto it = shard->map.find(internal::Av(word));
    if (it != shard->map.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = ids->size();
  Merge(word, ids);
  if (cacheable) {
    absl::MutexLock lock(&shard->mu);
    // A full shard stops taking words: the common words of a text arrive early.
    if (shard->map.size() < kCacheEntriesPerShard) {
      shard->map.emplace(std::string(word),
                         std::vector<int32_t>(ids->begin() + before, ids->end()));
    }
  }
}

void BpeModel::Merge(std::string_view word, std::vector<int32_t>* ids) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool removed;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&](int32_t id) {
    const int32_t n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, false});
  };
  // Initial symbols: one per character, mirroring the reference's handling of unknown characters
  // (byte fallback first, then unk, fused when fuse_unk).
  int32_t pending_unk = -1;  // an unk id waiting to be fused or added
  std::string piece;
  size_t i = 0;
  while (i < word.size()) {
    const size_t start = i;
    size_t bad;
    size_t len = internal::WellFormedLength(word, i, &bad);
    if (len == 0) len = bad;
    i += len;
    std::string_view ch = word.substr(start, len);
    const bool decorated = (!continuing_subword_prefix_.empty() && start > 0) ||
                           (!end_of_word_suffix_.empty() && i == word.size());
    if (decorated) {
      piece.clear();
      if (start > 0) piece += continuing_subword_prefix_;
      piece.append(ch);
      if (i == word.size()) piece += end_of_word_suffix_;
      ch = piece;
    }
    auto it = vocab_.find(internal::Av(ch));
    if (it != vocab_.end()) {
      if (pending_unk >= 0) add(pending_unk);
      pending_unk = -1;
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        // The reference does not flush a pending unk here; neither do we.
        for (char c : ch) add(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk >= 0) add(pending_unk);

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    // priority_queue pops the largest: make that the lowest rank, then the leftmost.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Candidate> queue(std::less<Candidate>(), std::move(storage));
  for (size_t k = 0; k + 1 < symbols.size(); ++k) {
    auto it = merges_.find(PairKey(symbols[k].id, symbols[k + 1].id));
    if (it != merges_.end()) {
      queue.push({it->second.first, static_cast<int32_t>(k), it->second.second});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.removed || cur.next < 0) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[next_pos];
    // Entries go stale when a neighbour merged first; the reference checks only that the pair
    // now there merges into the same token, and so do we (identical results, quirks included).
    auto it = merges_.find(PairKey(cur.id, right.id));
    if (it == merges_.end() || it->second.second != top.new_id) continue;
    cur.id = top.new_id;
    cur.next = right.next;
    symbols[next_pos].removed = true;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      auto ip = merges_.find(PairKey(symbols[cur.prev].id, cur.id));
      if (ip != merges_.end()) queue.push({ip->second.first, cur.prev, ip->second.second});
    }
    if (cur.next >= 0) {
      auto in = merges_.find(PairKey(cur.id, symbols[cur.next].id));
      if (in != merges_.end()) queue.push({in->second.first, top.pos, in->second.second});
    }
  }
  for (const Symbol& s : symbols) {
    if (!s.removed) ids->push_back(s.id);
  }
}

}  // namespace moe::tokenizer
