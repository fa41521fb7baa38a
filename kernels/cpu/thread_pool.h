// A fixed pool of threads for data-parallel kernels. ParallelFor runs one
// index range across the workers and the calling thread. Calls from several
// threads run at once: each caller works on its own range, and the workers
// take one index at a time from the call with the fewest left, so a small
// call is not queued behind a large one (which keeps its own caller).
//
// A daemon's pool is made with `background_from` > 0: its workers run at a
// lower CPU priority than the rest of the process (SCHED_IDLE on Linux,
// which needs no privilege: they run when no thread of the normal class in
// their scheduling group, a cgroup or session, wants the core; nice +10
// where SCHED_IDLE is refused), and a call of at least `background_from`
// indices runs on them alone while its caller waits. A smaller call runs on its caller
// alone, at the caller's priority: when the cores are busy
// with large calls, small ones (a Step, a short Decode) and the threads that
// take requests and send replies get a core first, and at most `threads`
// threads run large calls.
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
  // `threads` is the total parallelism, the calling thread included (>= 1);
  // with background_from > 0, `threads` workers beside the callers.
  // `pin` (Linux): worker i keeps to the i-th CPU (modulo their count) this
  // process may run on, running as well as asleep (a background pool of as
  // many workers as CPUs otherwise keeps them there asleep only). Only for
  // CPUs that are the process's alone: a pinned worker cannot leave a core
  // another thread keeps busy, and the index it holds keeps its call waiting
  // as long (turbokvd --pin-threads). More workers than CPUs share them in
  // turn.
  explicit ThreadPool(int threads, int64_t background_from = 0, bool pin = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + (background_from_ > 0 ? 0 : 1); }
  // Whether a call of n indices (not `heavy`) runs on the workers alone, a
  // large call of a background pool.
  bool Large(int64_t n) const { return background_from_ > 0 && n >= background_from_; }
  // Workers kept to one CPU (`pin`; 0 without it, or where it failed).
  int pinned() const { return pinned_; }

  // Runs fn(i) for every i in [0, n) and returns when all have finished.
  // fn must not throw, and must not call ParallelFor on the same pool.
  // `heavy`: each index is a large piece of work (a promotion's layer), so
  // the call is a large one whatever n.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn, bool heavy = false);

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

  // cpu: the one it sleeps kept to (homed_), else -1.
  void WorkerLoop(int cpu);
  // Claims and runs one index of `job`; false when none was left.
  bool RunOne(Job& job);
  // Under mutex_: the job with the fewest indices left (and some left).
  std::shared_ptr<Job> NextJob();

  const int64_t background_from_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::shared_ptr<Job>> jobs_;  // the calls in progress
  std::atomic<size_t> active_{0};           // jobs_.size(), read without the lock
  bool stop_ = false;
  int pinned_ = 0;
  // The CPUs the thread that made the pool could run on.
  std::vector<int> cpus_;
  // A background pool of as many workers as cpus_ (at least two), unless
  // pinned: worker i sleeps kept to cpus_[i] and runs anywhere once woken,
  // and a call wakes them all. A wake-up places a thread where its mask
  // allows, and a core running only SCHED_IDLE threads counts as idle to
  // it: two workers woken one after the other were queued on one core in
  // 233-293 of 300 short calls (turbokv-bench pool, 2 CPUs), the other core
  // idle; kept apart while asleep, in 0-6. A worker whose CPU another thread
  // keeps busy starts late, as a pinned one does, and once it runs there it
  // may be preempted holding an index: one that starts over a millisecond
  // late sleeps unhomed until its first wake-up five seconds later (Home, in
  // thread_pool.cc).
  // Not with fewer workers than CPUs (a container's CPU quota): their homes
  // would be the lowest CPUs of the machine, whoever else runs there.
  bool homed_ = false;
  // When a call last woke homed workers (steady clock, ns).
  std::atomic<int64_t> woken_at_{0};
};

}  // namespace turbokv
