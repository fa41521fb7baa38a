// Who caused a failed call, for turbokv_rpc_errors_total{side}: alerts page
// on the daemon's failures, not on callers' mistakes or their own limits.
#pragma once

#include "absl/status/status.h"

namespace turbokv {

enum class ErrorSide {
  kClient,  // the request, or a limit of the caller's own (a session's max_tokens, its tenant's quotas)
  kServer,  // the daemon's fault or its capacity (the memory budget, the sessions it holds, a drain)
};

// Marks a RESOURCE_EXHAUSTED as a limit of the caller's own: without the
// mark, RESOURCE_EXHAUSTED is the daemon's capacity.
absl::Status CallerLimit(absl::Status status);

// By code: client for CANCELLED, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
// PERMISSION_DENIED, UNAUTHENTICATED, FAILED_PRECONDITION, ABORTED,
// OUT_OF_RANGE, UNIMPLEMENTED and marked RESOURCE_EXHAUSTED; server for the
// rest (UNKNOWN, INTERNAL, DATA_LOSS, UNAVAILABLE, DEADLINE_EXCEEDED: a call
// that ran out of its time while the daemon worked on it, other
// RESOURCE_EXHAUSTED).
ErrorSide SideOf(const absl::Status& status);


}  // namespace turbokv
