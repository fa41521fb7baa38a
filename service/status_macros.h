// absl::Status plumbing for the daemon's C++ (Debian 12's Abseil has no
// status macros of its own).
//
//   TURBOKV_RETURN_IF_ERROR(CheckLayer(config, layer, "layer"));
//   TURBOKV_ASSIGN_OR_RETURN(std::vector<float> keys, TensorToFloats(...));
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TURBOKV_STATUS_CONCAT_INNER(a, b) a##b
#define TURBOKV_STATUS_CONCAT(a, b) TURBOKV_STATUS_CONCAT_INNER(a, b)

// Returns the status of `expr` (an absl::Status) when it is not OK.
#define TURBOKV_RETURN_IF_ERROR(expr)                                          \
  do {                                                                         \
    if (::absl::Status turbokv_status = (expr); !turbokv_status.ok()) {        \
      return turbokv_status;                                                   \
    }                                                                          \
  } while (false)

// Evaluates `expr` (an absl::StatusOr<T>); returns its status when not OK,
// else moves its value into `lhs` (a declaration or an lvalue).
#define TURBOKV_ASSIGN_OR_RETURN(lhs, expr) \
  TURBOKV_ASSIGN_OR_RETURN_IMPL(TURBOKV_STATUS_CONCAT(turbokv_statusor_, __LINE__), lhs, expr)

#define TURBOKV_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
