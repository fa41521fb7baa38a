#include "service/auth.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace turbokv {

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the tokens file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromText(absl::string_view text,
                                                                       absl::string_view origin) {
  auto authenticator = std::unique_ptr<Authenticator>(new Authenticator());
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", number, ": expected \"TOKEN TENANT\""));
    }
    if (!authenticator->tenants_.emplace(fields[0], fields[1]).second) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", number, ": the token is given twice"));
    }
  }
  return authenticator;
}

absl::StatusOr<std::string> Authenticator::Authenticate(const absl::string_view* authorization) const {
  if (authorization == nullptr) {
    return absl::UnauthenticatedError("no bearer token: send metadata \"authorization: Bearer TOKEN\"");
  }
  absl::string_view token = *authorization;
  // Exactly "Bearer", one space and the token: the tokens of the file hold
  // no whitespace, and nothing else is taken for one of them.
  if (!absl::ConsumePrefix(&token, "Bearer ") || token.empty() ||
      std::any_of(token.begin(), token.end(), [](char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); })) {
    return absl::UnauthenticatedError("the authorization metadata is not \"Bearer TOKEN\" (one space, no other whitespace)");
  }
  auto it = tenants_.find(token);
  if (it == tenants_.end()) return absl::UnauthenticatedError("unknown bearer token");
  return it->second;
}

std::vector<std::string> Authenticator::tenant_names() const {
  std::set<std::string> names;
  for (const auto& [token, tenant] : tenants_) names.insert(tenant);
  return {names.begin(), names.end()};
}

}  // namespace turbokv
