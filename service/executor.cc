#include "service/executor.h"

#include <algorithm>
#include <limits>

namespace turbokv {

Executor::Executor(int threads, int tenant_share) : tenant_share_(tenant_share > 0 ? tenant_share : threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

Executor::~Executor() { Shutdown(); }

bool Executor::Submit(Work work) {
  std::sort(work.keys.begin(), work.keys.end());
  work.keys.erase(std::unique(work.keys.begin(), work.keys.end()), work.keys.end());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    queue_.push_back(std::move(work));
  }
  wake_.notify_one();
  return true;
}

void Executor::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

size_t Executor::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

std::list<Executor::Work>::iterator Executor::Next() {
  // Keys of earlier work, runnable or not: later work on them must not
  // overtake it.
  std::unordered_set<std::string> earlier;
  auto best = queue_.end();
  uint64_t best_served = std::numeric_limits<uint64_t>::max();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const bool free = std::none_of(it->keys.begin(), it->keys.end(), [&](const std::string& key) {
      return busy_.count(key) != 0 || earlier.count(key) != 0;
    });
    earlier.insert(it->keys.begin(), it->keys.end());
    if (!free) continue;
    auto running = running_.find(it->tenant);
    if (!it->continuation && running != running_.end() && running->second >= tenant_share_) continue;
    auto served = served_.find(it->tenant);
    const uint64_t when = served == served_.end() ? 0 : served->second;
    if (when < best_served) {
      best = it;
      best_served = when;
      if (when == 0) break;  // a tenant never served goes first
    }
  }
  return best;
}

void Executor::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    auto next = queue_.end();
    wake_.wait(lock, [&] {
      next = Next();
      return next != queue_.end() || (stopping_ && queue_.empty());
    });
    if (next == queue_.end()) return;
    Work work = std::move(*next);
    queue_.erase(next);
    busy_.insert(work.keys.begin(), work.keys.end());
    served_[work.tenant] = ++serves_;
    ++running_[work.tenant];
    lock.unlock();
    work.run();
    work.run = nullptr;  // whatever it captured goes before the keys are free
    lock.lock();
    for (const std::string& key : work.keys) busy_.erase(key);
    const bool at_share = running_[work.tenant]-- == tenant_share_;
    // Work waiting on these keys, or on its tenant's share, may run now.
    if (!work.keys.empty() || at_share) wake_.notify_all();
  }
}

}  // namespace turbokv
