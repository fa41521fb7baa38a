// Residency (docs/ARCHITECTURE.md, "Residency"): where a session's pages are
// below memory. Owns the tier chain, the lock over the pages' tier records,
// each session's state on the tier (SessionCache::TierState), the sessions a
// shared tier lost, and the line of promotions. The store calls it by name:
// write through, acknowledge new tokens, demote, promote, truncate, claim,
// let go, flush. It never touches the store's session map: what it needs of
// the store is ResidencyHost. No gRPC types.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "service/backend/backend.h"
#include "service/store/layer_cache.h"
#include "service/store/prefix_index.h"
#include "service/store/session_cache.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

class ThreadPool;

// What residency asks of the store whose sessions it moves (SessionStore).
class ResidencyHost {
 public:
  // Every session held, in memory or demoted.
  virtual std::vector<std::shared_ptr<SessionCache>> List() const = 0;
  // The session of this id that the store holds, or null.
  virtual std::shared_ptr<SessionCache> Held(const std::string& id) const = 0;
  // Makes room in memory for `bytes`, never by moving the sessions in
  // `held` (SessionStore::MakeRoom).
  virtual absl::Status MakeRoom(size_t bytes, absl::Span<const SessionCache* const> held, bool* calls_hold_it) = 0;
  // Codecs and empty layers for a demoted session, its metadata charged.
  virtual absl::Status Materialize(SessionCache& session) = 0;

 protected:
  ~ResidencyHost() = default;
};

struct ResidencyOptions {
  int page_tokens = 64;
  // A promotion whose room is held by sessions in calls waits this long for
  // them without a deadline of its own (StoreOptions::promotion_patience).
  absl::Duration promotion_patience = absl::Seconds(5);
};

// What residency counts, for the store's Snapshot (zeros without a tier).
struct ResidencyStats {
  int64_t demotions = 0;  // since start
  int64_t promotions = 0;
  TierStats tier;                     // the tier's (a stack's: the one whose budget drops sessions)
  std::vector<TierStats> tier_parts;  // each tier of Tier::Parts(), top first
};

class Residency {
 public:
  // tier: where sessions are demoted to and sealed pages written through;
  // null for none (memory only): every call below is then OK and does
  // nothing, except that Demote and Claim say there is no tier and Truncate
  // still cuts the layers. The backend, index and host must outlive it.
  Residency(std::unique_ptr<Tier> tier, const ResidencyOptions& options, Backend& backend, PrefixIndex& prefix_index,
            ResidencyHost& host);
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  // Closes the tier before the sessions go: their records stay theirs there
  // (the store's destructor).
  void Close();

  bool has_tier() const { return tier_ != nullptr; }
  // The tier (null without one), and the same when it is shared with other
  // daemons (else null).
  Tier* tier() { return tier_.get(); }
  SharedTier* shared_tier() { return shared_; }
  // "disk", "redis" ("" without a tier).
  const char* tier_name() const { return tier_ != nullptr ? tier_->name() : ""; }
  // Counters and the tier's use (TierUse: the tier's alone). Health: why a
  // shared tier does not answer.
  ResidencyStats Stats() const;
  TierStats TierUse() const;
  absl::Status Health() const;

  // A session's pages on the tier (all under the session's mutex).
  //
  // Queues its sealed pages that are not on the tier yet; with !force only
  // while the writer's queue has room.
  absl::Status WriteThrough(SessionCache& session, bool force);
  // Queues a manifest of its sealed pages (and tails, with a tier that holds
  // every append). `acknowledged`: with a tier that holds every append,
  // returns once the tier has it (a fork is acknowledged as an append is).
  absl::Status WriteManifest(SessionCache& session, bool acknowledged);
  // Makes a call's new tokens as durable as the tier promises, before the
  // call answers. With a tier that holds every append: queues the pages they
  // sealed and their slots of each layer's partly filled last page, then
  // waits until the tier has them; on an error every layer is restored as it
  // was (LayerCache::Restore) and the tier's error is returned (the tokens
  // may be on the tier or not: appending them again is safe). Otherwise the
  // sealed pages are queued behind the call (or later, by the background
  // pass, when the writer's queue is full) and it returns OK. In two halves
  // for calls on many sessions: queue them all, then wait for each.
  struct LayerGrowth {  // a layer's new tokens: those past undo.tokens
    int layer = 0;
    LayerCache::Undo undo;
  };
  using TierWrites = std::vector<std::shared_ptr<TierRecord>>;
  absl::StatusOr<TierWrites> QueueNewTokens(SessionCache& session, absl::Span<const LayerGrowth> growth);
  absl::Status AwaitNewTokens(SessionCache& session, absl::Span<const LayerGrowth> growth,
                              const absl::StatusOr<TierWrites>& queued);
  // Writes its sealed pages and tail and drops its memory. The error says
  // why it stays in memory.
  absl::Status Demote(SessionCache& session);
  // Brings a demoted session back into memory, making room with the host's
  // MakeRoom (never moving those in `held`). DATA_LOSS when a record fails
  // its CRC, RESOURCE_EXHAUSTED naming both tiers when memory cannot take
  // it. Reads layers on `pool` when given. Promotions take turns, first come
  // first served: one that finds the room held by sessions in calls waits
  // for them, until `deadline` (absl::InfiniteFuture(): for the options'
  // promotion_patience), and later promotions wait behind it.
  absl::Status Promote(SessionCache& session, absl::Span<const SessionCache* const> held, ThreadPool* pool = nullptr,
                       absl::Time deadline = absl::InfiniteFuture());
  // Cuts every layer to n tokens, and the prefix index's blocks with them,
  // and records it on the tier. With a tier that holds every append, once
  // the tier has it; an error (the tier down) leaves the session cut here
  // while the tier may still hold the tokens.
  absl::Status Truncate(SessionCache& session, int64_t n);
  // The bytes of its records on the tier.
  size_t TierBytes(const SessionCache& session);
  // A dropped session (deleted, evicted, expired): its tombstone goes to the
  // tier and its state there is let go.
  void Forget(SessionCache& session);

