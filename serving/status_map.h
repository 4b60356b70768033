// The one mapping from absl::Status to what the two fronts send: grpc::Status for gRPC, an HTTP
// status code and an OpenAI-shaped error body for HTTP. Stateless; thread-safe.
#ifndef MOE_SERVING_STATUS_MAP_H_
#define MOE_SERVING_STATUS_MAP_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace moe::serving {

// Canonical codes map one to one (absl and gRPC share the numbering).
grpc::Status ToGrpcStatus(const absl::Status& status);

// InvalidArgument/OutOfRange/FailedPrecondition -> 400, Unauthenticated -> 401,
// PermissionDenied -> 403, NotFound -> 404, ResourceExhausted -> 429, Cancelled -> 499,
// Unimplemented -> 501, Unavailable -> 503, DeadlineExceeded -> 504, others -> 500.
int HttpStatusCode(const absl::Status& status);

// {"error": {"message", "type", "param", "code"}} as the OpenAI API sends it; `type` is
// "invalid_request_error", "authentication_error", "rate_limit_error", ... by status code.
std::string HttpErrorBody(const absl::Status& status);

}  // namespace moe::serving

#endif  // MOE_SERVING_STATUS_MAP_H_
