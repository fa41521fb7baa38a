#include "service/error_side.h"

#include "absl/strings/cord.h"

namespace turbokv {
namespace {

// A status payload: the daemon's own, never sent to clients.
constexpr char kSideUrl[] = "type.turbokv/side";

}  // namespace

absl::Status CallerLimit(absl::Status status) {
  status.SetPayload(kSideUrl, absl::Cord("client"));
  return status;
}

ErrorSide SideOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      return ErrorSide::kClient;
    case absl::StatusCode::kResourceExhausted:
      return status.GetPayload(kSideUrl).has_value() ? ErrorSide::kClient : ErrorSide::kServer;
    default:
      return ErrorSide::kServer;
  }
}


}  // namespace turbokv