  // Sessions the tier holds.
  //
  // Makes a new session (not yet in the store, its lock not needed) the
  // demoted copy of what the tier holds.
  static void Adopt(SessionCache& session, TierSession image);
  // Hands an adopted session that the store did not take back to a shared
  // tier, for a later claim; a local tier's records die with it. Whether a
  // later claim finds it there.
  bool LetGo(SessionCache& session);
  // A shared tier's (FAILED_PRECONDITION without one): claims a session this
  // daemon does not hold (SharedTier::Claim), ready for Adopt.
  absl::StatusOr<TierSession> Claim(const std::string& id, const std::string& tenant);
  // OK unless a shared tier says another daemon claimed the session.
  absl::Status Owned(const std::string& id) const;
  // A shared tier's: the sessions other daemons claimed from this one, and
  // those it claimed by itself (SharedTier::TakeDisowned, TakeClaimed).
  std::vector<std::string> TakeDisowned();
  std::vector<TierSession> TakeClaimed();
  // The sessions the tier holds at start (Tier::Scan).
  absl::StatusOr<TierScanReport> Scan();

  // The background pass and the drain.
  //
  // Writes again the sessions whose records a shared tier lost (Redis
  // restarted empty), each under its mutex; one that fails is tried again
  // by the next pass or call.
  void RewriteLost();
  // Writes every resident session's tail and manifest and syncs the tier:
  // a restart on the same spill dir finds them whole.
  absl::Status Flush(absl::Time deadline);

 private:
  bool HoldsEveryAppend() const { return shared_ != nullptr && shared_->holds_every_append(); }
  PageKey Key(const SessionCache& session, int layer, int index, int tokens) const;
  // Queues a record of the page (Tier::PutPage), its bytes read through the
  // backend.
  absl::StatusOr<std::shared_ptr<TierRecord>> PutPage(const PageKey& key, const LayerCache& layer, const Page& page,
                                                      bool force);
  // The session's state on the tier: each layer's sealed pages that have
  // records, in order, and (with tails) its partly filled last page,
  // written now.
  absl::StatusOr<TierSession> TierImage(const SessionCache& session, bool tails);
  // Writes a manifest of the session's sealed pages, and of its tails when
  // the tier holds every append; the error of writing a tail.
  absl::Status WriteTierManifest(SessionCache& session);
  // The records of its pages, held so that pages a truncation drops go from
  // the tier only after the manifest that follows it.
  std::vector<std::shared_ptr<TierRecord>> HoldRecords(const SessionCache& session);
  // After its layers were cut back: a partly filled last page that only this
  // session holds is written in place from now on, so it is not its record
  // any more.
  void ForgetPartialRecords(SessionCache& session);
  // Records that its latest manifest holds its layers' current transforms
  // and sinks.
  static void NoteManifestExtras(SessionCache& session);
  // Promote's one attempt, its turn come: makes room for `bytes` and loads
  // the session; *calls_hold_it as MakeRoom's.
  absl::Status PromoteNow(SessionCache& session, size_t bytes, absl::Span<const SessionCache* const> held,
                          ThreadPool* pool, bool* calls_hold_it);
  // Writes the session to the tier again: the tier lost its records. In
  // memory: every sealed page in a new record after a new manifest.
  // Demoted: every page read back from the tier (a stacked daemon's copy on
  // its disk) and put again, then a manifest of them. OK once the tier
  // holds it all.
  absl::Status Rewrite(SessionCache& session);
  absl::Status RewriteDemoted(SessionCache& session);
  // The sessions the tier lost the records of since the last call, into
  // lost_.
  void NoteLost();
  // Whether the session is in lost_: taken out of it, and written again, or
  // put back if that fails.
  absl::Status RewriteIfLost(SessionCache& session);

  const ResidencyOptions options_;
  Backend& backend_;
  PrefixIndex& prefix_index_;
  ResidencyHost& host_;
  std::unique_ptr<Tier> tier_;
  SharedTier* const shared_;  // tier_, when it is shared with other daemons
  std::mutex records_mutex_;  // guards Page::record
  // Ids of sessions whose records the tier lost, not yet written again.
  // Taken before the store's mutex (RewriteLost looks ids up under it).
  std::mutex lost_mutex_;
  std::unordered_set<std::string> lost_;
  std::atomic<int64_t> demotions_{0};
  std::atomic<int64_t> promotions_{0};
  // Promotions in line, first come first served: their tickets.
  std::mutex line_mutex_;
  std::condition_variable line_turn_;
  std::deque<uint64_t> line_;
  uint64_t tickets_ = 0;
};

}  // namespace turbokv
