// The daemon's log: one line per event on stderr, "TIME LEVEL message", with
// the time in UTC to the microsecond (RFC 3339), so that a container
// runtime's log collector can order and filter lines without parsing
// messages. Each line is one write(2): lines from threads never interleave;
// a message's own line breaks become spaces.
#pragma once

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace turbokv {

enum class LogLevel { kInfo, kWarning, kError };

void Log(LogLevel level, absl::string_view message);

template <typename... Args>
void Logf(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  Log(level, absl::StrFormat(format, args...));
}

}  // namespace turbokv
