#include "service/byte_size.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace turbokv {

absl::StatusOr<size_t> ParseByteSize(absl::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && (absl::ascii_isdigit(text[digits]) || text[digits] == '.')) ++digits;
  double number = 0;
  if (digits == 0 || !absl::SimpleAtod(text.substr(0, digits), &number)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size: expected e.g. 4GiB, 512MiB or 65536"));
  }
  const std::string unit = absl::AsciiStrToLower(text.substr(digits));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else if (unit == "kib") scale = 1024.0;
  else if (unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "': unknown unit '", unit,
                                                   "' (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"));
  }
  const double bytes = std::floor(number * scale);
  if (!(bytes < 1.8e19)) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is too large"));
  return static_cast<size_t>(bytes);
}

std::string FormatByteSize(size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

}  // namespace turbokv
