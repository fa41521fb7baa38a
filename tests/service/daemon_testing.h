// The real turbokvd binary (TURBOKVD_PATH) as a child process, for tests.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

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


// GET http://address/metrics (address: host:port); the body, or "" when the
// endpoint does not answer within `timeout`.
// A TCP connection to host:port (IPv4), or -1.
inline int ConnectTcp(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &to.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET http://address/metrics (address: host:port); the body, or "" when the
// endpoint does not answer within `timeout`.
inline std::string Scrape(const std::string& address, absl::Duration timeout = absl::Seconds(5)) {
  const int fd = ConnectTcp(address);
  if (fd < 0) return "";
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string body;
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buffer[65536];
    for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) body.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return body;
}

// The value of a Prometheus sample line that starts with `series` (name and
// labels as exposed), or -1.
inline double Sample(const std::string& metrics, const std::string& series) {
  std::istringstream lines(metrics);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

class Daemon {
 public:
  // Starts turbokvd with `flags`, its stderr going to a file. file_size_limit
  // > 0: the largest file it may write (RLIMIT_FSIZE), for a full disk.
  explicit Daemon(std::vector<std::string> flags, size_t file_size_limit = 0) {
    log_ = absl::StrCat(::testing::TempDir(), "turbokvd-", getpid(), "-", count_++, ".log");
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 2);
      if (file_size_limit > 0) {
        const rlimit limit = {file_size_limit, file_size_limit};
        setrlimit(RLIMIT_FSIZE, &limit);
      }
      std::vector<char*> argv = {const_cast<char*>(TURBOKVD_PATH), const_cast<char*>("--metrics-listen=127.0.0.1:0")};
      for (std::string& flag : flags) argv.push_back(flag.data());
      argv.push_back(nullptr);
      execv(TURBOKVD_PATH, argv.data());
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
