// The real turbokvd binary (TURBOKVD_PATH, or $TURBOKVD) as a child process, for tests.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/metrics_testing.h"

namespace turbokv::testing {

// Whether this build (and so the daemon it tests) runs under AddressSanitizer.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif


class Daemon {
 public:
  // Starts turbokvd with `flags`, its stderr going to a file. file_size_limit
  // > 0: the largest file it may write (RLIMIT_FSIZE), for a full disk.
  // open_files: its RLIMIT_NOFILE {soft, hard} ({0, 0}: this process's).
  explicit Daemon(std::vector<std::string> flags, size_t file_size_limit = 0, rlimit open_files = {0, 0}) {
    log_ = absl::StrCat(::testing::TempDir(), "turbokvd-", getpid(), "-", count_++, ".log");
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 2);
      if (file_size_limit > 0) {
        const rlimit limit = {file_size_limit, file_size_limit};
        setrlimit(RLIMIT_FSIZE, &limit);
      }
      if (open_files.rlim_max > 0) setrlimit(RLIMIT_NOFILE, &open_files);
      // $TURBOKVD, where set, is the binary (a bundle run on another machine:
      // scripts/gpu-bundle.sh); else this build's.
      const char* binary = std::getenv("TURBOKVD") != nullptr ? std::getenv("TURBOKVD") : TURBOKVD_PATH;
      std::vector<char*> argv = {const_cast<char*>(binary), const_cast<char*>("--metrics-listen=127.0.0.1:0")};
      for (std::string& flag : flags) argv.push_back(flag.data());
      argv.push_back(nullptr);
      execv(binary, argv.data());
      _exit(127);
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // Sends a signal and returns the exit status (or -1 if it did not exit normally).
  int Stop(int signal) {
    kill(pid_, signal);
    return Wait();
  }
  pid_t pid() const { return pid_; }
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  // The metrics endpoint's host:port, from the log (after WaitUntilServing).
  std::string MetricsAddress() const {
    const std::string log = Log();
    const std::string mark = "metrics on http://";
    const size_t at = log.find(mark);
    if (at == std::string::npos) return "";
    const size_t start = at + mark.size();
    return log.substr(start, log.find('/', start) - start);
  }
  // Resident memory, bytes (VmRSS), or its peak (VmHWM).
  int64_t MemoryBytes(const char* field = "VmRSS") const {
    std::ifstream in(absl::StrCat("/proc/", pid_, "/status"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(field, 0) == 0) return std::stoll(line.substr(line.find(':') + 1)) * 1024;
    }
    return -1;
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  static inline int count_ = 0;
  pid_t pid_ = -1;
  std::string log_;
};

}  // namespace turbokv::testing
