// Bearer-token authentication (--auth-tokens-file): each token names a
// tenant, and a session belongs to the tenant that created it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace turbokv {

class Authenticator {
 public:
  // One "TOKEN TENANT" pair a line; blank lines and lines starting with #
  // are skipped. INVALID_ARGUMENT naming the line for anything else, or a
  // token given twice; NOT_FOUND when the file cannot be read.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(absl::string_view text, absl::string_view origin);

  // The tenant of an "authorization" metadata value "Bearer TOKEN";
  // UNAUTHENTICATED when it is missing (nullptr), malformed or unknown.
  absl::StatusOr<std::string> Authenticate(const absl::string_view* authorization) const;

  size_t tokens() const { return tenants_.size(); }
  // Every tenant of the tokens, once each, sorted.
  std::vector<std::string> tenant_names() const;

 private:
  absl::flat_hash_map<std::string, std::string> tenants_;
};

}  // namespace turbokv
