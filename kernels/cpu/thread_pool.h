// A fixed pool of threads for data-parallel kernels. ParallelFor runs one
// index range across the workers and the calling thread; calls from several
// threads take turns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace turbokv {

class ThreadPool {
 public:
  // `threads` is the total parallelism, the calling thread included (>= 1).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) and returns when all have finished.
  // fn must not throw, and must not call ParallelFor on the same pool.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  // One ParallelFor call. Workers that wake late hold it by shared_ptr and find
  // no index left, so they never touch `fn` after the call has returned.
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };

  void WorkerLoop();
  void Run(Job& job);

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one ParallelFor at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::shared_ptr<Job> job_;
  int64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace turbokv
