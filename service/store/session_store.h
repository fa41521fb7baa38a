// The daemon's sessions: each a model-shaped set of layer caches in one
// PagePool, found by an unguessable id. Enforces the byte budget with either
// a plain refusal or eviction of the least recently used idle sessions, and
// expires sessions idle past their TTL. No gRPC types.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "service/backend/backend.h"
#include "service/records/session_config.h"
#include "service/records/session_id.h"
#include "service/store/layer_cache.h"
#include "service/store/page_pool.h"
#include "service/store/prefix_index.h"
#include "service/store/residency.h"
#include "service/store/session_cache.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

// How a claim of a session from a shared tier ended.
enum TakeoverResult {
  kTakeoverOk,
  kTakeoverNotFound,  // in no tier
  kTakeoverHeld,      // another daemon holds it
  kTakeoverFailed,    // the tier did not answer, or its records are damaged
  kTakeoverResults,
};

// What the store holds, summed over sessions.
struct StoreSnapshot {
  int64_t sessions = 0;
  int64_t tokens = 0;      // over sessions and layers
  int64_t bytes_used = 0;  // pages held, shared pages once
  int64_t budget_bytes = 0;
  int64_t fp16_bytes = 0;  // the same tokens in fp16
  int64_t resident_fp16_bytes = 0;  // those of the sessions in memory: bytes_used's fp16 size
  int64_t lru_evictions = 0;  // since start
  int64_t ttl_expiries = 0;   // since start
  int64_t resident_sessions = 0;  // in memory (all of them without a spill tier)
  // With a spill tier (zeros without):
  int64_t demoted_sessions = 0;   // on disk only
  int64_t demotions = 0;          // since start
  int64_t promotions = 0;
  int64_t disk_drops = 0;         // sessions dropped because the spill budget was full
  int64_t named_blocks = 0;       // distinct blocks named for reuse (PrefixIndex::blocks)
  TierStats tier;                 // the tier's (a stack's: the one whose budget drops sessions)
  std::vector<TierStats> tier_parts;  // each tier of Tier::Parts(), top first
  absl::Status tier_health;       // a shared tier: why it does not answer
  struct TenantUse {
    int64_t sessions = 0;
    int64_t bytes = 0;  // pages in memory; a page forks share counted for each
  };
  std::map<std::string, TenantUse> tenants;  // by tenant ("" without authentication)

  // The sessions in memory: their fp16 size over the bytes they use (0 with
  // none). Demoted sessions' tokens would inflate it.
  double compression_ratio() const {
    return bytes_used > 0 ? static_cast<double>(resident_fp16_bytes) / static_cast<double>(bytes_used) : 0.0;
  }
};

enum class EvictionPolicy {
  kReject,  // a full budget refuses the write
  kLru,     // a full budget evicts (with a spill tier: demotes) least recently used idle sessions first
};

struct StoreOptions {
  // Where pages live and kernels run; it must outlive the store. nullptr:
  // host memory, kernels on the calling thread (a CpuBackend of the store's
  // own).
  Backend* backend = nullptr;
  size_t budget_bytes = size_t{4} << 30;
  EvictionPolicy eviction = EvictionPolicy::kReject;
  int page_tokens = 64;
  // Where snapshots live (empty: none). A deleted, evicted or expired
  // session's snapshot is removed with it.
  std::string snapshot_dir;
  // Most sessions in the store, and of one tenant.
  int64_t max_sessions = 10000;
  int64_t max_tenant_sessions = 10000;
  // With a spill tier: Rebalance demotes least recently used idle sessions
  // once memory use passes high_watermark x budget, down to low_watermark;
  // and drops the oldest sessions on disk only once the tier's use passes
  // its high watermark, down to its low one.
  double high_watermark = 0.90;
  double low_watermark = 0.80;
  // A shared tier: called as each call naming a session this daemon did not
  // hold ends its claim, before the call is answered (metrics count them).
  std::function<void(TakeoverResult)> on_takeover;
  // Told of the changes in the blocks held for reuse, per medium
  // (PrefixIndex): the daemon's KV events. Null: none.
  BlockEventSink on_block_events;
  // A promotion whose room is held by sessions in calls waits this long for
  // them (in line with the other promotions) before RESOURCE_EXHAUSTED.
  absl::Duration promotion_patience = absl::Seconds(5);
};

struct SnapshotReport {
  int64_t sessions = 0;  // written, or loaded
  int64_t bytes = 0;
  // Sessions that failed, with why (DATA_LOSS for a damaged file,
  // RESOURCE_EXHAUSTED when the budget could not hold it, ...).
  std::vector<std::pair<std::string, absl::Status>> failed;
  // Loaded sessions whose file could not be proven their last state (no
  // MANIFEST from a finished drain: a crash, kill -9 or a failed drain).
  std::vector<std::string> unverified;
};

