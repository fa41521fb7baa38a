// The memory of one device's compressed caches: pages of a backend (host or
// device memory, service/backend/) counted against a byte budget. A page
// returns its bytes to the budget, and its memory to the backend, when its
// last holder (a layer cache, or a fork sharing it) lets go.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace turbokv {

class Backend;
class TierRecord;

struct Page {
  uint8_t* data = nullptr;  // on the backend: host or device memory
  size_t bytes = 0;
  // The record of this page on the spill tier, once it is sealed (full) and
  // queued there; shared by every session holding the page. Guarded by
  // Residency's records mutex (Residency::WriteThrough).
  std::shared_ptr<TierRecord> record;
};

class PagePool {
 public:
  // The backend gives the pages' memory and must outlive the pool.
  PagePool(Backend* backend, size_t budget_bytes) : backend_(backend), budget_(budget_bytes) {}
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A page of `bytes`, zeroed or not as Backend::AllocatePage says.
  // RESOURCE_EXHAUSTED, naming the bytes used, needed and the budget, when
  // it does not fit. Thread-safe. The pool must outlive its pages.
  absl::StatusOr<std::shared_ptr<Page>> Allocate(size_t bytes);

  // Counts `bytes` of memory held outside pages (a session's metadata)
  // against the budget until the returned token goes; RESOURCE_EXHAUSTED as
  // Allocate.
  absl::StatusOr<std::shared_ptr<const void>> Charge(size_t bytes);

  size_t used_bytes() const { return used_.load(std::memory_order_relaxed); }
  // Bytes of pages and charges given back since the pool was made: grows
  // only, so that a reader sampling it now and then misses no release.
  size_t released_bytes() const { return released_.load(std::memory_order_relaxed); }
  size_t budget_bytes() const { return budget_; }
  Backend& backend() const { return *backend_; }

 private:
  // Counts bytes against the budget, or RESOURCE_EXHAUSTED.
  absl::Status Take(size_t bytes);

  Backend* const backend_;
  const size_t budget_;
  std::atomic<size_t> used_{0};
  std::atomic<size_t> released_{0};
};

}  // namespace turbokv
