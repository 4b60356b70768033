#include "serving/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moe::serving {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer string is visited whatever the contents.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  // The volatile read keeps the compiler from turning the loop into an early exit.
  volatile unsigned char result = diff;
  return result == 0;
}

absl::Status ApiKeyAuth::Check(absl::string_view header) const {
  if (key_.empty()) return absl::OkStatus();
  constexpr absl::string_view kBearer = "Bearer ";
  if (header.empty()) {
    return absl::UnauthenticatedError("missing API key: send \"Authorization: Bearer <key>\"");
  }
  if (header.size() < kBearer.size() ||
      !absl::EqualsIgnoreCase(header.substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError("the Authorization header must be \"Bearer <key>\"");
  }
  if (!ConstantTimeEquals(header.substr(kBearer.size()), key_)) {
    return absl::UnauthenticatedError("invalid API key");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LoadApiKey(const std::string& key, const std::string& key_file) {
  if (!key.empty() && !key_file.empty()) {
    return absl::InvalidArgumentError("--api-key and --api-key-file: give one of them, not both");
  }
  if (key_file.empty()) return std::string(absl::StripAsciiWhitespace(key));
  std::ifstream in(key_file);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--api-key-file: cannot read ", key_file));
  std::string line;
  std::getline(in, line);
  std::string stripped(absl::StripAsciiWhitespace(line));
  if (stripped.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--api-key-file: ", key_file, " has no key on its first line"));
  }
  return stripped;
}

}  // namespace moe::serving
