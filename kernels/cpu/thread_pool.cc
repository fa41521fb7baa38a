#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace turbokv {

ThreadPool::ThreadPool(int threads, int64_t background_from, bool pin) : background_from_(background_from) {
  const bool background = background_from > 0;
  for (int i = background ? 0 : 1; i < std::max(threads, 1); ++i) {
    workers_.emplace_back([this, background] {
#ifdef __linux__
      // The policy is per thread on Linux. SCHED_IDLE, not a nice value:
      // a thread of the normal class that wakes takes the core from an idle
      // one at once, where a niced worker may keep it for the rest of its
      // slice. Where SCHED_IDLE is refused, nice +10; where that fails too,
      // the pool still works, at the process's priority.
      if (background) {
        const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
        const sched_param none{};
        if (sched_setscheduler(tid, SCHED_IDLE, &none) != 0) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 10);
      }
#endif
      WorkerLoop();
    });
  }
#ifdef __linux__
  cpu_set_t allowed;
  if (!pin || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  for (size_t w = 0; w < workers_.size() && !cpus.empty(); ++w) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[w % cpus.size()], &one);
    pinned_ += pthread_setaffinity_np(workers_[w].native_handle(), sizeof(one), &one) == 0;
  }
#else
  (void)pin;
#endif
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

bool ThreadPool::RunOne(Job& job) {
  const int64_t i = job.next.fetch_add(1);
  if (i >= job.n) return false;
  (*job.fn)(i);
  if (job.finished.fetch_add(1) + 1 == job.n) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.notify_all();
  }
  return true;
}

std::shared_ptr<ThreadPool::Job> ThreadPool::NextJob() {
  // The call with the fewest indices left: a small call (a Decode step)
  // finishes at the speed of the whole pool while a large one goes on; the
  // large one keeps its own caller, so it is never starved. A background
  // pool has only large calls here (its small ones run on their callers
  // alone: on a worker, a small call's index would run at the workers'
  // priority and could keep its caller waiting behind the rest of the
  // process).
  std::shared_ptr<Job> best;
  int64_t best_left = 0;
  for (const std::shared_ptr<Job>& job : jobs_) {
    const int64_t left = job->n - job->next.load();
    if (left > 0 && (best == nullptr || left < best_left)) {
      best = job;
      best_left = left;
    }
  }
  return best;
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] {
        if (stop_) return true;
        job = NextJob();
        return job != nullptr;
      });
      if (stop_) return;
    }
    // Wake the next worker from here, not all of them from the caller: woken
    // together while the caller still held its core, two workers were often
    // queued on one core with the other idle, and a large call ran at half
    // the pool (a 640 us call of 2 workers took 1,320 us, p50). Woken by a
    // running worker of the SCHED_IDLE class they still often are (that
    // worker's core counts as idle to the placement): most short calls ran
    // on one core, and a tenth of the long ones. Pinned workers (`pin`)
    // cannot be.
    if (job->n - job->next.load() > 1) wake_.notify_one();
    // While it is the only call, run its indices without going back to the
    // lock for each.
    while (RunOne(*job) && active_.load(std::memory_order_relaxed) == 1) {
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn, bool heavy) {
  if (n <= 0) return;
  const bool background = background_from_ > 0;
  const bool large = background && (n >= background_from_ || (heavy && n > 1));
  if (!large && (workers_.empty() || n == 1 || background)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(job);
    active_.store(jobs_.size(), std::memory_order_relaxed);
  }
  wake_.notify_one();  // which wakes the next (WorkerLoop)
  while (!large && RunOne(*job)) {
  }
  std::unique_lock<std::mutex> lock(mutex_);
  // A large call's caller runs nothing itself: should its one wake-up go
  // astray, it wakes another worker now and then rather than wait forever.
  while (!done_.wait_for(lock, std::chrono::milliseconds(20), [&] { return job->finished.load() == n; })) {
    wake_.notify_one();
  }
  jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
  active_.store(jobs_.size(), std::memory_order_relaxed);
}

}  // namespace turbokv
