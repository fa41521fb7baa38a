// Shared memory for clients on the same machine (docs/API.md, "Shared
// memory"). A client creates a memfd, seals it against shrinking, and hands
// it to the daemon over a unix socket of its own (SOCK_SEQPACKET, the fd
// passed with SCM_RIGHTS, the message "turbokv-shm 1\n" and its bearer
// token). The daemon
// maps it and answers with a region id; the tensors of the client's calls
// then travel through the region, and the gRPC messages carry only their
// slices (Tensor.shared, output_to).
//
// A region belongs to the tenant of the token it came with: another
// tenant's calls cannot name it. It stays mapped while its connection is
// open and while a call that uses it runs, and is released when the client
// closes the connection or dies. Sealed against shrinking, the memory
// cannot go from under the daemon's mapping (no SIGBUS); every slice is
// checked against the region's size.
//
// One thread accepts connections and registers regions (fstat, mmap): it
// never blocks on a client. Connections that do not register are bounded
// (in all, per process) and timed out; the listener never stops answering
// because of them, and rests for a moment, counted, when the process is
// out of descriptors.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace turbokv {

// What a registration message starts with (its bearer token follows).
inline constexpr absl::string_view kSharedMemoryHello = "turbokv-shm 1\n";

struct SharedMemoryOptions {
  std::string socket_path;                    // where clients connect
  size_t max_region_bytes = size_t{1} << 30;  // the largest region a client may register
  int max_connections = 1024;                 // connections open at once, registered or not
  // Connections that have not registered yet: at most this many in all and
  // from one process (SO_PEERCRED), each closed past register_timeout. A
  // client registers as it connects; one that holds connections open
  // without registering cannot keep others out.
  int max_unregistered = 64;
  int max_unregistered_per_peer = 8;
  absl::Duration register_timeout = absl::Seconds(2);
  // The tenant of a client's bearer token, or UNAUTHENTICATED (empty: no
  // tokens, one tenant, "").
  std::function<absl::StatusOr<std::string>(absl::string_view token)> tenant_of;
};

// Connections the listener turned away, by why, since it started.
struct SharedMemoryRefusals {
  int64_t descriptors = 0;  // accept failed: the process (or system) is out of descriptors
  int64_t limits = 0;       // over max_connections or an unregistered bound: closed at once, answered why
  int64_t timeouts = 0;     // not registered within register_timeout: closed
};

// One client's mapped memfd.
class SharedRegion {
 public:
  SharedRegion(std::string tenant, uint8_t* base, size_t size) : tenant_(std::move(tenant)), base_(base), size_(size) {}
  ~SharedRegion();  // unmaps
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  const std::string& tenant() const { return tenant_; }
  size_t size() const { return size_; }
  // Bytes [offset, offset + length); INVALID_ARGUMENT naming `field` when
  // they are not all within the region.
  absl::StatusOr<absl::Span<uint8_t>> Slice(uint64_t offset, uint64_t length, absl::string_view field) const;

 private:
  std::string tenant_;
  uint8_t* base_;
  size_t size_;
};

class SharedMemory {
 public:
  explicit SharedMemory(const SharedMemoryOptions& options) : options_(options) {}
  ~SharedMemory() { Stop(); }
  // Binds the socket (replacing a file no process serves) and starts
  // serving it. UNAVAILABLE naming the path when it cannot be bound.
  absl::Status Start();
  // Closes every connection, releasing its region (mapped on while a call
  // holds it), and removes the socket. Idempotent.
  void Stop();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  // The tenant's region `id`, held for as long as the caller keeps it.
  // NOT_FOUND when there is none: never registered, released, or another
  // tenant's.
  absl::StatusOr<std::shared_ptr<const SharedRegion>> Find(absl::string_view tenant, absl::string_view id) const;
  // Regions registered and not yet released, and their bytes: what the
  // daemon may map and touch of its clients' memory (each region at most
  // max_region_bytes).
  size_t regions() const;
  size_t region_bytes() const;
  SharedMemoryRefusals refusals() const;
  const std::string& socket_path() const { return options_.socket_path; }

 private:
  struct Connection {
    std::string id;          // its region's, "" until registered
    absl::Time deadline;     // to register by
    pid_t peer = 0;          // the connecting process (SO_PEERCRED)
  };

  void Loop();
  // Takes one connection the listener has, or turns it away (a bound, or no
  // descriptor left: then the listener rests for a moment, not spinning).
  void Accept(absl::Time now);
  // Closes the unregistered connections past their deadline; the earliest
  // deadline left.
  absl::Time CloseOverdue(absl::Time now);
  // A connection's first message: its token and memfd. Registers the region
  // or answers why not; false when the connection is to be closed.
  bool Register(int connection);
  void Close(int connection);

  const SharedMemoryOptions options_;
  int listener_ = -1;
  int wake_ = -1;  // eventfd: the destructor stops the loop
  std::thread thread_;
  // The loop's.
  std::unordered_map<int, Connection> connections_;
  absl::Time accept_after_ = absl::InfinitePast();  // the listener rests until then
  std::atomic<int64_t> refused_descriptors_{0}, refused_limits_{0}, refused_timeouts_{0};
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<const SharedRegion>> regions_;
};

}  // namespace turbokv
