// The executor's scheduling: work on a busy session waits in the queue, not
// on a worker; runnable work goes round-robin over tenants.
#include "service/executor.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace turbokv {
namespace {

// A gate the test opens.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    wake_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool open_ = false;
};

TEST(ExecutorTest, ABacklogOnOneSessionDoesNotHoldTheWorkers) {
  Executor executor(2);
  Gate release, other_ran;
  std::atomic<int> on_busy{0};
  // Nine calls on session "a"; the first blocks until released.
  ASSERT_TRUE(executor.Submit({"tenant-a", {"a"}, [&] {
    release.Wait();
    ++on_busy;
  }}));
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(executor.Submit({"tenant-a", {"a"}, [&] { ++on_busy; }}));
  // Another tenant's call on another session runs at once on the free worker.
  ASSERT_TRUE(executor.Submit({"tenant-b", {"b"}, [&] { other_ran.Open(); }}));
  other_ran.Wait();
  EXPECT_EQ(on_busy.load(), 0);
  EXPECT_EQ(executor.queued(), 8u);
  release.Open();
  executor.Shutdown();
  EXPECT_EQ(on_busy.load(), 9);
}

TEST(ExecutorTest, WorkOnASessionRunsInOrderAndNeverTwoAtOnce) {
  Executor executor(4);
  std::mutex mutex;
  std::vector<int> order;
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};
  for (int i = 0; i < 200; ++i) {
    // Alternating single- and two-session work over sessions x and y.
    std::vector<std::string> keys = i % 3 == 0 ? std::vector<std::string>{"x", "y"} : std::vector<std::string>{"x"};
    ASSERT_TRUE(executor.Submit({"t", keys, [&, i] {
      if (inside.fetch_add(1) != 0) overlapped = true;
      {
        std::lock_guard<std::mutex> lock(mutex);
        order.push_back(i);
      }
      inside.fetch_sub(1);
    }}));
  }
  executor.Shutdown();
  EXPECT_FALSE(overlapped.load());
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
}

TEST(ExecutorTest, RunnableWorkGoesRoundRobinOverTenants) {
  Executor executor(1);
  Gate release;
  std::mutex mutex;
  std::vector<std::string> order;
  ASSERT_TRUE(executor.Submit({"a", {}, [&] { release.Wait(); }}));
  auto record = [&](std::string who) {
    return [&, who] {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(who);
    };
  };
  // Tenant a queues ten calls, then b two: b does not wait for all of a's.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(executor.Submit({"a", {}, record("a")}));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(executor.Submit({"b", {}, record("b")}));
  release.Open();
  executor.Shutdown();
  ASSERT_EQ(order.size(), 12u);
  EXPECT_EQ(order[0], "b");  // a was served last (the blocking call)
  EXPECT_EQ(order[1], "a");
  EXPECT_EQ(order[2], "b");
  EXPECT_FALSE(executor.Submit({"a", {}, [] {}}));  // after Shutdown
}

TEST(ExecutorTest, ATenantHoldsAtMostItsShareOfTheWorkers) {
  Executor executor(4, 2);
  Gate release, other_ran;
  std::atomic<int> started{0};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(executor.Submit({"greedy", {}, [&] {
      ++started;
      release.Wait();
    }}));
  }
  ASSERT_TRUE(executor.Submit({"other", {}, [&] { other_ran.Open(); }}));
  other_ran.Wait();
  EXPECT_LE(started.load(), 2);
  release.Open();
  executor.Shutdown();
  EXPECT_EQ(started.load(), 4);
}

// A stream's next step (a continuation) runs although its tenant holds its
// share: the tenant's calls holding the share may be waiting for it.
TEST(ExecutorTest, AContinuationIsNotHeldToItsTenantsShare) {
  Executor executor(4, 2);
  Gate release, continued;
  std::atomic<int> started{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(executor.Submit({"tenant", {}, [&] {
      ++started;
      release.Wait();
    }}));
  }
  ASSERT_TRUE(executor.Submit({"tenant", {"stream"}, [&] { continued.Open(); }, /*continuation=*/true}));
  continued.Wait();  // would wait for `release` were it held to the share
  EXPECT_LE(started.load(), 2);
  release.Open();
  executor.Shutdown();
}

}  // namespace
}  // namespace turbokv
