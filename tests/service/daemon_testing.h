// The real turbokvd binary (TURBOKVD_PATH) as a child process, for tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace turbokv::testing {

class Daemon {
 public:
  // Starts turbokvd with `flags`, its stderr going to a file.
  explicit Daemon(std::vector<std::string> flags) {
    log_ = absl::StrCat(::testing::TempDir(), "turbokvd-", getpid(), "-", count_++, ".log");
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 2);
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
