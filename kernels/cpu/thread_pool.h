// A fixed pool of threads for data-parallel kernels. ParallelFor runs one
// index range across the workers and the calling thread. Calls from several
// threads run at once: each caller works on its own range, and the workers
// take one index at a time from the call with the fewest left, so a small
// call is not queued behind a large one (which keeps its own caller).
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
  // One ParallelFor call. A worker holds it by shared_ptr while it runs an
  // index; one that claims an index past the end runs nothing, so `fn` is
  // never touched after the call has returned.
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };

  void WorkerLoop();
  // Claims and runs one index of `job`; false when none was left.
  bool RunOne(Job& job);
  // Under mutex_: the job with the fewest indices left (and some left).
  std::shared_ptr<Job> NextJob();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::shared_ptr<Job>> jobs_;  // the calls in progress
  std::atomic<size_t> active_{0};           // jobs_.size(), read without the lock
  bool stop_ = false;
};

}  // namespace turbokv
