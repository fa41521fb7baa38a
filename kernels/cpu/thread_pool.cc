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

#ifdef __linux__
namespace {

cpu_set_t OnlyCpu(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return one;
}

}  // namespace
#endif

ThreadPool::ThreadPool(int threads, int64_t background_from, bool pin) : background_from_(background_from) {
  const bool background = background_from > 0;
#ifdef __linux__
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &allowed)) cpus_.push_back(cpu);
    }
  }
  homed_ = background && !pin && threads >= 2 && static_cast<size_t>(threads) == cpus_.size();
#endif
  for (int i = background ? 0 : 1; i < std::max(threads, 1); ++i) {
    const int home = homed_ ? cpus_[workers_.size()] : -1;
    workers_.emplace_back([this, background, home] {
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
      WorkerLoop(home);
    });
  }
#ifdef __linux__
  if (!pin) return;
  for (size_t w = 0; w < workers_.size() && !cpus_.empty(); ++w) {
    const cpu_set_t one = OnlyCpu(cpus_[w % cpus_.size()]);
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

namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A worker woken at home that starts this late found its CPU busy: it sleeps
// where the kernel puts it for a while (kHomeRest), since a busy home makes
// it start late every time and can catch it preempted holding an index.
constexpr int64_t kLateStartNs = 1000000;
constexpr int64_t kHomeRestNs = 5000000000;

// Keeps the calling thread to `cpu` while it sleeps, when that CPU is still
// one of its own and it is not resting from it; Free gives it back the mask
// it had before (a change made to it meanwhile is lost).
class Home {
 public:
  explicit Home(int cpu) : cpu_(cpu) {}

  // Whether to try Keep now (not kept, and not resting).
  bool Due() const { return cpu_ >= 0 && !kept_ && NowNs() >= next_try_; }

  void Keep() {
#ifdef __linux__
    if (pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) == 0 && CPU_ISSET(cpu_, &saved_)) {
      const cpu_set_t one = OnlyCpu(cpu_);
      kept_ = pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
    }
#endif
    if (!kept_) next_try_ = NowNs() + kHomeRestNs;  // not its CPU now: asked again later
  }

  // Woken at `woken` (ns, NowNs): back to its own mask, and resting from its
  // home if it started late.
  void Free(int64_t woken) {
    if (!kept_) return;
#ifdef __linux__
    (void)pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
#endif
    kept_ = false;
    const int64_t now = NowNs();
    if (now - woken > kLateStartNs) next_try_ = now + kHomeRestNs;
  }

  // Kept, and woken at `woken` more than kLateStartNs ago.
  bool Late(int64_t woken) const { return kept_ && NowNs() - woken > kLateStartNs; }

 private:
  const int cpu_;
  bool kept_ = false;
  int64_t next_try_ = 0;
#ifdef __linux__
  cpu_set_t saved_;
#endif
};

}  // namespace

void ThreadPool::WorkerLoop(int cpu) {
  Home home(cpu);
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      for (;;) {
        if (stop_) return;
        job = NextJob();
        if (job != nullptr) break;
        if (home.Due()) {  // asleep at home: see homed_
          lock.unlock();
          home.Keep();
          lock.lock();
          continue;
        }
        wake_.wait(lock);
        // Late with or without a job left for it.
        if (const int64_t woken = woken_at_.load(std::memory_order_relaxed); home.Late(woken)) {
          lock.unlock();
          home.Free(woken);
          lock.lock();
        }
      }
    }
    home.Free(woken_at_.load(std::memory_order_relaxed));
    // Unhomed workers wake the next from here, not all of them from the
    // caller: woken together while the caller still held its core, two
    // workers were often queued on one core with the other idle, and a large
    // call ran at half the pool (a 640 us call of 2 workers took 1,320 us,
    // p50). Woken by a running worker of the SCHED_IDLE class they still
    // often are (that worker's core counts as idle to the placement): most
    // short calls ran on one core, and a tenth of the long ones. Homed and
    // pinned workers cannot be.
    if (!homed_ && job->n - job->next.load() > 1) wake_.notify_one();
    // While it is the only call, run its indices without going back to the
    // lock for each.
    while (RunOne(*job) && active_.load(std::memory_order_relaxed) == 1) {
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn, bool heavy) {
  if (n <= 0) return;
  const bool background = background_from_ > 0;
  const bool large = Large(n) || (background && heavy && n > 1);
  if (!large && (workers_.empty() || n == 1 || background)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (homed_) woken_at_.store(NowNs(), std::memory_order_relaxed);  // before any worker can see the job
    jobs_.push_back(job);
    active_.store(jobs_.size(), std::memory_order_relaxed);
  }
  // Homed workers all at once, each to its own CPU, so that one whose CPU is
  // busy holds up no other; else one, which wakes the next (WorkerLoop).
  if (homed_) {
    wake_.notify_all();
  } else {
    wake_.notify_one();
  }
  while (!large && RunOne(*job)) {
  }
  std::unique_lock<std::mutex> lock(mutex_);
  // A large call's caller runs nothing itself: should its one wake-up go
  // astray, it wakes another worker now and then rather than wait forever.
  while (!done_.wait_for(lock, std::chrono::milliseconds(20), [&] { return job->finished.load() == n; })) {
    woken_at_.store(NowNs(), std::memory_order_relaxed);
    wake_.notify_one();
  }
  jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
  active_.store(jobs_.size(), std::memory_order_relaxed);
}

}  // namespace turbokv
