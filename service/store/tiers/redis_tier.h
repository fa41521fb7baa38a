// The Redis tier (--redis-url): sessions' pages and manifests in a Redis
// shared by several daemons, so that a session outlives the daemon that
// wrote it (docs/FORMAT.md, "Redis keys"; docs/OPERATIONS.md, "Redis tier").
//
// Every key of a session carries its id as the hash tag and its tenant:
//   turbokv:{ID}:TENANT_HEX:e   the epoch, raised by each daemon that claims it
//   turbokv:{ID}:TENANT_HEX:l   the lease: "OWNER EPOCH", with an expiry
//   turbokv:{ID}:TENANT_HEX:m   the manifest: header, layer lengths, pages
//   turbokv:{ID}:TENANT_HEX:h   sealed pages written since the manifest
//   turbokv:{ID}:TENANT_HEX:p:OWNER:LSN   a page
//   turbokv:{ID}:TENANT_HEX:d:LAYER   new slots of the layer's last page,
//                                      appended until the page is sealed
// One writer thread sends the records queued by the request path, in order;
// every write is a script that first checks that the session's epoch is
// still this daemon's, so a daemon whose session was claimed by another
// cannot change it. The writer renews the leases every third of their
// length. A page key goes when its last handle does (a page of a fork listed
// by the fork's manifest is copied into the fork's keys first). While Redis
// does not answer, records wait in the queue (bounded for write-through)
// and are sent when it is back; a store that acknowledges appends only once
// Redis holds them (holds_every_append) waits for their records instead,
// the new slots of a layer's last page among them (PutTails: entries
// appended to d:LAYER, several calls' pipelined in one round trip), and
// refuses the append when they do not arrive. No gRPC types.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "service/store/tiers/redis_client.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

struct RedisTierOptions {
  RedisAddress address;
  size_t budget_bytes = size_t{64} << 30;  // of live records in Redis
  int page_tokens = 64;
  absl::Duration timeout = absl::Seconds(1);  // to connect, and per reply
  absl::Duration lease = absl::Seconds(10);
  // A session's keys expire this long after their owner last refreshed them
  // (every quarter of it): those of a session nobody holds go.
  absl::Duration orphan_ttl = absl::Hours(24 * 7);
  // Queued bytes past which writes that may wait (write-through) are
  // refused, or, acknowledging once written, wait for room while Redis
  // answers; writes that may not (a demotion, the drain) may take twice it.
  size_t max_queued_bytes = size_t{64} << 20;
  // Appends are acknowledged once Redis holds them, the new slots of
  // partly filled last pages included (--redis-acknowledge=written); with
  // false (=queued), once queued for the writer: faster, but an owner cut
  // off from Redis, or killed, loses what was still queued.
  bool acknowledge_written = true;
};

class RedisTier final : public SharedTier {
 public:
  // Starts the writer. A Redis that does not answer is no error (the tier
  // is unhealthy until it does); one that evicts keys under memory
  // pressure (any maxmemory-policy but noeviction) is FAILED_PRECONDITION
  // naming its policy. Without an append-only file, a warning.
  static absl::StatusOr<std::unique_ptr<RedisTier>> Open(const RedisTierOptions& options);
  // Sends what is queued while Redis answers, and stops the writer. Every
  // handle must be gone first.
  ~RedisTier() override;

