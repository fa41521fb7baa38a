// The daemon's log: one line per event on stderr, "TIME LEVEL message", with
// the time in UTC to the microsecond (RFC 3339), so that a container
// runtime's log collector can order and filter lines without parsing
// messages. Each line is one write(2): lines from threads never interleave;
// a message's own line breaks become spaces.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace turbokv {

enum class LogLevel { kInfo, kWarning, kError };

void Log(LogLevel level, absl::string_view message);

template <typename... Args>
void Logf(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  Log(level, absl::StrFormat(format, args...));
}

// One kind of event that may come in floods (a client sending garbage, a
// full descriptor table): at most one line per `interval`, the next one
// saying how many it left out. Thread-safe.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(absl::Duration interval) : interval_(interval) {}
  void Log(LogLevel level, absl::string_view message);

 private:
  const absl::Duration interval_;
  std::mutex mutex_;
  absl::Time last_ = absl::InfinitePast();
  int64_t left_out_ = 0;
};

}  // namespace turbokv
