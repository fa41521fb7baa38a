// The client's side of shared memory (docs/API.md, "Shared memory"). A
// Client connected over a unix socket creates one memfd region, seals it
// against resizing, and hands it to the daemon over the socket beside the
// daemon's (its path with ".shm" appended) on first use. A call then puts
// its tensors, and room for its results, in a block of that region, and
// its messages carry only the slices. Where anything of this fails (the
// daemon is not on this machine, serves no shared memory, restarted, or
// the region is full), calls send their tensors in the message as before.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/time/time.h"

namespace turbokv {

class SharedRegionMapping;

// A block of the region, given back when destroyed.
class SharedBlock {
 public:
  SharedBlock(std::shared_ptr<SharedRegionMapping> region, uint64_t offset, size_t size);
  ~SharedBlock();
  SharedBlock(const SharedBlock&) = delete;
  SharedBlock& operator=(const SharedBlock&) = delete;

  uint8_t* data() const;
  uint64_t offset() const { return offset_; }  // within the region
  size_t size() const { return size_; }
  const std::string& region_id() const;

 private:
  std::shared_ptr<SharedRegionMapping> region_;
  uint64_t offset_;
  size_t size_;
};

class SharedChannel {
 public:
  // For target unix:///PATH (or unix:PATH): the daemon's PATH.shm, a region
  // of `bytes`, and `token` for the daemon's --auth-tokens-file. nullptr for
  // any other target or bytes == 0.
  static std::shared_ptr<SharedChannel> For(const std::string& target, size_t bytes, const std::string& token);

  // A block of at least `bytes`, 64-byte aligned, registering the region
  // first if need be; nullptr when there is none to be had (send bytes).
  std::unique_ptr<SharedBlock> Allocate(size_t bytes);
  // The daemon no longer knows the region (it restarted, say): the next
  // Allocate registers a new one.
  void Forget();

 private:
  SharedChannel(std::string socket_path, size_t bytes, std::string token)
      : socket_path_(std::move(socket_path)), bytes_(bytes), token_(std::move(token)) {}

  const std::string socket_path_;
  const size_t bytes_;
  const std::string token_;
  std::mutex mutex_;
  std::shared_ptr<SharedRegionMapping> region_;
  absl::Time retry_after_ = absl::InfinitePast();  // after a failed registration
};

// One registration message on a connection to the daemon's .shm socket:
// "turbokv-shm 1\n" and `token`, with `fd` attached (SCM_RIGHTS; none when
// fd < 0). false when it could not be sent.
bool SendRegistration(int connection, const std::string& token, int fd);

// Rounds up to the 64-byte boundary tensors are placed at.
inline size_t SharedAligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace turbokv
