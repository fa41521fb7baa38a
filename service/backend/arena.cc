#include "service/backend/arena.h"

namespace turbokv {

ArenaAllocator::ArenaAllocator(size_t capacity, size_t alignment)
    : capacity_(capacity & ~(alignment - 1)), alignment_(alignment) {
  if (capacity_ > 0) AddFree(0, capacity_);
}

std::optional<size_t> ArenaAllocator::Allocate(size_t bytes) {
  const size_t size = Round(bytes == 0 ? 1 : bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  auto best = by_size_.lower_bound({size, 0});
  if (best == by_size_.end()) return std::nullopt;
  const auto [range_size, offset] = *best;
  by_size_.erase(best);
  by_offset_.erase(offset);
  if (range_size > size) {
    by_offset_.emplace(offset + size, range_size - size);
    by_size_.emplace(range_size - size, offset + size);
  }
  used_ += size;
  return offset;
}

void ArenaAllocator::Free(size_t offset, size_t bytes) {
  const size_t size = Round(bytes == 0 ? 1 : bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  used_ -= size;
  AddFree(offset, size);
}

void ArenaAllocator::AddFree(size_t offset, size_t bytes) {
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && offset + bytes == next->first) {
    bytes += next->second;
    by_size_.erase({next->second, next->first});
    next = by_offset_.erase(next);
  }
  if (next != by_offset_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == offset) {
      offset = previous->first;
      bytes += previous->second;
      by_size_.erase({previous->second, previous->first});
      by_offset_.erase(previous);
    }
  }
  by_offset_.emplace(offset, bytes);
  by_size_.emplace(bytes, offset);
}

ArenaAllocator::Usage ArenaAllocator::usage() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Usage usage;
  usage.capacity = capacity_;
  usage.used = used_;
  usage.free_ranges = by_offset_.size();
  usage.largest_free = by_size_.empty() ? 0 : by_size_.rbegin()->first;
  return usage;
}

}  // namespace turbokv
