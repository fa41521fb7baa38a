// Carves pages out of one preallocated block of device memory (a CUDA
// backend's arena): offsets only, no device calls, so that it is tested on
// any machine. Best fit over free ranges that coalesce with their neighbours
// when freed: pages of one session shape reuse each other's ranges exactly,
// and mixed shapes fragment little. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

namespace turbokv {

class ArenaAllocator {
 public:
  // `capacity` bytes; every range starts and is sized on a multiple of
  // `alignment` (a power of two).
  ArenaAllocator(size_t capacity, size_t alignment);

  // The offset of `bytes` (rounded up to the alignment), or nullopt when no
  // free range holds them.
  std::optional<size_t> Allocate(size_t bytes);
  // Gives back a range of Allocate (the same size).
  void Free(size_t offset, size_t bytes);

  struct Usage {
    size_t capacity = 0;
    size_t used = 0;           // allocated, rounded sizes
    size_t free_ranges = 0;    // pieces the free bytes are in
    size_t largest_free = 0;   // the most one Allocate can get
  };
  Usage usage() const;

 private:
  size_t Round(size_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }
  // Under mutex_: adds a free range, merged with its neighbours.
  void AddFree(size_t offset, size_t bytes);

  const size_t capacity_;
  const size_t alignment_;
  mutable std::mutex mutex_;
  size_t used_ = 0;
  std::map<size_t, size_t> by_offset_;            // free ranges: offset -> size
  std::set<std::pair<size_t, size_t>> by_size_;   // the same: (size, offset)
};

}  // namespace turbokv
