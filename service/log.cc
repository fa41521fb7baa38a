#include "service/log.h"

#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace turbokv {
namespace {

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "INFO";
}

}  // namespace

void Log(LogLevel level, absl::string_view message) {
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  absl::StrAppend(&line, " ", LevelName(level), " ",
                  absl::StrReplaceAll(absl::StripTrailingAsciiWhitespace(message), {{"\n", " "}}), "\n");
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = write(STDERR_FILENO, line.data() + written, line.size() - written);
    if (n <= 0) return;  // nowhere to report it
    written += static_cast<size_t>(n);
  }
}

void RateLimitedLog::Log(LogLevel level, absl::string_view message) {
  int64_t left_out = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const absl::Time now = absl::Now();
    if (now - last_ < interval_) {
      ++left_out_;
      return;
    }
    last_ = now;
    left_out = left_out_;
    left_out_ = 0;
  }
  if (left_out == 0) {
    turbokv::Log(level, message);
  } else {
    turbokv::Log(level, absl::StrCat(message, " (and ", left_out, " more like it since the last such line)"));
  }
}

}  // namespace turbokv
