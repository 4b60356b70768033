// The tokenizer.json pipeline: added tokens -> normalizer -> pre-tokenizer -> BPE ->
// post-processor, and the decoder chain. Each stage is a small value type read from its own JSON
// object, as in the reference library; unknown stage types are InvalidArgument naming the JSON
// path.
#include "engine/tokenizer/tokenizer.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "engine/tokenizer/bpe.h"
#include "engine/tokenizer/internal/utf8.h"
#include "nlohmann/json.hpp"

namespace moe::tokenizer {
namespace {

using nlohmann::json;

absl::Status Invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", path, ": ", what));
}

std::string TypeOf(const json& j) {
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) return "";
  return it->get<std::string>();
}

bool GetBool(const json& j, const char* key, bool def) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : def;
}

// ---------------------------------------------------------------------------------------------
// Byte-level alphabet (GPT-2's bytes_to_unicode): printable Latin-1 bytes map to themselves, the
// others to U+0100 onwards, so every byte string becomes printable text.

struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 512> cp_to_byte;  // -1 where the code point is not in the alphabet

  ByteLevelAlphabet() {
    cp_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp = printable ? b : 256 + n++;
      internal::AppendUtf8(cp, &byte_to_utf8[b]);
      cp_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet* const alphabet = new ByteLevelAlphabet();
  return *alphabet;
}

// The bytes a byte-level token stands for; a token with a character outside the alphabet (an
// added token such as "<think>" is inside it; one in another script is not) stands for its own
// UTF-8, as the reference decoder does.
std::string ByteLevelBytes(std::string_view token) {
  const ByteLevelAlphabet& a = Alphabet();
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const char32_t cp = internal::NextCodePoint(token, &i);
    if (cp >= a.cp_to_byte.size() || a.cp_to_byte[cp] < 0) return std::string(token);
    out.push_back(static_cast<char>(a.cp_to_byte[cp]));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// ICU helpers.

std::string ToUtf8(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

// Unicode White_Space, as Rust's char::is_whitespace.
bool IsWhitespace(char32_t c) { return u_hasBinaryProperty(c, UCHAR_WHITE_SPACE); }
// Rust's char::is_alphanumeric (Alphabetic or Numeric) or '_': a "word" character for
// single_word added tokens.
bool IsWordChar(char32_t c) {
  if (c == '_') return true;
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC)) return true;
  const int8_t t = u_charType(c);
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

char32_t LastCodePoint(std::string_view s) {
  size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i > 0) --i;
  return internal::NextCodePoint(s, &i);
}

// ---------------------------------------------------------------------------------------------
// Normalizers.

struct Normalizer {
  enum class Kind { kIcu, kLowercase, kPrepend, kReplace };
  Kind kind = Kind::kIcu;
  const icu::Normalizer2* icu = nullptr;
  std::string text;         // kPrepend: what to prepend; kReplace: the pattern
  std::string replacement;  // kReplace

