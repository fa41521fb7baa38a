// The daemon's logic: every KvCacheService call as a plain C++ function with
// absl::Status results, testable without a network. Validates each request
// fully (fields, shapes, dtypes, lengths, finite values, positions, budget)
// before it changes anything, so a failed call changes nothing. Thread-safe:
// calls on one session are serialized by the session, calls on different
// sessions run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "absl/time/time.h"
#include "kernels/attention.h"
#include "service/dataplane/shared_memory.h"
#include "service/dataplane/tensor_io.h"
#include "service/metrics.h"
#include "service/store/session_store.h"
#include "service/store/write_batch.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {

class ThreadPool;

struct HandlerOptions {
  // Reads demoted sessions' layers in parallel (nullptr: on the calling
  // thread). The kernels run on the store's backend.
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
  // Who may call Snapshot: nullopt, anyone (no authentication: one
  // tenant); else only this tenant (empty: nobody).
  std::optional<std::string> snapshot_tenant;
  // Regions of co-located clients, for tensors that name them (nullptr:
  // none; such tensors are refused).
  const SharedMemory* shared_memory = nullptr;
};

// A ReadKv call in progress: which layers and range, and how far it got.
struct ReadKvCursor {
  std::shared_ptr<SessionCache> session;
  std::unique_ptr<SessionInCall> in_call;  // for the whole stream: not demoted between its messages
  std::vector<int> layers;
  std::vector<int64_t> ends;  // per layer
  int64_t start = 0;
  v1::DType dtype = v1::DTYPE_F32;
  int64_t tokens_per_message = 0;
  size_t layer_index = 0;  // next message: layers[layer_index] from position
  int64_t position = 0;
};

// The deadline of the call this thread runs, for the waits inside it (a
// demoted session waiting for room in memory): the rpc layer sets it around
// each handler call, for as long as the object lives. Without one
// (absl::InfiniteFuture()), a wait lasts at most
// StoreOptions::promotion_patience.
class CallDeadline {
 public:
  explicit CallDeadline(absl::Time deadline);
  ~CallDeadline();
  CallDeadline(const CallDeadline&) = delete;
  CallDeadline& operator=(const CallDeadline&) = delete;
  static absl::Time Current();

 private:
  const absl::Time previous_;
};

// Every call takes the caller's tenant (from its bearer token; empty when the
// daemon runs without --auth-tokens-file) and sees only that tenant's
// sessions.
class Handler {
 public:
  Handler(SessionStore* store, const HandlerOptions& options);

  // The most a stream message's reply can take, from its request's shapes
  // alone (before the request is checked or run): the in-flight bound counts
  // it when the message is admitted, not once the reply is made.
  static int64_t ReplyBytes(const v1::AppendRequest& request);
  static int64_t ReplyBytes(const v1::AttendRequest& request);
  static int64_t ReplyBytes(const v1::DecodeRequest& request);

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
  absl::StatusOr<v1::NameBlocksResponse> NameBlocks(const v1::NameBlocksRequest& request,
      const std::string& tenant = "");
  // One message of an Append stream.
  absl::StatusOr<v1::AppendResponse> Append(const v1::AppendRequest& request,
      const std::string& tenant = "");
  // One message of an Attend stream.
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request,
      const std::string& tenant = "");
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request,
      const std::string& tenant = "");
  // One message of a Decode stream: one layer's step for a batch of
  // sessions. A malformed message (tensors that do not match the batch, bad
  // options) is an error; a bad item (unknown session, wrong position or
  // shape, budget) fails alone in the response's per-item status and changes
  // nothing of its session, while the other items are applied.
  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& request,
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
  // Brings demoted sessions back into memory; a status per session.
  absl::StatusOr<v1::PrefetchResponse> Prefetch(const v1::PrefetchRequest& request, const std::string& tenant = "");

  SessionStore& store() { return *store_; }

 private:
  // The session, locked and (unless !promote) in memory, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<SessionCache>> FindLocked(const std::string& id, const std::string& tenant,
                                                           std::unique_lock<std::mutex>* lock, bool promote = true);
  // Brings a demoted session (locked, as are those in `held`) back into
  // memory, timed in the metrics.
  absl::Status Promote(SessionCache& session, absl::Span<const SessionCache* const> held);
  // FindLocked, then INVALID_ARGUMENT unless `layer` is one of the session's.
  absl::StatusOr<std::shared_ptr<SessionCache>> FindLockedLayer(const std::string& id, const std::string& tenant,
                                                                int layer, std::unique_lock<std::mutex>* lock);
  // The sessions of a batch, each found once and locked in one global order
  // (by id), so that batches sharing sessions cannot deadlock.
  struct LockedBatch {
    std::vector<absl::Status> status;                     // per item
    std::vector<std::shared_ptr<SessionCache>> sessions;  // per item; null where status is not OK
    std::vector<std::unique_lock<std::mutex>> locks;
    std::vector<const SessionCache*> held;                // the sessions locked
  };
  LockedBatch FindLockedBatch(const google::protobuf::RepeatedPtrField<std::string>& ids, const std::string& tenant);
  // Why a session found and then seen gone() under its lock is gone.
  absl::Status GoneStatus(const std::string& id, const std::string& tenant);

  // Counts a batch's applied writes in the metrics: new tokens and each
  // chunk's quantization error.
  void CountApplied(const WriteBatch& batch);
  // Encodes the batch's chunks in one job of the backend (timed), then
  // applies them all and counts them (on error none is: the layers stay as
  // they were).
  absl::Status EncodeAndApply(WriteBatch& batch);
  // The problems as one batch on the backend, timed in the metrics; the
  // chunks of new_tokens stored first, in the same call, when there are
  // some (Backend::EncodeAndAttend: the problems may read their pages).
  absl::Status RunBatch(const std::vector<AttentionProblem>& problems, const AttentionParams& params,
                        int64_t queries, absl::Span<const EncodeChunk> new_tokens = {});
  // Where the result of n queries (output and lse) goes: the response, or
  // the request's output_to.
  template <typename Request>
  absl::StatusOr<ResultSink> OpenResultSink(const Request& request, const std::string& tenant, int64_t n, int q_heads,
                                            int head_dim) const;
  // Attention of n queries at `positions` (checked) over one stored layer,
  // its output and lse into `sink`.
  absl::Status RunAttention(const LayerCache& layer, const AttentionParams& params, int64_t n,
                            const std::vector<float>& queries, const std::vector<int64_t>& positions,
                            ResultSink& sink, v1::AttentionResult* result);
  v1::SessionInfo Info(const SessionCache& session) const;  // session locked

  SessionStore* store_;
  HandlerOptions options_;
};

}  // namespace turbokv
