#include "service/records/session_id.h"

#include <sys/random.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace turbokv {

std::string NewSessionId() {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz234567";
  // The kernel's CSPRNG (getrandom blocks only until it is first seeded).
  unsigned __int128 bits = 0;
  for (size_t got = 0; got < sizeof(bits);) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&bits) + got, sizeof(bits) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string id(26, 'a');
  for (char& c : id) {
    c = kAlphabet[static_cast<unsigned>(bits & 31)];
    bits >>= 5;
  }
  return id;
}

bool PlausibleSessionId(absl::string_view id) {
  return id.size() == 26 &&
         std::all_of(id.begin(), id.end(), [](char c) { return (c >= 'a' && c <= 'z') || (c >= '2' && c <= '7'); });
}

std::string ShowId(absl::string_view id) {
  constexpr size_t kShown = 40;
  if (id.size() <= kShown) return std::string(id);
  return absl::StrCat(id.substr(0, kShown), "... (", id.size(), " bytes)");
}

std::string TenantSessionKey(absl::string_view tenant, absl::string_view id) {
  return absl::StrCat(tenant, absl::string_view("\0", 1), id);
}

}  // namespace turbokv