  const char* name() const override { return "redis"; }
  absl::StatusOr<TierScanReport> Scan() override;
  absl::StatusOr<std::shared_ptr<TierRecord>> PutPage(const PageKey& key, absl::string_view page, bool force) override;
  std::shared_ptr<TierRecord> PutManifest(const TierSession& session) override;
  bool holds_every_append() const override { return options_.acknowledge_written; }
  absl::StatusOr<std::shared_ptr<TierRecord>> PutTails(const std::string& session, const std::string& tenant,
                                                        std::vector<TailWrite> tails) override;
  void PutTombstone(const std::string& session, const std::string& tenant) override;
  absl::Status Wait(const TierRecord& record) override;
  absl::Status Read(const TierRecord& record, uint8_t* out, size_t bytes) override;
  void WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) override;
  absl::Status Sync() override;
  void Close() override;
  TierStats Stats() const override;
  absl::StatusOr<TierSession> Claim(const std::string& id, const std::string& tenant, int64_t if_epoch) override;
  int64_t Epoch(const std::string& id, const std::string& tenant) const override;
  std::vector<TierSession> TakeClaimed() override { return {}; }  // claims name their sessions
  void LetGo(TierSession image) override;
  std::vector<std::pair<std::string, absl::Status>> TakeDisowned() override;
  std::vector<std::string> TakeLost() override;
  absl::Status Owned(const std::string& id) const override;
  absl::Status ReleaseAll() override;
  absl::Status Health() const override;

  // This daemon's name in leases: host, pid and a random part.
  const std::string& owner() const { return owner_; }

 private:
  struct SessionState;
  class Record;
  struct Job;
  explicit RedisTier(const RedisTierOptions& options);

  // The state of a session, made on first use. Under mutex_.
  std::shared_ptr<SessionState> StateOf(const std::string& id, const std::string& tenant);
  // Under mutex_: a record for a new page of the session, in a key of its own.
  std::shared_ptr<Record> NewPage(const std::shared_ptr<SessionState>& state, size_t bytes);
  // Under mutex_ (held by `lock`): with acknowledge_written, until `bytes`
  // more fit in the queue, the queue is empty, or Redis does not answer.
  void WaitForRoom(std::unique_lock<std::mutex>& lock, size_t bytes);
  // Under mutex_: queues a job.
  void Enqueue(Job job);
  void WriterLoop();
  // Sends one job (claiming its session first when it is new); `record` is
  // its record, held (null for deletes and tombstones).
  absl::Status Execute(Job& job, const Record* record);
  // The script that appends a kTails job's entries, under `epoch`.
  static std::vector<std::string> TailsCommand(const Job& job, const std::string& epoch, const std::string& ttl);
  // Under mutex_ (held by `lock`, let go while Redis answers): sends the
  // kTails jobs at the front of the queue pipelined, when there are two or
  // more of claimed sessions; how many were written and left the queue.
  size_t SendTails(std::unique_lock<std::mutex>& lock);
  // Renews the leases of the sessions held.
  void Renew();
  // The renewal script's command for the session (under mutex_).
  std::vector<std::string> RenewCommand(const SessionState& state) const;
  // Starts the orphan TTL of every key of the sessions held again; false
  // when some keys could not be refreshed.
  bool Refresh();
  std::string OrphanTtlMs() const;
  // Under mutex_: another daemon has the session now, at `epoch_now`
  // (logged once). Returns why, as calls on it are told.
  std::string Disown(SessionState& state, absl::string_view epoch_now);
  // Under mutex_: Redis lost the session's records (`why`), and its epoch is
  // this daemon's again: logged, and in lost_ for Residency (TakeLost).
  void NoteLost(const std::shared_ptr<SessionState>& state, absl::string_view why);
  // A script's error reply: FAILED_PRECONDITION (disowning the session) for
  // a stale epoch, INTERNAL otherwise.
  absl::Status ScriptError(SessionState& state, const RedisValue& reply);
  // Redis did not answer a read or a claim: the tier is down until the
  // writer (probing at once) gets an answer. Returns why.
  std::string MarkDown(const absl::Status& why);
  // Under mutex_: a record's last handle went.
  void Release(Record* record);
  // A page's value: fetched with the next pages WillRead named (one round
  // trip for kReadBatch of them), or waited for when another read fetches it.
  absl::StatusOr<RedisValue> Fetch(const Record& record);
  // A record that goes is no longer read ahead.
  void Forget(const Record* record);
  // A connection for reads (one per thread reading at once), back to the
  // pool when the holder goes.
  struct Borrowed;
  Borrowed Borrow();
  // A claim (Claim), in steps: the lease and a raised epoch, with the
  // manifest and the pages sealed since (NOT_FOUND, ABORTED, DATA_LOSS,
  // FAILED_PRECONDITION or UNAVAILABLE as Claim says); the manifest read;
  // every page found and each layer's new slots replayed on its last page;
  // then, under mutex_, the records made and the session held.
  struct ClaimRead;
  absl::Status AcquireForClaim(const SessionState& state, int64_t if_epoch, RedisConnection& connection,
                               ClaimRead* read);
  absl::Status ReadManifest(const std::string& id, const std::string& tenant, ClaimRead* read) const;
  absl::Status CheckClaimedPages(const SessionState& state, RedisConnection& connection, ClaimRead* read);
  TierSession RegisterClaimed(std::shared_ptr<SessionState> state, ClaimRead read, absl::Time sent);

  const RedisTierOptions options_;
  const std::string owner_;
  mutable std::mutex mutex_;
  std::condition_variable work_;     // the writer waits for jobs
  std::condition_variable written_;  // Wait waits for the writer
  std::deque<Job> queue_;
  bool stopping_ = false;
  bool closed_ = false;    // nothing is deleted any more
  bool released_ = false;  // leases let go: none renewed
  bool up_ = true;         // the last command got its answer
  bool probe_ = false;     // a claim found Redis down: the writer tries it at once
  std::string down_reason_;
  std::string refusal_;  // why Redis is refused (its eviction policy), while it is
  std::string silent_;   // why the last renewal went unanswered (a cluster's master, or Redis), or empty
  std::map<std::string, std::string> run_ids_;  // each master's process (by host:port), as last seen
  std::vector<std::shared_ptr<SessionState>> lost_;  // sessions whose records Redis lost, not yet taken
  int64_t rewrites_ = 0;
  uint64_t next_lsn_ = 1;
  // By "tenant\0id".
  std::unordered_map<std::string, std::shared_ptr<SessionState>> sessions_;
  std::vector<std::pair<std::string, absl::Status>> disowned_;  // not yet taken
  std::unordered_map<std::string, std::string> disowned_why_;   // by id
  int64_t queued_bytes_ = 0;
  int64_t live_bytes_ = 0;
  int64_t records_written_ = 0;
  int64_t write_errors_ = 0;
  int64_t crc_failures_ = 0;
  // Pages named by WillRead, until read.
  struct Ahead {
    const Record* next = nullptr;  // the page read after it, if named too
    enum Stage { kNamed, kFetching, kHere } stage = kNamed;
    absl::StatusOr<RedisValue> value;
  };
  std::mutex reads_mutex_;  // never held while taking mutex_ or destroying a record
  std::condition_variable fetched_;
  std::unordered_map<const Record*, Ahead> ahead_;
  std::mutex readers_mutex_;
  std::vector<std::unique_ptr<RedisConnection>> readers_;
  RedisConnection writer_connection_;
  std::thread writer_;
};

}  // namespace turbokv