class SessionStore final : private ResidencyHost {
 public:
  // tier: where sessions are demoted to and sealed pages written through
  // (null: none, memory only); Residency owns it.
  explicit SessionStore(const StoreOptions& options, std::unique_ptr<Tier> tier = nullptr);
  ~SessionStore();
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  // A new, empty session. The config must have been checked (codecs and
  // shape valid); the caller fills defaults.
  absl::StatusOr<std::shared_ptr<SessionCache>> Create(const SessionConfig& config, const std::string& tenant,
                                                       absl::Time now);

  // The session with this id of this tenant, marked as used now. NOT_FOUND
  // for an unknown id, saying so when it was evicted and why; another
  // tenant's session is an unknown id. With a shared tier, an id this
  // daemon does not hold is claimed from it (Tier::Claim) and comes back
  // demoted, or the claim's error: NOT_FOUND then means in no tier, and
  // FAILED_PRECONDITION that another daemon holds it (or claimed it from
  // this one, whose copy is then dropped).
  absl::StatusOr<std::shared_ptr<SessionCache>> Find(const std::string& id, const std::string& tenant,
                                                     absl::Time now);

  // Removes the session; its pages go back to the pool unless a fork shares
  // them. With a shared tier, one this daemon does not hold is claimed
  // first (Find) and goes from the tier too.
  absl::Status Delete(const std::string& id, const std::string& tenant);

  // A new session of the same tenant holding the first `prefix` tokens of
  // every layer of `source` (whose mutex the caller holds), sharing its pages
  // and the named blocks among them.
  absl::StatusOr<std::shared_ptr<SessionCache>> Fork(SessionCache& source, int64_t prefix, absl::Time now);

  // Names blocks [first_block, first_block + hashes.size()) of the session
  // (under its mutex, resident) for reuse by content (PrefixIndex): blocks
  // are named in order, each full in every layer; naming a block again with
  // its hash changes nothing. FAILED_PRECONDITION otherwise. Returns what the
  // session holds now.
  absl::StatusOr<PrefixIndex::Holding> NameBlocks(SessionCache& session, int64_t first_block,
                                                  absl::Span<const std::string> hashes);
  // A new session of `tenant` with `config` that starts with the longest
  // prefix of the blocks named `hashes` that a session of the same tenant
  // and storage holds (PrefixIndex::Find; the rotation seed too when
  // seed_given, else the new session takes the holder's), its pages shared
  // as Fork shares them; an empty session when none does. A demoted holder
  // is promoted first.
  struct Attached {
    std::shared_ptr<SessionCache> session;
    int64_t tokens = 0;  // of the prefix, per layer
  };
  absl::StatusOr<Attached> Attach(const SessionConfig& config, bool seed_given, const std::string& tenant,
                                  absl::Span<const std::string> hashes, absl::Time now);
  const PrefixIndex& prefix_index() const { return prefix_index_; }

  std::vector<std::shared_ptr<SessionCache>> List() const override;

  // Makes room for `bytes` more. With kLru it first proves that evicting
  // least recently used idle sessions other than those in `held` (whose
  // mutexes the caller holds) frees enough (pages shared with sessions that
  // stay are not counted), and only then evicts them; otherwise, and with
  // kReject, it changes nothing and returns RESOURCE_EXHAUSTED naming used,
  // needed, budget and freeable bytes. A later allocation can still lose a
  // race to another session; callers retry. With `calls_hold_it`, says
  // whether a refusal passed over sessions in calls (their locks held, or a
  // stream open on them), so that waiting for them may help.
  absl::Status MakeRoom(size_t bytes, absl::Span<const SessionCache* const> held,
                        bool* calls_hold_it = nullptr) override;

  // Deletes sessions idle longer than their TTL; returns how many.
  int ExpireIdle(absl::Time now);

  // Where the sessions' pages are below memory: the tier chain, demotion,
  // promotion, write-through and acknowledgement of new tokens.
  Residency& residency() { return residency_; }

  // Truncates every layer of the session (under its mutex) to n tokens
  // (Residency::Truncate), its own metadata charged when it no longer shares
  // a fork's sinks.
  absl::Status Truncate(SessionCache& session, int64_t n);
  // The background pass: drops the copies of sessions another daemon
  // claimed from a shared tier, catches up on write-through, demotes idle
  // sessions above the memory high watermark, drops the oldest sessions on
  // disk only above the tier's.
  struct RebalanceReport {
    int demoted = 0;
    std::vector<std::string> dropped;  // ids, dropped because the tier was full
    absl::Status error;                // why a demotion failed, if one did
  };
  RebalanceReport Rebalance();
  // Registers the sessions the tier held at start (on disk only); a
  // session already loaded from a snapshot keeps the snapshot's state.
  absl::StatusOr<TierScanReport> LoadTier(absl::Time now);