  void Apply(std::string* s) const {
    switch (kind) {
      case Kind::kIcu: {
        UErrorCode status = U_ZERO_ERROR;
        // Most text is already normalized (and ASCII always is): skip the copy then.
        bool ascii = true;
        for (char c : *s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
        if (ascii || icu->isNormalizedUTF8(*s, status)) return;
        status = U_ZERO_ERROR;
        std::string out;
        icu::StringByteSink<std::string> sink(&out);
        icu->normalizeUTF8(0, *s, sink, nullptr, status);
        if (U_SUCCESS(status)) *s = std::move(out);
        return;
      }
      case Kind::kLowercase: {
        icu::UnicodeString u = icu::UnicodeString::fromUTF8(*s);
        u.toLower(icu::Locale::getRoot());
        *s = ToUtf8(u);
        return;
      }
      case Kind::kPrepend:
        if (!s->empty()) s->insert(0, text);
        return;
      case Kind::kReplace:
        if (!text.empty()) *s = absl::StrReplaceAll(*s, {{text, replacement}});
        return;
    }
  }
};

absl::Status ParseNormalizer(const json& j, const std::string& path, std::vector<Normalizer>* out) {
  if (j.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(j);
  UErrorCode status = U_ZERO_ERROR;
  Normalizer n;
  if (type == "Sequence") {
    auto it = j.find("normalizers");
    if (it == j.end() || !it->is_array()) return Invalid(path, "Sequence without normalizers");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(ParseNormalizer((*it)[i], absl::StrCat(path, ".normalizers[", i, "]"), out));
    }
    return absl::OkStatus();
  } else if (type == "NFC") {
    n.kind = Normalizer::Kind::kIcu;
    n.icu = icu::Normalizer2::getNFCInstance(status);
  } else if (type == "NFD") {
    n.kind = Normalizer::Kind::kIcu;
    n.icu = icu::Normalizer2::getNFDInstance(status);
  } else if (type == "NFKC") {
    n.kind = Normalizer::Kind::kIcu;
    n.icu = icu::Normalizer2::getNFKCInstance(status);
  } else if (type == "NFKD") {
    n.kind = Normalizer::Kind::kIcu;
    n.icu = icu::Normalizer2::getNFKDInstance(status);
  } else if (type == "Lowercase") {
    n.kind = Normalizer::Kind::kLowercase;
  } else if (type == "Prepend") {
    n.kind = Normalizer::Kind::kPrepend;
    if (!j.contains("prepend") || !j["prepend"].is_string()) return Invalid(path, "no prepend");
    n.text = j["prepend"].get<std::string>();
  } else if (type == "Replace") {
    n.kind = Normalizer::Kind::kReplace;
    auto p = j.find("pattern");
    if (p == j.end() || !p->contains("String") || !(*p)["String"].is_string() ||
        !j.contains("content") || !j["content"].is_string()) {
      return Invalid(path, "Replace is supported with a String pattern only");
    }
    n.text = (*p)["String"].get<std::string>();
    n.replacement = j["content"].get<std::string>();
  } else {
    return Invalid(path, absl::StrCat("normalizer type \"", type, "\" is not supported"));
  }
  if (U_FAILURE(status)) return absl::InternalError("ICU normalizer unavailable");
  out->push_back(std::move(n));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers. Each one maps a list of pieces to a finer list; pieces are byte ranges of the
// text they came from, or owned strings once a stage rewrote them (ByteLevel).

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The GPT-2 pattern ByteLevel uses when use_regex is set.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::atomic<uint64_t> next_regex_serial{1};

// A compiled ICU pattern. RegexPattern is immutable and shareable; a RegexMatcher is not, so each
// thread keeps its own, created on first use (keyed by a serial number, never by address, so a
// destroyed pattern's matcher is never reused).
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern, bool literal,
                                                        const std::string& path) {
    UErrorCode status = U_ZERO_ERROR;
    UParseError perr;
    std::unique_ptr<Regex> r(new Regex());
    r->pattern_.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern),
                                                 literal ? UREGEX_LITERAL : 0, perr, status));
    if (U_FAILURE(status)) {
      return Invalid(path, absl::StrCat("regex does not compile (", u_errorName(status),
                                        " at offset ", perr.offset, "): ", pattern));
    }
    r->serial_ = next_regex_serial.fetch_add(1);
    return r;
  }

  // Calls fn(begin, end) for each non-empty match in `text` (byte offsets).
  template <typename Fn>
  void ForEachMatch(std::string_view text, Fn fn) const {
    struct PerThread {
      absl::flat_hash_map<uint64_t, std::unique_ptr<icu::RegexMatcher>> matchers;
      icu::UnicodeString utf16;
    };
    thread_local PerThread tls;
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher>& m = tls.matchers[serial_];
    if (!m) {
      m.reset(pattern_->matcher(status));
      if (U_FAILURE(status)) return;
    }
    // ICU's regex engine is fastest on UTF-16; match offsets are mapped back to byte offsets by
    // one forward walk (matches come in increasing order).
    tls.utf16.setTo(icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), text.size())));
    m->reset(tls.utf16);
    size_t byte = 0;
    int32_t unit = 0;
    auto to_byte = [&](int32_t target) {
      while (unit < target && byte < text.size()) {
        const unsigned char c = static_cast<unsigned char>(text[byte]);
        const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        byte += len;
        unit += len == 4 ? 2 : 1;
      }
      return byte;
    };
    while (m->find()) {
      const int32_t b = m->start(status);
      const int32_t e = m->end(status);
      if (U_FAILURE(status)) break;
      const size_t bb = to_byte(b);
      const size_t eb = to_byte(e);
      if (eb > bb) fn(bb, eb);
    }
  }

 private:
  std::unique_ptr<icu::RegexPattern> pattern_;
  uint64_t serial_ = 0;
};

