// Session ids: made by the store, shown by every layer that names a session
// in a message, and parsed by the tiers that keep sessions under them. No
// store types, so that tiers below the store can use them.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace turbokv {

// 128 random bits as 26 lowercase base32 characters.
std::string NewSessionId();

// Whether NewSessionId could have made `id` (only such ids are on a tier).
bool PlausibleSessionId(absl::string_view id);

// A session id as error messages show it: one longer than any real id is
// cut, so that a client's 10 KB id does not come back as a 10 KB message
// (past gRPC's metadata limit).
std::string ShowId(absl::string_view id);

// One key for a session of a tenant, for maps of sessions by both (ids are
// base32: no NUL in them).
std::string TenantSessionKey(absl::string_view tenant, absl::string_view id);

}  // namespace turbokv
