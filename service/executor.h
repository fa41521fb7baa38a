// The daemon's worker threads: reactors hand every piece of work here and
// return at once, so gRPC's threads never block on the kernels.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace turbokv {

class Executor {
 public:
  explicit Executor(int threads);
  ~Executor();  // Shutdown()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues fn; false (fn not run) once Shutdown has begun.
  bool Submit(std::function<void()> fn);
  // Runs what is queued, then joins the threads.
  void Shutdown();

 private:
  void Loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace turbokv