struct PreTokenizer {
  enum class Kind { kSplit, kByteLevel };
  Kind kind;
  std::shared_ptr<Regex> regex;  // kSplit; kByteLevel when use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

absl::StatusOr<SplitBehavior> ParseBehavior(const json& j, const std::string& path) {
  const std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return Invalid(path, absl::StrCat("split behavior ", j.dump(), " is not supported"));
}

absl::Status ParsePreTokenizer(const json& j, const std::string& path,
                               std::vector<PreTokenizer>* out) {
  if (j.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) return Invalid(path, "Sequence without pretokenizers");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(
          ParsePreTokenizer((*it)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  PreTokenizer p;
  if (type == "Split") {
    p.kind = PreTokenizer::Kind::kSplit;
    auto pat = j.find("pattern");
    if (pat == j.end() || !pat->is_object()) return Invalid(path, "Split without pattern");
    std::string source;
    bool literal;
    if (pat->contains("Regex") && (*pat)["Regex"].is_string()) {
      source = (*pat)["Regex"].get<std::string>();
      literal = false;
    } else if (pat->contains("String") && (*pat)["String"].is_string()) {
      source = (*pat)["String"].get<std::string>();
      literal = true;
    } else {
      return Invalid(path, "Split pattern is neither Regex nor String");
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> r, Regex::Compile(source, literal, path + ".pattern"));
    p.regex = std::move(r);
    ASSIGN_OR_RETURN(p.behavior, ParseBehavior(j.value("behavior", json()), path + ".behavior"));
    p.invert = GetBool(j, "invert", false);
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::Kind::kByteLevel;
    p.add_prefix_space = GetBool(j, "add_prefix_space", true);
    if (GetBool(j, "use_regex", true)) {
      ASSIGN_OR_RETURN(std::unique_ptr<Regex> r, Regex::Compile(kGpt2Pattern, false, path));
      p.regex = std::move(r);
    }
  } else {
    return Invalid(path, absl::StrCat("pre_tokenizer type \"", type, "\" is not supported"));
  }
  out->push_back(std::move(p));
  return absl::OkStatus();
}

// Splits `piece` by `regex` with the reference's behaviors; appends non-empty parts to *out.
void SplitPiece(const Regex& regex, SplitBehavior behavior, bool invert, std::string_view piece,
                std::vector<std::string>* out) {
  struct Part {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  regex.ForEachMatch(piece, [&](size_t b, size_t e) {
    if (b > prev) parts.push_back({prev, b, false});
    parts.push_back({b, e, true});
    prev = e;
  });
  if (prev < piece.size()) parts.push_back({prev, piece.size(), false});
  if (invert) {
    for (Part& p : parts) p.is_match = !p.is_match;
  }
  std::vector<Part> merged;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      merged = std::move(parts);
      break;
    case SplitBehavior::kRemoved:
      for (const Part& p : parts) {
        if (!p.is_match) merged.push_back(p);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Part& p : parts) {
        if (p.is_match && !previous_match && !merged.empty()) {
          merged.back().end = p.end;
        } else {
          merged.push_back(p);
        }
        previous_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !merged.empty()) {
          merged.back().begin = it->begin;
        } else {
          merged.push_back(*it);
        }
        previous_match = it->is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    }
    case SplitBehavior::kContiguous:
      for (const Part& p : parts) {
        if (!merged.empty() && merged.back().is_match == p.is_match) {
          merged.back().end = p.end;
        } else {
          merged.push_back(p);
        }
      }
      break;
  }
  for (const Part& p : merged) {
    if (p.end > p.begin) out->emplace_back(piece.substr(p.begin, p.end - p.begin));
  }
}

// ---------------------------------------------------------------------------------------------
// Decoders: each maps the list of token strings to a new list; the results are concatenated.

struct Decoder {
  enum class Kind { kByteLevel, kByteFallback, kFuse, kReplace, kStrip };
  Kind kind;
  std::string pattern, content;  // kReplace (String pattern); kStrip: content
  int start = 0, stop = 0;       // kStrip
};

absl::Status ParseDecoder(const json& j, const std::string& path, std::vector<Decoder>* out) {
  if (j.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(j);
  Decoder d;
  if (type == "Sequence") {
    auto it = j.find("decoders");
    if (it == j.end() || !it->is_array()) return Invalid(path, "Sequence without decoders");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(ParseDecoder((*it)[i], absl::StrCat(path, ".decoders[", i, "]"), out));
    }
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    d.kind = Decoder::Kind::kByteLevel;
  } else if (type == "ByteFallback") {
    d.kind = Decoder::Kind::kByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::Kind::kFuse;
  } else if (type == "Replace") {
    d.kind = Decoder::Kind::kReplace;
    auto p = j.find("pattern");
    if (p == j.end() || !p->contains("String") || !(*p)["String"].is_string() ||
        !j.contains("content") || !j["content"].is_string()) {
      return Invalid(path, "Replace is supported with a String pattern only");
    }
    d.pattern = (*p)["String"].get<std::string>();
    d.content = j["content"].get<std::string>();
  } else if (type == "Strip") {
    d.kind = Decoder::Kind::kStrip;
    if (!j.contains("content") || !j["content"].is_string()) return Invalid(path, "no content");
    d.content = j["content"].get<std::string>();
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
  } else {
    return Invalid(path, absl::StrCat("decoder type \"", type, "\" is not supported"));
  }
  out->push_back(std::move(d));
  return absl::OkStatus();
}

void ApplyDecoder(const Decoder& d, std::vector<std::string>* tokens) {
  switch (d.kind) {
    case Decoder::Kind::kByteLevel: {
      std::string bytes;
      for (const std::string& t : *tokens) bytes += ByteLevelBytes(t);
      tokens->assign(1, internal::IsValidUtf8(bytes) ? bytes : internal::ReplaceInvalidUtf8(bytes));
      return;
    }
    case Decoder::Kind::kByteFallback: {
      std::vector<std::string> out;
      std::string pending;
      int pending_count = 0;
      auto flush = [&] {
        if (pending_count == 0) return;
        if (internal::IsValidUtf8(pending)) {
          out.push_back(pending);
        } else {
          // The reference gives one U+FFFD per byte token of an invalid run.
          for (int i = 0; i < pending_count; ++i) out.push_back(internal::kReplacementUtf8);
        }
        pending.clear();
        pending_count = 0;
      };
      for (const std::string& t : *tokens) {
        const auto hex = [](char c) -> int {
          if (c >= '0' && c <= '9') return c - '0';
          if (c >= 'A' && c <= 'F') return c - 'A' + 10;
          return -1;
        };
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && hex(t[3]) >= 0 &&
            hex(t[4]) >= 0) {
          pending.push_back(static_cast<char>(hex(t[3]) * 16 + hex(t[4])));
          ++pending_count;
        } else {
          flush();
          out.push_back(t);
        }
      }
      flush();
      *tokens = std::move(out);
      return;
    }
    case Decoder::Kind::kFuse: {
      std::string all;
      for (const std::string& t : *tokens) all += t;
      tokens->assign(1, all);
      return;
    }
    case Decoder::Kind::kReplace:
      for (std::string& t : *tokens) t = absl::StrReplaceAll(t, {{d.pattern, d.content}});
      return;
    case Decoder::Kind::kStrip:
      for (std::string& t : *tokens) {
        for (int i = 0;
             i < d.start && !d.content.empty() && t.compare(0, d.content.size(), d.content) == 0;
             ++i) {
          t.erase(0, d.content.size());
        }
        for (int i = 0; i < d.stop && !d.content.empty() && t.size() >= d.content.size() &&
                        t.compare(t.size() - d.content.size(), d.content.size(), d.content) == 0;
             ++i) {
          t.resize(t.size() - d.content.size());
        }
      }
      return;
  }
}

// ---------------------------------------------------------------------------------------------
// Post-processor: special tokens around the sequence when add_special_tokens is set.

struct PostProcessor {
  std::vector<int32_t> prefix, suffix;
};

absl::Status ParsePostProcessor(const json& j, const std::string& path, PostProcessor* out) {
  if (j.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(j);
  if (type == "Sequence") {
    auto it = j.find("processors");
    if (it == j.end() || !it->is_array()) return Invalid(path, "Sequence without processors");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(
          ParsePostProcessor((*it)[i], absl::StrCat(path, ".processors[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    auto id_of = [&](const char* key, int32_t* id) -> absl::Status {
      auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer()) {
        return Invalid(path, absl::StrCat(key, " is not [token, id]"));
      }
      *id = (*it)[1].get<int32_t>();
      return absl::OkStatus();
    };
    int32_t cls, sep;
    RETURN_IF_ERROR(id_of("cls", &cls));
    RETURN_IF_ERROR(id_of("sep", &sep));
    out->prefix.insert(out->prefix.begin(), cls);
    out->suffix.push_back(sep);
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    auto single = j.find("single");
    auto specials = j.find("special_tokens");
    if (single == j.end() || !single->is_array() || specials == j.end() || !specials->is_object()) {
      return Invalid(path, "TemplateProcessing without single or special_tokens");
    }
    bool seen_sequence = false;
    std::vector<int32_t> prefix, suffix;
    for (const json& item : *single) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
      } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id")) {
        const json& name = item["SpecialToken"]["id"];
        if (!name.is_string() || !specials->contains(name.get<std::string>())) {
          return Invalid(path, absl::StrCat("special token ", name.dump(), " is not defined"));
        }
        const json& ids = (*specials)[name.get<std::string>()]["ids"];
        if (!ids.is_array()) return Invalid(path, "special token without ids");
        for (const json& id : ids) {
          if (!id.is_number_integer()) return Invalid(path, "special token id is not an integer");
          (seen_sequence ? suffix : prefix).push_back(id.get<int32_t>());
        }
      } else {
        return Invalid(path, "template item is neither Sequence nor SpecialToken");
      }
    }
    out->prefix.insert(out->prefix.begin(), prefix.begin(), prefix.end());
    out->suffix.insert(out->suffix.end(), suffix.begin(), suffix.end());
    return absl::OkStatus();
  }
  return Invalid(path, absl::StrCat("post_processor type \"", type, "\" is not supported"));
}

