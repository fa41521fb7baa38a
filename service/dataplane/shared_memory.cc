#include "service/dataplane/shared_memory.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "service/log.h"
#include "service/records/session_id.h"

namespace turbokv {
namespace {

constexpr size_t kMaxMessageBytes = 4096;

void Answer(int connection, const std::string& text) {
  (void)send(connection, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace

SharedRegion::~SharedRegion() { munmap(base_, size_); }

absl::StatusOr<absl::Span<uint8_t>> SharedRegion::Slice(uint64_t offset, uint64_t length,
                                                       absl::string_view field) const {
  if (offset > size_ || length > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = [", offset, ", ", offset, " + ", length,
                                                   ") is not within the region's ", size_, " bytes"));
  }
  return absl::Span<uint8_t>(base_ + offset, length);
}

absl::Status SharedMemory::Start() {
  sockaddr_un address{};
  const std::string& path = options_.socket_path;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory socket path '", path, "' must be 1 to ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  listener_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener_ < 0) return absl::UnavailableError(absl::StrCat("shared-memory socket: ", std::strerror(errno)));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  (void)unlink(path.c_str());  // left by a daemon that did not stop cleanly (the caller checked none serves it)
  if (bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 || listen(listener_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot bind the shared-memory socket ", path, ": ", std::strerror(errno)));
  }
  wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_ < 0) return absl::UnavailableError(absl::StrCat("shared-memory socket: eventfd: ", std::strerror(errno)));
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void SharedMemory::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_, &one, sizeof(one));
    thread_.join();
  }
  while (!connections_.empty()) Close(connections_.begin()->first);
  if (wake_ >= 0) close(wake_);
  wake_ = -1;
  if (listener_ >= 0) {
    close(listener_);
    (void)unlink(options_.socket_path.c_str());
  }
  listener_ = -1;
}

absl::StatusOr<std::shared_ptr<const SharedRegion>> SharedMemory::Find(absl::string_view tenant,
                                                                      absl::string_view id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = regions_.find(std::string(id));
  if (it == regions_.end() || it->second->tenant() != tenant) {
    return absl::NotFoundError(absl::StrCat("no shared-memory region '", ShowId(id),
                                            "' for this caller (never registered, or its client has gone)"));
  }
  return it->second;
}

size_t SharedMemory::regions() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return regions_.size();
}

size_t SharedMemory::region_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t bytes = 0;
  for (const auto& [id, region] : regions_) bytes += region->size();
  return bytes;
}

SharedMemoryRefusals SharedMemory::refusals() const {
  return {refused_descriptors_.load(), refused_limits_.load(), refused_timeouts_.load()};
}

void SharedMemory::Loop() {
  std::vector<pollfd> polled;
  for (;;) {
    const absl::Time now = absl::Now();
    absl::Time wake_by = CloseOverdue(now);
    polled.clear();
    polled.push_back({wake_, POLLIN, 0});
    if (now >= accept_after_) {
      polled.push_back({listener_, POLLIN, 0});
    } else {
      wake_by = std::min(wake_by, accept_after_);
    }
    for (const auto& [fd, connection] : connections_) polled.push_back({fd, POLLIN, 0});
    const int timeout_ms =
        wake_by == absl::InfiniteFuture() ? -1 : static_cast<int>(absl::ToInt64Milliseconds(wake_by - now) + 1);
    if (poll(polled.data(), polled.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      Logf(LogLevel::kError, "shared-memory socket: poll: %s", std::strerror(errno));
      return;
    }
    if (polled[0].revents != 0) return;
    for (size_t i = 1; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      const int fd = polled[i].fd;
      if (fd == listener_) {
        Accept(absl::Now());
        continue;
      }
      if (connections_[fd].id.empty()) {
        if (!Register(fd)) Close(fd);
        continue;
      }
      // A registered client sends nothing more: anything, or the end of
      // the connection, releases its region.
      Close(fd);
    }
  }
}

void SharedMemory::Accept(absl::Time now) {
  static RateLimitedLog out_of_descriptors(absl::Seconds(10));
  static RateLimitedLog turned_away(absl::Seconds(10));
  const int connection = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (connection < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The connection waits in the backlog; accepting again at once would
      // only fail again, at full speed.
      refused_descriptors_.fetch_add(1);
      accept_after_ = now + absl::Milliseconds(100);
      out_of_descriptors.Log(LogLevel::kWarning,
                             absl::StrCat("shared-memory socket: cannot accept a connection: ", std::strerror(errno),
                                          " (turbokv_shared_memory_refused_connections_total{reason=\"descriptors\"}); "
                                          "trying again every 100 ms"));
    }
    return;
  }
  ucred peer{};
  socklen_t length = sizeof(peer);
  (void)getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &length);
  int unregistered = 0, from_peer = 0;
  for (const auto& [fd, c] : connections_) {
    if (!c.id.empty()) continue;
    ++unregistered;
    if (c.peer == peer.pid) ++from_peer;
  }
  std::string why;
  if (static_cast<int>(connections_.size()) >= options_.max_connections) {
    why = absl::StrCat(options_.max_connections, " connections are open");
  } else if (unregistered >= options_.max_unregistered) {
    why = absl::StrCat(unregistered, " connections wait to register");
  } else if (from_peer >= options_.max_unregistered_per_peer) {
    why = absl::StrCat("process ", peer.pid, " has ", from_peer, " connections waiting to register");
  }
  if (!why.empty()) {
    refused_limits_.fetch_add(1);
    Answer(connection, absl::StrCat("ERROR ", why, "; try again later (the client sends its tensors in the "
                                    "messages meanwhile)"));
    close(connection);
    turned_away.Log(LogLevel::kWarning, absl::StrCat("shared-memory socket: turned a connection away: ", why));
    return;
  }
  connections_.emplace(connection, Connection{"", now + options_.register_timeout, peer.pid});
}

