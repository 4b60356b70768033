#include "engine/tokenizer/internal/utf8.h"

namespace moe::tokenizer::internal {
namespace {

inline bool InRange(unsigned char c, unsigned char lo, unsigned char hi) {
  return c >= lo && c <= hi;
}

}  // namespace

size_t WellFormedLength(std::string_view s, size_t i, size_t* bad_len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  *bad_len = 1;
  if (c < 0x80) return 1;
  // Table 3-7 of the Unicode standard: the allowed range of the second byte depends on the first.
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (InRange(c, 0xC2, 0xDF)) {
    need = 2;
  } else if (InRange(c, 0xE0, 0xEF)) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (InRange(c, 0xF0, 0xF4)) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;  // 0x80-0xC1, 0xF5-0xFF: never a first byte
  }
  size_t k = 1;
  for (; k < need; ++k) {
    if (i + k >= s.size()) break;
    const unsigned char b = static_cast<unsigned char>(s[i + k]);
    const bool ok = k == 1 ? InRange(b, lo, hi) : InRange(b, 0x80, 0xBF);
    if (!ok) break;
  }
  if (k == need) return need;
  *bad_len = k;  // the well-formed prefix so far is one maximal subpart
  return 0;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    size_t bad;
    const size_t n = WellFormedLength(s, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string ReplaceInvalidUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    size_t bad;
    const size_t n = WellFormedLength(s, i, &bad);
    if (n > 0) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out.append(kReplacementUtf8);
      i += bad;
    }
  }
  return out;
}

char32_t NextCodePoint(std::string_view s, size_t* i) {
  const unsigned char c = static_cast<unsigned char>(s[*i]);
  if (c < 0x80) {
    ++*i;
    return c;
  }
  int n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  char32_t cp = c & (0x7F >> n);
  for (int k = 1; k < n && *i + k < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[*i + k]) & 0x3F);
  }
  *i += n;
  return cp;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

size_t IncompleteTailLength(std::string_view s) {
  // A UTF-8 sequence is at most 4 bytes: look back at most 3 for its first byte.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t bad;
    if (WellFormedLength(s, n - back, &bad) == 0 && bad == back) return back;
    return 0;
  }
  return 0;
}

}  // namespace moe::tokenizer::internal