// ---------------------------------------------------------------------------------------------
// Added tokens, matched leftmost-longest before the pipeline.

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip, single_word, normalized;
};

// Leftmost-longest matching of a small set of strings. The candidates starting with each byte
// are kept longest first, so the first one that matches at the leftmost position wins.
class AddedTokenMatcher {
 public:
  void Add(std::string pattern, int index) {
    if (pattern.empty()) return;
    auto& list = by_first_[static_cast<unsigned char>(pattern[0])];
    list.push_back({std::move(pattern), index});
    std::stable_sort(list.begin(), list.end(), [](const Entry& a, const Entry& b) {
      return a.pattern.size() > b.pattern.size();
    });
    any_ = true;
  }
  bool empty() const { return !any_; }

  // Finds the leftmost-longest match at or after `from`: returns the token index, -1 when none.
  int Find(std::string_view text, size_t from, size_t* begin, size_t* end) const {
    for (size_t i = from; i < text.size(); ++i) {
      const auto& list = by_first_[static_cast<unsigned char>(text[i])];
      for (const Entry& e : list) {
        if (text.compare(i, e.pattern.size(), e.pattern) == 0) {
          *begin = i;
          *end = i + e.pattern.size();
          return e.index;
        }
      }
    }
    return -1;
  }

 private:
  struct Entry {
    std::string pattern;
    int index;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  bool any_ = false;
};

// A run of the input: either an added token (id >= 0) or text for the pipeline.
struct Segment {
  int32_t id;
  std::string_view text;
};

// ---------------------------------------------------------------------------------------------

class TokenizerImpl final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(const json& root) {
    std::unique_ptr<TokenizerImpl> t(new TokenizerImpl());
    if (!root.is_object()) return Invalid("$", "not a JSON object");
    if (!root.contains("model")) return Invalid("$", "no model");
    ASSIGN_OR_RETURN(t->model_, BpeModel::FromJson(root["model"]));
    RETURN_IF_ERROR(
        ParseNormalizer(root.value("normalizer", json()), "normalizer", &t->normalizers_));
    RETURN_IF_ERROR(ParsePreTokenizer(root.value("pre_tokenizer", json()), "pre_tokenizer",
                                      &t->pre_tokenizers_));
    RETURN_IF_ERROR(ParsePostProcessor(root.value("post_processor", json()), "post_processor",
                                       &t->post_processor_));
    RETURN_IF_ERROR(ParseDecoder(root.value("decoder", json()), "decoder", &t->decoders_));
    t->has_decoder_ = root.contains("decoder") && !root["decoder"].is_null();
    t->byte_level_decoder_only_ =
        t->decoders_.size() == 1 && t->decoders_[0].kind == Decoder::Kind::kByteLevel;
    RETURN_IF_ERROR(t->ParseAddedTokens(root.value("added_tokens", json::array())));
    t->vocab_size_ = t->model_->size();
    for (const AddedToken& a : t->added_) t->vocab_size_ = std::max(t->vocab_size_, a.id + 1);
    if (t->byte_level_decoder_only_) {
      // Decoding then is a table lookup per id.
      t->decoded_bytes_.resize(t->vocab_size_);
      for (int32_t id = 0; id < t->vocab_size_; ++id) {
        if (const std::string* s = t->TokenString(id)) t->decoded_bytes_[id] = ByteLevelBytes(*s);
      }
    }
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override {
    std::string replaced;
    if (!internal::IsValidUtf8(text)) {
      replaced = internal::ReplaceInvalidUtf8(text);
      text = replaced;
    }
    std::vector<int32_t> ids;
    if (add_special_tokens) ids = post_processor_.prefix;
    std::vector<Segment> raw_segments;
    SplitAdded(text, raw_matcher_, &raw_segments);
    std::string normalized;
    std::vector<Segment> norm_segments;
    std::vector<std::string> pieces, next;
    for (const Segment& seg : raw_segments) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      normalized.assign(seg.text);
      for (const Normalizer& n : normalizers_) n.Apply(&normalized);
      norm_segments.clear();
      SplitAdded(normalized, normalized_matcher_, &norm_segments);
      for (const Segment& sub : norm_segments) {
        if (sub.id >= 0) {
          ids.push_back(sub.id);
          continue;
        }
        pieces.clear();
        pieces.emplace_back(sub.text);
        for (const PreTokenizer& p : pre_tokenizers_) {
          next.clear();
          ApplyPreTokenizer(p, &pieces, &next);
          pieces.swap(next);
        }
        for (const std::string& piece : pieces) model_->Tokenize(piece, &ids);
      }
    }
    if (add_special_tokens) {
      ids.insert(ids.end(), post_processor_.suffix.begin(), post_processor_.suffix.end());
    }
    return ids;
  }

  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const override {
    if (byte_level_decoder_only_) {
      std::string bytes;
      for (int32_t id : ids) {
        if (id < 0 || id >= vocab_size_) continue;
        if (skip_special_tokens && IsSpecial(id)) continue;
        bytes += decoded_bytes_[id];
      }
      return internal::IsValidUtf8(bytes) ? bytes : internal::ReplaceInvalidUtf8(bytes);
    }
    std::vector<std::string> tokens;
    for (int32_t id : ids) {
      if (skip_special_tokens && IsSpecial(id)) continue;
      if (const std::string* s = TokenString(id)) tokens.push_back(*s);
    }
    if (!has_decoder_) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0) out += ' ';
        out += tokens[i];
      }
      return out;
    }
    for (const Decoder& d : decoders_) ApplyDecoder(d, &tokens);
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
  }

  int vocab_size() const override { return vocab_size_; }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    auto it = added_by_content_.find(internal::Av(token));
    if (it != added_by_content_.end()) return added_[it->second].id;
    return model_->TokenToId(token);
  }

  std::string IdToToken(int32_t id) const override {
    const std::string* s = TokenString(id);
    return s ? *s : std::string();
  }

  bool IsSpecial(int32_t id) const override {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() && added_[it->second].special;
  }

 private:
  TokenizerImpl() = default;

  const std::string* TokenString(int32_t id) const {
    auto it = added_by_id_.find(id);
    if (it != added_by_id_.end()) return &added_[it->second].content;
    return model_->IdToToken(id);
  }

  absl::Status ParseAddedTokens(const json& list) {
    if (!list.is_array()) return Invalid("added_tokens", "not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const json& a = list[i];
      const std::string path = absl::StrCat("added_tokens[", i, "]");
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          a["id"].get<int64_t>() < 0 || !a.contains("content") || !a["content"].is_string()) {
        return Invalid(path, "needs an integer id and a string content");
      }
      AddedToken t;
      t.id = a["id"].get<int32_t>();
      t.content = a["content"].get<std::string>();
      t.special = GetBool(a, "special", false);
      t.lstrip = GetBool(a, "lstrip", false);
      t.rstrip = GetBool(a, "rstrip", false);
      t.single_word = GetBool(a, "single_word", false);
      t.normalized = GetBool(a, "normalized", !t.special);
      const int index = static_cast<int>(added_.size());
      added_by_id_[t.id] = index;
      added_by_content_[t.content] = index;
      if (t.normalized) {
        // The reference matches, and decodes, a normalized token by its normalized content.
        for (const Normalizer& n : normalizers_) n.Apply(&t.content);
        added_by_content_[t.content] = index;
        normalized_matcher_.Add(t.content, index);
      } else {
        raw_matcher_.Add(t.content, index);
      }
      added_.push_back(std::move(t));
    }
    return absl::OkStatus();
  }

  // Splits `text` around the added tokens `matcher` finds, applying single_word, lstrip and
  // rstrip as the reference does.
  void SplitAdded(std::string_view text, const AddedTokenMatcher& matcher,
                  std::vector<Segment>* out) const {
    if (matcher.empty()) {
      if (!text.empty()) out->push_back({-1, text});
      return;
    }
    size_t start_offset = 0;
    size_t search = 0;
    size_t b, e;
    int index;
    while ((index = matcher.Find(text, search, &b, &e)) >= 0) {
      search = e;
      const AddedToken& t = added_[index];
      if (t.single_word) {
        const bool start_ok = b == 0 || !IsWordChar(LastCodePoint(text.substr(0, b)));
        size_t k = e;
        const bool stop_ok = e == text.size() || !IsWordChar(internal::NextCodePoint(text, &k));
        if (!start_ok || !stop_ok) continue;
      }
      if (t.lstrip) {
        size_t nb = b;
        while (nb > start_offset) {
          size_t p = nb - 1;
          while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
          size_t q = p;
          if (!IsWhitespace(internal::NextCodePoint(text, &q))) break;
          nb = p;
        }
        b = nb;
      }
      if (t.rstrip) {
        while (e < text.size()) {
          size_t q = e;
          if (!IsWhitespace(internal::NextCodePoint(text, &q))) break;
          e = q;
        }
        search = e;
      }
      if (b > start_offset) out->push_back({-1, text.substr(start_offset, b - start_offset)});
      out->push_back({t.id, text.substr(b, e - b)});
      start_offset = e;
    }
    if (start_offset < text.size()) out->push_back({-1, text.substr(start_offset)});
  }

  void ApplyPreTokenizer(const PreTokenizer& p, std::vector<std::string>* pieces,
                         std::vector<std::string>* out) const {
    switch (p.kind) {
      case PreTokenizer::Kind::kSplit:
        for (const std::string& piece : *pieces) {
          SplitPiece(*p.regex, p.behavior, p.invert, piece, out);
        }
        return;
      case PreTokenizer::Kind::kByteLevel: {
        std::vector<std::string> split;
        for (std::string& piece : *pieces) {
          if (p.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece.insert(0, " ");
          if (p.regex) {
            SplitPiece(*p.regex, SplitBehavior::kIsolated, false, piece, &split);
          } else {
            split.push_back(std::move(piece));
          }
        }
        const ByteLevelAlphabet& a = Alphabet();
        for (const std::string& s : split) {
          std::string mapped;
          mapped.reserve(s.size() * 2);
          for (char c : s) mapped += a.byte_to_utf8[static_cast<unsigned char>(c)];
          out->push_back(std::move(mapped));
        }
        return;
      }
    }
  }

  std::unique_ptr<BpeModel> model_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  PostProcessor post_processor_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;
  bool byte_level_decoder_only_ = false;
  std::vector<std::string> decoded_bytes_;  // per id, when byte_level_decoder_only_
  std::vector<AddedToken> added_;
  absl::flat_hash_map<int32_t, int> added_by_id_;
  absl::flat_hash_map<std::string, int> added_by_content_;
  AddedTokenMatcher raw_matcher_;         // tokens with normalized = false
  AddedTokenMatcher normalized_matcher_;  // tokens with normalized = true
  int32_t vocab_size_ = 0;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view text) {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Invalid("$", "not valid JSON");
  try {
    return TokenizerImpl::Create(root);
  } catch (const json::exception& e) {
    // A field of an unexpected JSON type deep in a stage: still the file's fault.
    return Invalid("$", e.what());
  }
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  auto t = FromJson(text);
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDirectory(const std::string& dir) {
  return FromFile(dir + "/tokenizer.json");
}

// ---------------------------------------------------------------------------------------------

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDecoder::Add(int32_t id) {
  ids_.push_back(id);
  absl::Span<const int32_t> all(ids_);
  // Decode a window that starts at the last emitted boundary: decoders that look at neighbours
  // (byte runs, leading spaces) see the same context as a full decode would.
  const std::string prefix =
      tokenizer_.Decode(all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_);
  const std::string text = tokenizer_.Decode(all.subspan(prefix_offset_), skip_special_);
  // Hold back while the text ends in an incomplete UTF-8 sequence (shown as U+FFFD by the
  // decoder) or has not grown.
  if (text.size() <= prefix.size() ||
      (text.size() >= 3 && text.compare(text.size() - 3, 3, internal::kReplacementUtf8) == 0)) {
    return std::string();
  }
  std::string piece = text.substr(prefix.size());
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  // Keep the window short: everything before it is final.
  return piece;
}

std::string IncrementalDecoder::Flush() {
  absl::Span<const int32_t> all(ids_);
  const std::string prefix =
      tokenizer_.Decode(all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_);
  const std::string text = tokenizer_.Decode(all.subspan(prefix_offset_), skip_special_);
  prefix_offset_ = read_offset_ = ids_.size();
  if (text.size() <= prefix.size()) return std::string();
  return text.substr(prefix.size());
}

}  // namespace moe::tokenizer
