// UTF-8 helpers shared by the tokenizer's parts: decoding with replacement exactly as Python's
// bytes.decode('utf-8', 'replace') and Rust's String::from_utf8_lossy do (one U+FFFD per maximal
// ill-formed subpart, the Unicode-recommended practice), and code point iteration.
// Stateless functions: thread-safe.
#ifndef MOE_ENGINE_TOKENIZER_INTERNAL_UTF8_H_
#define MOE_ENGINE_TOKENIZER_INTERNAL_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"

namespace moe::tokenizer::internal {

// Debian's Abseil has its own string_view type (not std::string_view): convert explicitly.
inline absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

inline constexpr char kReplacementUtf8[] = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed UTF-8 sequence at s[i], or 0 when s[i..] does not start with one.
// When 0, *bad_len is the length of the maximal ill-formed subpart to replace by one U+FFFD.
size_t WellFormedLength(std::string_view s, size_t i, size_t* bad_len);

// True when every byte of `s` is part of a well-formed UTF-8 sequence.
bool IsValidUtf8(std::string_view s);

// `s` with each maximal ill-formed subpart replaced by U+FFFD; returns `s` unchanged (no copy
// made by the caller if it checks IsValidUtf8 first) when it is valid.
std::string ReplaceInvalidUtf8(std::string_view s);

// Decodes the code point starting at s[i] (s must be valid UTF-8) and advances *i past it.
char32_t NextCodePoint(std::string_view s, size_t* i);

// Appends the UTF-8 encoding of `c`.
void AppendUtf8(char32_t c, std::string* out);

// Number of bytes at the end of `s` that form an incomplete (but so far well-formed) UTF-8
// sequence, 0 when `s` ends on a character boundary or with an ill-formed sequence.
size_t IncompleteTailLength(std::string_view s);

}  // namespace moe::tokenizer::internal

#endif  // MOE_ENGINE_TOKENIZER_INTERNAL_UTF8_H_