  // Writes every session to options().snapshot_dir (each atomically; pages
  // are shared with a frozen copy under the session's mutex and written
  // after it is released) and removes snapshots of sessions that are gone.
  // Sessions not reached by `deadline` are reported failed. `final` (the
  // drain): when every session was written, MANIFEST records the files as
  // the sessions' last state; when not, no MANIFEST is left. FAILED_PRECONDITION
  // without a snapshot dir.
  absl::StatusOr<SnapshotReport> SaveSnapshots(absl::Time deadline = absl::InfiniteFuture(), bool final = false);
  // Loads every snapshot in options().snapshot_dir into the (empty) store,
  // page by page. A file that cannot be loaded (damaged, over the budget, or
  // older than the MANIFEST of the last drain says its session was) fails
  // only its own session: calls on that id then answer DATA_LOSS saying
  // why, and the file is kept. Without a MANIFEST every session loaded is
  // reported unverified. The MANIFEST is removed once read: the sessions
  // change from now on. Creates the directory when missing.
  absl::StatusOr<SnapshotReport> LoadSnapshots(absl::Time now);

  PagePool& pool() { return pool_; }
  Backend& backend() { return pool_.backend(); }
  const StoreOptions& options() const { return options_; }
  // Sessions evicted (lru) and expired (ttl) since start.
  int64_t evictions() const { return lru_evictions_.load() + ttl_expiries_.load(); }
  size_t session_count() const;
  // Sums over the sessions (each locked in turn).
  StoreSnapshot Snapshot() const;

 private:
  // A session with its codecs and empty layers.
  absl::StatusOr<std::shared_ptr<SessionCache>> Build(std::string id, std::string tenant, const SessionConfig& config,
                                                      absl::Time created);
  // Removes a session's snapshot file, if snapshots are on.
  void RemoveSnapshot(const std::string& id) const;
  // Under mutex_: NOT_FOUND for an id not in the map (or not the tenant's),
  // saying why when known to the tenant.
  absl::Status NotFound(const std::string& id, const std::string& tenant) const;
  // Under mutex_: drops the session from the map and remembers why.
  void RememberGone(const SessionCache& session, std::string reason, std::atomic<int64_t>* counter);
  // Under mutex_: RESOURCE_EXHAUSTED when the store or the tenant holds the
  // most sessions allowed.
  absl::Status HasRoomFor(const std::string& tenant) const;
  // Under mutex_: adds a built session, or HasRoomFor's error.
  absl::Status Insert(std::shared_ptr<SessionCache> session);
  // Adds a session the tier holds (on the tier only): ALREADY_EXISTS when
  // one of its id is here (from a snapshot), or Insert's error, the session
  // let go on the tier (SharedTier::LetGo: *kept_on_tier says whether a
  // later claim finds it there, as on a shared tier).
  absl::Status RegisterDemoted(TierSession image, absl::Time now, bool* kept_on_tier);
  // Claims a session this daemon does not hold from the shared tier (Find).
  absl::StatusOr<std::shared_ptr<SessionCache>> TakeOver(const std::string& id, const std::string& tenant,
                                                         absl::Time now);
  void CountTakeover(TakeoverResult result) const {
    if (options_.on_takeover) options_.on_takeover(result);
  }
  // Under mutex_: removes the session from the map, its tenant's count and
  // the prefix index.
  void Erase(const std::string& id);
  // What a session loaded with `named` blocks and layers of `tokens` holds
  // (blocks past its shortest layer are not).
  PrefixIndex::Holding HoldingOf(const SessionCache& session, NamedBlocks named,
                                 absl::Span<const int64_t> tokens) const;
  // What a session the tier holds (`image`, demoted) holds.
  PrefixIndex::Holding DemotedHolding(const SessionCache& session, const TierSession& image) const;
  // Fork with the new session's config (storage the same as the source's)
  // and its named blocks.
  absl::StatusOr<std::shared_ptr<SessionCache>> ForkAs(SessionCache& source, int64_t prefix, const SessionConfig& config,
                                                       PrefixIndex::Holding holding, absl::Time now);
  // Under the session's mutex: empties it, returns its bytes to the pool
  // and (with a tier) writes its tombstone.
  void Drop(SessionCache* session);
  // ResidencyHost's: codecs and empty layers for the session, its metadata
  // charged; the session of an id in the map, or null.
  absl::Status Materialize(SessionCache& session) override;
  std::shared_ptr<SessionCache> Held(const std::string& id) const override;
  const StoreOptions options_;
  std::unique_ptr<Backend> own_backend_;  // when options_.backend is null
  PagePool pool_;
  PrefixIndex prefix_index_;  // its entries change under mutex_ (after the sessions' map)
  Residency residency_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<SessionCache>> sessions_;
  std::unordered_map<std::string, int64_t> tenant_sessions_;
  // Ids evicted or expired (the most recent kRememberedGone): tenant and why.
  std::unordered_map<std::string, std::pair<std::string, std::string>> gone_reasons_;
  std::deque<std::string> gone_order_;
  // Ids whose snapshot could not be loaded, with why: DATA_LOSS.
  std::unordered_map<std::string, std::string> damaged_;
  std::mutex save_mutex_;  // one SaveSnapshots at a time; never under mutex_
  std::mutex claim_mutex_;  // one TakeOver at a time; taken before mutex_
  std::atomic<int64_t> lru_evictions_{0};
  std::atomic<int64_t> ttl_expiries_{0};
  std::atomic<int64_t> disk_drops_{0};
};

}  // namespace turbokv
