// API-key checks shared by the HTTP and gRPC fronts: `Authorization: Bearer <key>`, compared in
// constant time (the time taken does not depend on where a wrong key first differs). The key is
// never logged or put in an error message. Immutable after construction: thread-safe.
#ifndef MOE_SERVING_AUTH_H_
#define MOE_SERVING_AUTH_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::serving {

class ApiKeyAuth {
 public:
  // An empty key turns checking off.
  explicit ApiKeyAuth(std::string key) : key_(std::move(key)) {}

  bool enabled() const { return !key_.empty(); }
  // `header` is the Authorization header's (or metadata's) value; empty when absent. OK when
  // checking is off; Unauthenticated otherwise unless it is "Bearer <key>".
  absl::Status Check(absl::string_view header) const;

 private:
  std::string key_;
};

// Equal contents, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The key from --api-key or the first line of --api-key-file (one of them at most; surrounding
// whitespace removed). InvalidArgument when both are given or the file yields an empty key.
absl::StatusOr<std::string> LoadApiKey(const std::string& key, const std::string& key_file);

}  // namespace moe::serving

#endif  // MOE_SERVING_AUTH_H_
