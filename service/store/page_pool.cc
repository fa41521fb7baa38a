#include "service/store/page_pool.h"

#include "service/backend/backend.h"
#include "service/store/tiers/tier.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace turbokv {

absl::Status PagePool::Take(size_t bytes) {
  size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > budget_ || used > budget_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("memory budget exceeded: ", used,
                                                       " bytes used, ", bytes, " needed, budget ",
                                                       budget_, " bytes"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const void>> PagePool::Charge(size_t bytes) {
  if (absl::Status taken = Take(bytes); !taken.ok()) return taken;
  return std::shared_ptr<const void>(static_cast<const void*>(this), [this, bytes](const void*) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    released_.fetch_add(bytes, std::memory_order_relaxed);
  });
}

absl::StatusOr<std::shared_ptr<Page>> PagePool::Allocate(size_t bytes) {
  if (absl::Status taken = Take(bytes); !taken.ok()) return taken;
  absl::StatusOr<uint8_t*> data = backend_->AllocatePage(bytes);
  if (!data.ok()) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return data.status();
  }
  return std::shared_ptr<Page>(new Page{*data, bytes, nullptr}, [this](Page* page) {
    backend_->FreePage(page->data, page->bytes);
    used_.fetch_sub(page->bytes, std::memory_order_relaxed);
    released_.fetch_add(page->bytes, std::memory_order_relaxed);
    delete page;
  });
}

}  // namespace turbokv
