// The memory of one device's compressed caches: pages counted against a byte
// budget. A page returns its bytes to the budget when its last holder (a
// layer cache, or a fork sharing it) lets go.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace turbokv {

class TierRecord;

struct Page {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  // The record of this page on the spill tier, once it is sealed (full) and
  // queued there; shared by every session holding the page. Guarded by the
  // store (SessionStore::WriteThrough).
  std::shared_ptr<TierRecord> record;
};

class PagePool {
 public:
  explicit PagePool(size_t budget_bytes) : budget_(budget_bytes) {}
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A zeroed page of `bytes`. RESOURCE_EXHAUSTED, naming the bytes used,
  // needed and the budget, when it does not fit. Thread-safe. The pool must
  // outlive its pages.
  absl::StatusOr<std::shared_ptr<Page>> Allocate(size_t bytes);

  // Counts `bytes` of memory held outside pages (a session's metadata)
  // against the budget until the returned token goes; RESOURCE_EXHAUSTED as
  // Allocate.
  absl::StatusOr<std::shared_ptr<const void>> Charge(size_t bytes);

  // Pages of at least this many bytes are mapped from the kernel directly.
  static constexpr size_t kMapThreshold = size_t{32} << 10;

  size_t used_bytes() const { return used_.load(std::memory_order_relaxed); }
  size_t budget_bytes() const { return budget_; }

 private:
  // Counts bytes against the budget, or RESOURCE_EXHAUSTED.
  absl::Status Take(size_t bytes);

  const size_t budget_;
  std::atomic<size_t> used_{0};
};

}  // namespace turbokv
