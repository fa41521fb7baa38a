#include "service/store/page_pool.h"

#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace turbokv {

absl::StatusOr<std::shared_ptr<Page>> PagePool::Allocate(size_t bytes) {
  size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > budget_ || used > budget_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("memory budget exceeded: ", used,
                                                       " bytes used, ", bytes, " needed, budget ",
                                                       budget_, " bytes"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  uint8_t* data = new (std::nothrow) uint8_t[bytes]();
  if (data == nullptr) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  return std::shared_ptr<Page>(new Page{data, bytes}, [this](Page* page) {
    used_.fetch_sub(page->bytes, std::memory_order_relaxed);
    delete[] page->data;
    delete page;
  });
}

}  // namespace turbokv
