// Concurrent ParallelFor calls on one pool: each gets every index once, and
// a small call finishes while a large one is still running.
#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

#ifdef __linux__
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace turbokv {
namespace {

TEST(ThreadPoolTest, CallsFromSeveralThreadsShareTheWorkers) {
  ThreadPool pool(3);
  std::atomic<bool> small_done{false};
  std::atomic<int64_t> big_seen{0};
  std::vector<std::atomic<int>> hits(1000);
  // A large call whose indices wait until the small call has finished (or
  // give up after a while): it can only finish early if the small call was
  // not queued behind it.
  std::thread big([&] {
    pool.ParallelFor(64, [&](int64_t) {
      for (int spin = 0; spin < 200 && !small_done.load(); ++spin) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++big_seen;
    });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  pool.ParallelFor(1000, [&](int64_t i) { ++hits[static_cast<size_t>(i)]; });
  const int64_t big_when_small_done = big_seen.load();
  small_done = true;
  big.join();
  EXPECT_LT(big_when_small_done, 64);  // not queued behind the large call
  EXPECT_EQ(big_seen.load(), 64);
  for (const auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST(ThreadPoolTest, ManyConcurrentCallersEachSeeEveryIndexOnce) {
  ThreadPool pool(4);
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 50; ++round) {
        const int64_t n = 17 + c * 31 + round;
        std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
        pool.ParallelFor(n, [&](int64_t i) { ++seen[static_cast<size_t>(i)]; });
        for (const auto& s : seen) wrong += s.load() != 1;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

#ifdef __linux__
// Whether this machine lets a thread take SCHED_IDLE (a sandbox such as
// gVisor refuses it: the pool then falls back to nice +10).
bool IdleClassAllowed() {
  bool allowed = false;
  std::thread([&] {
    const sched_param none{};
    allowed = sched_setscheduler(0, SCHED_IDLE, &none) == 0;
  }).join();
  return allowed;
}
#endif

// A background pool: a call of background_from indices or more runs on the
// workers alone (the caller only waits), as SCHED_IDLE on Linux (nice +10
// where that is refused); a smaller call runs on its caller alone, but a
// heavy one (a promotion's layers) is a large call whatever its count.
TEST(ThreadPoolTest, ABackgroundPoolRunsLargeCallsOnItsWorkersAndSmallOnesOnTheCaller) {
#ifdef __linux__
  const bool idle_class = IdleClassAllowed();
#endif
  ThreadPool pool(2, /*background_from=*/8);
  EXPECT_EQ(pool.size(), 2);
  const std::thread::id caller = std::this_thread::get_id();
  for (const auto& call : std::vector<std::pair<int64_t, bool>>{
           {1, false}, {7, false}, {8, false}, {500, false}, {2, true}, {7, true}}) {
    const int64_t n = call.first;
    const bool heavy = call.second;
    std::mutex mutex;
    std::set<std::thread::id> threads;
    std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
    std::atomic<int> low_priority{0};
    pool.ParallelFor(
        n,
        [&](int64_t i) {
          ++seen[static_cast<size_t>(i)];
#ifdef __linux__
          if (idle_class ? sched_getscheduler(0) == SCHED_IDLE
                         : getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))) >= 10) {
            ++low_priority;
          }
#endif
          std::lock_guard<std::mutex> lock(mutex);
          threads.insert(std::this_thread::get_id());
        },
        heavy);
    for (const auto& s : seen) EXPECT_EQ(s.load(), 1) << n;
    if (n < 8 && !heavy) {
      EXPECT_EQ(threads, std::set<std::thread::id>{caller}) << n;
    } else {
      EXPECT_EQ(threads.count(caller), 0u) << n;
#ifdef __linux__
      EXPECT_EQ(low_priority.load(), n) << n;
#endif
    }
  }
}

// A call wakes one worker and each worker wakes the next while indices are
// left (so that the woken workers spread over idle cores; where they sleep
// kept to a CPU each, a call wakes them all:
// WorkersAsManyAsCpusSleepOnACpuEachAndRunAnywhere): every worker a call
// needs must still be reached. Each index waits until all of them run
// at once, which only happens if the wake-ups reached every worker, in both
// kinds of pool, call after call.
TEST(ThreadPoolTest, EveryWorkerACallNeedsIsWoken) {
  for (const int64_t background_from : {int64_t{0}, int64_t{1}}) {
    constexpr int kWorkers = 4;
    ThreadPool pool(kWorkers, background_from);
    const int64_t n = pool.size();
    for (int round = 0; round < 20; ++round) {
      std::mutex mutex;
      std::condition_variable all_in;
      int started = 0;
      std::atomic<int> met{0};
      pool.ParallelFor(n, [&](int64_t) {
        std::unique_lock<std::mutex> lock(mutex);
        if (++started == n) all_in.notify_all();
        if (all_in.wait_for(lock, std::chrono::seconds(10), [&] { return started == n; })) ++met;
      });
      ASSERT_EQ(met.load(), n) << "background_from " << background_from << ", round " << round;
    }
  }
}

#ifdef __linux__
// A pinned pool's workers each keep to one CPU, the i-th of those the
// process may use (modulo their count): two workers on two CPUs never share
// one. Each call's two indices wait until both run at once, so both workers
// run in every call.
TEST(ThreadPoolTest, PinnedWorkersEachKeepToOneCpuOfTheirOwn) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  constexpr int kWorkers = 2;
  ThreadPool pool(kWorkers, /*background_from=*/1, /*pin=*/true);
  EXPECT_EQ(pool.pinned(), kWorkers);
  std::mutex mutex;
  std::map<std::thread::id, std::set<int>> seen;  // each worker's CPUs
  for (int round = 0; round < 20; ++round) {
    std::condition_variable all_in;
    int started = 0;
    std::atomic<int> met{0};
    pool.ParallelFor(kWorkers, [&](int64_t) {
      std::unique_lock<std::mutex> lock(mutex);
      seen[std::this_thread::get_id()].insert(sched_getcpu());
      if (++started == kWorkers) all_in.notify_all();
      if (all_in.wait_for(lock, std::chrono::seconds(10), [&] { return started == kWorkers; })) ++met;
    });
    ASSERT_EQ(met.load(), kWorkers) << "round " << round;
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kWorkers));
  std::set<int> all;
  for (const auto& [thread, cpus] : seen) {
    EXPECT_EQ(cpus.size(), 1u);
    EXPECT_TRUE(CPU_ISSET(*cpus.begin(), &allowed));
    all.insert(cpus.begin(), cpus.end());
  }
  EXPECT_EQ(all.size(), static_cast<size_t>(std::min(kWorkers, CPU_COUNT(&allowed))));
  // The calling thread is not pinned, and a pool without `pin` pins none.
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  EXPECT_TRUE(CPU_EQUAL(&mine, &allowed));
  EXPECT_EQ(ThreadPool(kWorkers, /*background_from=*/1).pinned(), 0);
}

// The mask of thread `tid` of this process.
cpu_set_t MaskOf(pid_t tid) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  EXPECT_EQ(sched_getaffinity(tid, sizeof(mask), &mask), 0);
  return mask;
}

// The tids of the workers that run a call of `n` indices, each index waiting
// until all n run at once; asserts that the workers ran with `running` as
// their mask.
std::set<pid_t> RunTogether(ThreadPool& pool, int n, const cpu_set_t& running) {
  std::mutex mutex;
  std::condition_variable all_in;
  int started = 0;
  std::set<pid_t> tids;
  std::atomic<int> as_expected{0};
  pool.ParallelFor(n, [&](int64_t) {
    const cpu_set_t mine = MaskOf(0);
    std::unique_lock<std::mutex> lock(mutex);
    tids.insert(static_cast<pid_t>(syscall(SYS_gettid)));
    if (CPU_EQUAL(&mine, &running)) ++as_expected;
    if (++started == n) all_in.notify_all();
    all_in.wait_for(lock, std::chrono::seconds(10), [&] { return started == n; });
  });
  EXPECT_EQ(as_expected.load(), n);
  return tids;
}

// The calling thread kept to the first `count` CPUs of `allowed` while it
// lives (a pool takes its CPUs from the thread that makes it).
class FirstCpus {
 public:
  FirstCpus(const cpu_set_t& allowed, int count) : before_(allowed) {
    cpu_set_t some;
    CPU_ZERO(&some);
    for (int cpu = 0, taken = 0; cpu < CPU_SETSIZE && taken < count; ++cpu) {
      if (CPU_ISSET(cpu, &allowed)) {
        CPU_SET(cpu, &some);
        ++taken;
      }
    }
    EXPECT_EQ(sched_setaffinity(0, sizeof(some), &some), 0);
    mask_ = some;
  }
  ~FirstCpus() { sched_setaffinity(0, sizeof(before_), &before_); }
  const cpu_set_t& mask() const { return mask_; }

 private:
  cpu_set_t before_, mask_;
};

// A background pool of as many workers as CPUs (two here), without `pin`,
// keeps each worker to a CPU of its own while it sleeps (so that waking them
// does not queue two on one core), wakes them all for a call and lets them
// run on any CPU. A worker that starts more than 1 ms late rests from its
// CPU for 5 s: on a machine too busy for the workers to start on time the
// test waits that out twice and then skips. Fewer workers than CPUs (three
// here) are not kept anywhere.
TEST(ThreadPoolTest, WorkersAsManyAsCpusSleepOnACpuEachAndRunAnywhere) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one CPU: the workers are not kept apart";
  if (CPU_COUNT(&allowed) >= 3) {
    const FirstCpus three(allowed, 3);
    ThreadPool fewer(2, /*background_from=*/1);
    const std::set<pid_t> ran = RunTogether(fewer, 2, three.mask());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (pid_t tid : ran) {
      const cpu_set_t mask = MaskOf(tid);
      EXPECT_TRUE(CPU_EQUAL(&mask, &three.mask())) << "worker " << tid;
    }
  }
  constexpr int kCpus = 2;
  const FirstCpus two(allowed, kCpus);
  ThreadPool pool(kCpus, /*background_from=*/1);
  bool late = false, homed = false;
  for (int attempt = 0; attempt < 3 && !homed; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5100));
    std::set<pid_t> workers;
    late = false;
    for (int round = 0; round < 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      const std::set<pid_t> ran = RunTogether(pool, kCpus, two.mask());  // every worker woken
      late = late || std::chrono::steady_clock::now() - start > std::chrono::milliseconds(1);
      workers.insert(ran.begin(), ran.end());
    }
    ASSERT_EQ(workers.size(), static_cast<size_t>(kCpus));
    // Asleep again (give them a moment to get there): one CPU each, apart.
    std::set<int> homes;
    for (int wait = 0; wait < 400 && homes.size() != workers.size(); ++wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      homes.clear();
      for (pid_t tid : workers) {
        const cpu_set_t mask = MaskOf(tid);
        if (CPU_COUNT(&mask) != 1) break;
        for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
          if (CPU_ISSET(cpu, &mask) && CPU_ISSET(cpu, &two.mask())) homes.insert(cpu);
        }
      }
    }
    homed = homes.size() == workers.size();
    ASSERT_TRUE(homed || late) << "the workers started on time but do not sleep on a CPU each";
  }
  if (!homed) GTEST_SKIP() << "the machine was too busy for the workers to start on time";
}
#endif

}  // namespace
}  // namespace turbokv
