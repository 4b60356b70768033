#include "serving/status_map.h"

#include "nlohmann/json.hpp"

namespace moe::serving {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

int HttpStatusCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;  // nginx's "client closed request": no standard code fits
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

std::string HttpErrorBody(const absl::Status& status) {
  const int http = HttpStatusCode(status);
  const char* type = "server_error";
  if (http == 400 || http == 404) type = "invalid_request_error";
  if (http == 401) type = "authentication_error";
  if (http == 403) type = "permission_error";
  if (http == 429) type = "rate_limit_error";
  if (http == 503) type = "service_unavailable";
  nlohmann::json body;
  body["error"] = {{"message", std::string(status.message())},
                   {"type", type},
                   {"param", nullptr},
                   {"code", http}};
  // Replace, never throw, on invalid UTF-8 copied from a request into the message.
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace moe::serving
