#include "service/store/page_pool.h"

#include "service/store/tiers/tier.h"

#include <sys/mman.h>

#include <new>

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
  });
}

absl::StatusOr<std::shared_ptr<Page>> PagePool::Allocate(size_t bytes) {
  if (absl::Status taken = Take(bytes); !taken.ok()) return taken;
  // Large pages come straight from the kernel (zeroed) and go back to it
  // when freed, so the process's memory follows the pool's; small ones
  // would waste most of a 4 KiB mapping and come from the heap.
  const bool mapped = bytes >= kMapThreshold;
  uint8_t* data = nullptr;
  if (mapped) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) data = static_cast<uint8_t*>(p);
  } else {
    data = new (std::nothrow) uint8_t[bytes]();
  }
  if (data == nullptr) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  return std::shared_ptr<Page>(new Page{data, bytes, nullptr}, [this, mapped](Page* page) {
    used_.fetch_sub(page->bytes, std::memory_order_relaxed);
    if (mapped) {
      munmap(page->data, page->bytes);
    } else {
      delete[] page->data;
    }
    delete page;
  });
}

}  // namespace turbokv