absl::Time SharedMemory::CloseOverdue(absl::Time now) {
  absl::Time earliest = absl::InfiniteFuture();
  std::vector<int> overdue;
  for (const auto& [fd, c] : connections_) {
    if (!c.id.empty()) continue;
    if (c.deadline <= now) {
      overdue.push_back(fd);
    } else {
      earliest = std::min(earliest, c.deadline);
    }
  }
  for (int fd : overdue) {
    refused_timeouts_.fetch_add(1);
    Answer(fd, absl::StrCat("ERROR no registration within ", absl::FormatDuration(options_.register_timeout)));
    Close(fd);
  }
  return earliest;
}

bool SharedMemory::Register(int connection) {
  char text[kMaxMessageBytes + 1];
  iovec payload{text, sizeof(text)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr message{};
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(connection, &message, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  if (got <= 0) return false;
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t k = 0; k < n; ++k) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  const auto refuse = [&](const std::string& why) {
    for (int fd : fds) close(fd);
    Answer(connection, absl::StrCat("ERROR ", why));
    return false;
  };
  if ((message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    return refuse(absl::StrCat("the message must be at most ", kMaxMessageBytes, " bytes with one fd"));
  }
  absl::string_view token(text, static_cast<size_t>(got));
  if (!absl::ConsumePrefix(&token, kSharedMemoryHello)) {
    return refuse("the message must start with 'turbokv-shm 1' and a newline, then the bearer token");
  }
  if (fds.size() != 1) return refuse(absl::StrCat("the message must carry one fd (SCM_RIGHTS), not ", fds.size()));
  std::string tenant;
  if (options_.tenant_of) {
    absl::StatusOr<std::string> who = options_.tenant_of(token);
    if (!who.ok()) return refuse(std::string(who.status().message()));
    tenant = *std::move(who);
  }
  const int memfd = fds[0];
  const int seals = fcntl(memfd, F_GET_SEALS);
  if (seals < 0) return refuse("the fd is not a memfd (memfd_create with MFD_ALLOW_SEALING)");
  if ((seals & F_SEAL_SHRINK) == 0) return refuse("the memfd must be sealed against shrinking (F_SEAL_SHRINK)");
  struct stat st {};
  if (fstat(memfd, &st) != 0 || !S_ISREG(st.st_mode)) return refuse("cannot stat the memfd");
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0 || size > options_.max_region_bytes) {
    return refuse(absl::StrCat("the region has ", size, " bytes; it must have 1 to ", options_.max_region_bytes,
                               " (--shared-memory-max-bytes)"));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (base == MAP_FAILED) return refuse(absl::StrCat("cannot map the region: ", std::strerror(errno)));
  close(memfd);
  const std::string id = NewSessionId();  // 128 random bits from the kernel's CSPRNG, as session ids
  {
    std::lock_guard<std::mutex> lock(mutex_);
    regions_.emplace(id, std::make_shared<const SharedRegion>(tenant, static_cast<uint8_t*>(base), size));
  }
  connections_[connection].id = id;
  Answer(connection, absl::StrCat("OK ", id, " ", size));
  return true;
}

void SharedMemory::Close(int connection) {
  auto it = connections_.find(connection);
  if (it == connections_.end()) return;
  if (!it->second.id.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    regions_.erase(it->second.id);
  }
  connections_.erase(it);
  close(connection);
}

}  // namespace turbokv
