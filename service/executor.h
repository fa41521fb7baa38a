// The daemon's worker threads: reactors hand every piece of work here and
// return at once, so gRPC's threads never block on the kernels.
//
// Work names the sessions it touches (its keys). Work sharing a key runs one
// at a time, in the order submitted, and waits in the queue, not on a
// worker, while another holds the key: a backlog on one busy session never
// takes the workers that other sessions' calls need. Of the work that can
// run, the next goes to the tenant served least recently, and no tenant
// holds more than `tenant_share` workers at once: one tenant's backlog never
// takes every worker from another's calls.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace turbokv {

class Executor {
 public:
  struct Work {
    std::string tenant;
    std::vector<std::string> keys;  // the sessions it touches; empty: none
    std::function<void()> run;
    // The next step of a call that keeps a session in a call between steps
    // (a ReadKv stream): not held to its tenant's share, since the calls
    // waiting for that session's memory may hold the share.
    bool continuation = false;
  };

  // tenant_share: most workers one tenant's work holds at once (0: all).
  explicit Executor(int threads, int tenant_share = 0);
  ~Executor();  // Shutdown()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues the work; false (not run) once Shutdown has begun.
  bool Submit(Work work);
  // Runs what is queued, then joins the threads.
  void Shutdown();
  // Work queued and not yet started.
  size_t queued() const;

 private:
  void Loop();
  // Under mutex_: the work to start next, or queue_.end() when none can.
  std::list<Work>::iterator Next();

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::list<Work> queue_;
  std::unordered_set<std::string> busy_;              // keys held by running work
  std::unordered_map<std::string, uint64_t> served_;  // tenant -> when it last got a worker
  std::unordered_map<std::string, int> running_;      // tenant -> workers it holds
  int tenant_share_;
  uint64_t serves_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace turbokv
