#include "client/cpp/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <iterator>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace turbokv {

// One registered memfd: the mapping, the connection that keeps it
// registered (closing it releases the region in the daemon), and which
// parts of it are free.
class SharedRegionMapping {
 public:
  static std::shared_ptr<SharedRegionMapping> Register(const std::string& socket_path, size_t bytes,
                                                       const std::string& token);
  ~SharedRegionMapping() {
    if (connection_ >= 0) close(connection_);
    if (base_ != nullptr) munmap(base_, size_);
  }

  uint8_t* base() const { return base_; }
  const std::string& id() const { return id_; }

  // First fit; false when no free run is long enough.
  bool Take(size_t bytes, uint64_t* offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      *offset = it->first;
      const uint64_t rest = it->first + bytes;
      const size_t left = it->second - bytes;
      free_.erase(it);
      if (left > 0) free_.emplace(rest, left);
      return true;
    }
    return false;
  }
  void Give(uint64_t offset, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = free_.emplace(offset, bytes).first;
    if (auto after = std::next(next); after != free_.end() && next->first + next->second == after->first) {
      next->second += after->second;
      free_.erase(after);
    }
    if (next != free_.begin()) {
      auto before = std::prev(next);
      if (before->first + before->second == next->first) {
        before->second += next->second;
        free_.erase(next);
      }
    }
  }

 private:
  SharedRegionMapping() = default;

  int connection_ = -1;
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::string id_;
  std::mutex mutex_;
  std::map<uint64_t, size_t> free_;  // offset -> bytes
};

std::shared_ptr<SharedRegionMapping> SharedRegionMapping::Register(const std::string& socket_path, size_t bytes,
                                                                   const std::string& token) {
  std::shared_ptr<SharedRegionMapping> region(new SharedRegionMapping());
  const int memfd = memfd_create("turbokv-client", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) return nullptr;
  const bool sized = ftruncate(memfd, static_cast<off_t>(bytes)) == 0 &&
                     fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0;
  void* base = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0) : MAP_FAILED;
  if (base == MAP_FAILED) {
    close(memfd);
    return nullptr;
  }
  region->base_ = static_cast<uint8_t*>(base);
  region->size_ = bytes;
  // Non-blocking for connect: a daemon whose backlog is full is not waited
  // for (the tensors go in the messages; Allocate tries again later).
  region->connection_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (region->connection_ < 0 || socket_path.size() >= sizeof(address.sun_path)) {
    close(memfd);
    return nullptr;
  }
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  if (connect(region->connection_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
      fcntl(region->connection_, F_SETFL, fcntl(region->connection_, F_GETFL) & ~O_NONBLOCK) != 0) {
    close(memfd);
    return nullptr;
  }
  // The daemon answers at once, or turns the connection away saying why:
  // no wait past a second (a daemon that is stuck).
  const timeval timeout{1, 0};
  setsockopt(region->connection_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(region->connection_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  const bool sent = SendRegistration(region->connection_, token, memfd);
  close(memfd);  // the daemon holds its own copy now
  if (!sent) return nullptr;
  char answer[256];
  const ssize_t got = recv(region->connection_, answer, sizeof(answer) - 1, 0);
  if (got <= 0) return nullptr;
  // "OK <id> <size>" or "ERROR <why>"
  const std::vector<std::string> words = absl::StrSplit(absl::string_view(answer, static_cast<size_t>(got)), ' ');
  if (words.size() != 3 || words[0] != "OK") return nullptr;
  region->id_ = words[1];
  region->free_.emplace(0, bytes);
  return region;
}

bool SendRegistration(int connection, const std::string& token, int fd) {
  std::string payload = absl::StrCat("turbokv-shm 1\n", token);
  iovec io{payload.data(), payload.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return sendmsg(connection, &message, MSG_NOSIGNAL) >= 0;
}

SharedBlock::SharedBlock(std::shared_ptr<SharedRegionMapping> region, uint64_t offset, size_t size)
    : region_(std::move(region)), offset_(offset), size_(size) {}

SharedBlock::~SharedBlock() { region_->Give(offset_, size_); }

uint8_t* SharedBlock::data() const { return region_->base() + offset_; }

const std::string& SharedBlock::region_id() const { return region_->id(); }

std::shared_ptr<SharedChannel> SharedChannel::For(const std::string& target, size_t bytes, const std::string& token) {
  absl::string_view path(target);
  if (bytes == 0 || !(absl::ConsumePrefix(&path, "unix://") || absl::ConsumePrefix(&path, "unix:"))) return nullptr;
  return std::shared_ptr<SharedChannel>(new SharedChannel(absl::StrCat(path, ".shm"), SharedAligned(bytes), token));
}

std::unique_ptr<SharedBlock> SharedChannel::Allocate(size_t bytes) {
  std::shared_ptr<SharedRegionMapping> region;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (region_ == nullptr && absl::Now() >= retry_after_) {
      region_ = SharedRegionMapping::Register(socket_path_, bytes_, token_);
      // Not co-located, or no shared memory there: try again now and then
      // (the daemon may start later).
      if (region_ == nullptr) retry_after_ = absl::Now() + absl::Seconds(5);
    }
    region = region_;
  }
  uint64_t offset = 0;
  const size_t size = SharedAligned(bytes);
  if (region == nullptr || size == 0 || !region->Take(size, &offset)) return nullptr;
  return std::make_unique<SharedBlock>(std::move(region), offset, size);
}

void SharedChannel::Forget() {
  std::lock_guard<std::mutex> lock(mutex_);
  region_.reset();
  retry_after_ = absl::InfinitePast();
}

}  // namespace turbokv
