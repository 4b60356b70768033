// Status helpers shared by every component: RETURN_IF_ERROR and ASSIGN_OR_RETURN over
// absl::Status / absl::StatusOr, in the style of Abseil's internal macros.
#ifndef MOE_COMMON_STATUS_H_
#define MOE_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status) once and returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                                  \
  do {                                                         \
    ::absl::Status moe_status_ = (expr);                       \
    if (!moe_status_.ok()) return moe_status_;                 \
  } while (0)

#define MOE_STATUS_CONCAT_INNER_(a, b) a##b
#define MOE_STATUS_CONCAT_(a, b) MOE_STATUS_CONCAT_INNER_(a, b)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status, else moves the value into `lhs` (which may be a declaration: `auto x`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL_(MOE_STATUS_CONCAT_(moe_statusor_, __LINE__), lhs, expr)

#define MOE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // MOE_COMMON_STATUS_H_
