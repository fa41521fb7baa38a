// The daemon's logic: every KvCacheService call as a plain C++ function with
// absl::Status results, testable without a network. Validates each request
// fully (fields, shapes, dtypes, lengths, finite values, positions, budget)
// before it changes anything, so a failed call changes nothing. Thread-safe:
// calls on one session are serialized by the session, calls on different
// sessions run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/metrics.h"
#include "service/store/session_store.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {

class ThreadPool;

struct HandlerOptions {
  // Runs the attention kernels (nullptr: on the calling thread).
  ThreadPool* kernel_pool = nullptr;
  // Most tokens a layer may hold, and the default of a session's max_tokens.
  int64_t max_tokens = int64_t{1} << 20;
  // Default idle TTL of a session (zero: none).
  absl::Duration session_ttl = absl::ZeroDuration();
  // ReadKv messages are sized to stay under this many bytes of tensor data.
  size_t max_message_bytes = size_t{64} << 20;
  // Reported by Stats, e.g. "cpu (simd:AVX3_DL, 2 threads)".
  std::string device = "cpu";
  // Counts appended tokens, attended queries and kernel time (nullptr: none).
  Metrics* metrics = nullptr;
};

// A ReadKv call in progress: which layers and range, and how far it got.
struct ReadKvCursor {
  std::shared_ptr<SessionCache> session;
  std::vector<int> layers;
  std::vector<int64_t> ends;  // per layer
  int64_t start = 0;
  v1::DType dtype = v1::DTYPE_F32;
  int64_t tokens_per_message = 0;
  size_t layer_index = 0;  // next message: layers[layer_index] from position
  int64_t position = 0;
};

// Every call takes the caller's tenant (from its bearer token; empty when the
// daemon runs without --auth-tokens-file) and sees only that tenant's
// sessions.
class Handler {
 public:
  Handler(SessionStore* store, const HandlerOptions& options);

  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::SessionInfo> GetSession(const v1::GetSessionRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const v1::ListSessionsRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::DeleteSessionResponse> DeleteSession(const v1::DeleteSessionRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::SessionInfo> TruncateSession(const v1::TruncateSessionRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const v1::ForkSessionRequest& request,
      const std::string& tenant = "");
  // One message of an Append stream.
  absl::StatusOr<v1::AppendResponse> Append(const v1::AppendRequest& request,
      const std::string& tenant = "");
  // One message of an Attend stream.
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request,
      const std::string& tenant = "");
  // ReadKv: StartReadKv checks the request; each NextReadKv fills the next
  // message and returns true, or returns false when the range is done.
  absl::StatusOr<ReadKvCursor> StartReadKv(const v1::ReadKvRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<bool> NextReadKv(ReadKvCursor& cursor, v1::ReadKvResponse* response);
  // Daemon-wide totals, the same for every tenant (no ids).
  absl::StatusOr<v1::StatsResponse> Stats(const v1::StatsRequest& request, const std::string& tenant = "");

  // Writes every session to the snapshot dir.
  absl::StatusOr<v1::SnapshotResponse> Snapshot(const v1::SnapshotRequest& request, const std::string& tenant = "");

  SessionStore& store() { return *store_; }

 private:
  // The session, locked, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<SessionCache>> FindLocked(const std::string& id, const std::string& tenant,
                                                           std::unique_lock<std::mutex>* lock);
  // Takes the pages of a chunk for each layer, making room first (and
  // evicting, with lru); all or none.
  absl::StatusOr<std::vector<LayerCache::PendingAppend>> PrepareAppend(SessionCache& session,
                                                                       const std::vector<int>& layers,
                                                                       int64_t start, int64_t n);
  // Each layer's length before and after a stored chunk.
  struct StoredChunk {
    std::vector<int64_t> before;
    std::vector<int64_t> after;
  };
  // PrepareAppend, then encodes keys and values ([layers.size()][n][kv_heads]
  // [head_dim]) into each layer and counts them in the metrics.
  absl::StatusOr<StoredChunk> StoreChunk(SessionCache& session, const std::vector<int>& layers, int64_t start,
                                         int64_t n, const float* keys, const float* values);
  v1::SessionInfo Info(const SessionCache& session) const;  // session locked

  SessionStore* store_;
  HandlerOptions options_;
};

}  // namespace turbokv
