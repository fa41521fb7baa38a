// Where pages go below memory: a tier holds records of sealed pages,
// session manifests and tombstones, written behind the request path, read
// back on promotion, and scanned at start. The disk segment log
// (disk_tier.h) is a Tier; Redis, shared with other daemons (redis_tier.h),
// and the disk stacked over it (stacked_tier.h) are SharedTiers, which add
// claims, epochs and leases. Tiers know the record format and the kernels'
// page shapes, never the store above them; no gRPC types.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/codec.h"
#include "service/records/record_io.h"

namespace turbokv {

// One record on a tier. Its bytes stay on the tier while a handle to it is
// held (by a page, a demoted session, a fork); when the last handle goes the
// record is dead and the tier may reclaim its space.
class TierRecord {
 public:
  virtual ~TierRecord() = default;
  uint64_t lsn() const { return lsn_; }  // the tier's sequence number: later records have larger ones
  size_t bytes() const { return bytes_; }  // on the tier, framing included
  // A page's name on a shared tier (its Redis key), which names the same
  // bytes for ever (a key is written once): on that tier, and on a local
  // tier below it for the copy it keeps (PageKey::shared_name). Empty
  // otherwise.
  const std::string& shared_name() const { return shared_name_; }

 protected:
  TierRecord(uint64_t lsn, size_t bytes, std::string shared_name = "")
      : lsn_(lsn), bytes_(bytes), shared_name_(std::move(shared_name)) {}

 private:
  const uint64_t lsn_;
  const size_t bytes_;
  const std::string shared_name_;
};

// What a page record says of its page: whose, where in the layer, how many
// tokens of it are filled (page_tokens once sealed; fewer for a session's
// tail written when it is demoted or drained).
struct PageKey {
  std::string session;
  std::string tenant;
  int32_t layer = 0;
  int32_t index = 0;  // tokens [index * page_tokens, index * page_tokens + tokens)
  int32_t tokens = 0;
  CodecKind key_codec = CodecKind::kTurbo3;
  CodecKind value_codec = CodecKind::kTurbo3;
  uint64_t rotation_seed = 0;
  // A sealed page written for the manifest that follows it: it is not
  // entered among the pages sealed since the manifest (Redis's hash).
  bool for_manifest = false;
  // On a local tier under a shared one (StackedTier): the shared tier's
  // name for the same page, kept with the copy so that a restart can tell
  // which of the shared tier's pages it holds.
  std::string shared_name{};
};

// New slots of a layer's partly filled last page (Tier::PutTails): slots
// [from, to) of page `index` (tokens index * page_tokens + slot), as
// CopySlots gives them. from == to: the layer was cut back to `to` slots of
// that page (a truncation).
struct TailWrite {
  int32_t layer = 0;
  int32_t index = 0;
  int32_t from = 0;
  int32_t to = 0;
  SlotShape shape;
  std::string slots;
};

// A session's state on a tier: its header and, per layer, its length and the
// records of its pages in order (the last one may be partly filled).
struct TierLayer {
  int64_t tokens = 0;
  // Every token the layer holds (false: sealed pages whose records are not
  // queued yet are left out, and so its tail).
  bool whole = true;
  std::vector<std::shared_ptr<TierRecord>> pages;
  LayerExtras extras;  // its transform and sink tokens
};
struct TierSession {
  SessionHeader header;
  bool pinned = false;
  std::vector<TierLayer> layers;
  std::shared_ptr<TierRecord> manifest;  // the record that describes it
  // The session's epoch on a shared tier: the one a claim raised it to
  // (Tier::Claim); in a local tier's manifest, the epoch the copy was
  // written under when a shared tier is above it (StackedTier), 0 when none
  // is.
  int64_t shared_epoch = 0;
  NamedBlocks named;  // the blocks it named for reuse
};

// What a tier held at start.
struct TierScanReport {
  std::vector<TierSession> sessions;  // (SessionStore::LoadTier takes them: empty after it)
  int64_t loaded = 0;                 // sessions registered by SessionStore::LoadTier
  // Sessions whose records could not be used (another format version, a
  // manifest naming records that are gone), with DATA_LOSS saying why.
  std::vector<std::pair<std::string, absl::Status>> damaged;
  int64_t records = 0;      // records read
  int64_t torn = 0;         // records that failed their CRC or were cut short: skipped
  int64_t bytes = 0;        // of the live records
  // Page records that carry a shared tier's name (PageKey::shared_name),
  // whether a session above holds them or not, of sessions not deleted
  // since: copies a stacked daemon may read again (StackedTier).
  struct Named {
    std::string session;
    std::string tenant;
    std::shared_ptr<TierRecord> record;
  };
  std::vector<Named> named;
};

struct TierStats {
  int64_t bytes = 0;         // on the tier: live records and dead ones not yet reclaimed
  int64_t live_bytes = 0;    // records still held
  int64_t budget_bytes = 0;
  int64_t queued_bytes = 0;  // waiting for the writer
  int64_t records_written = 0;
  int64_t write_errors = 0;
  int64_t crc_failures = 0;  // records read back (at start or on promotion) that failed their CRC
  int64_t compactions = 0;   // segments whose live records were moved so that they could go
  int64_t rewrites = 0;      // sessions written again because a shared tier lost their records
};

// A failed Tier::Claim that raised the session's epoch before it failed
// (and let the session go again) says to what: no other daemon claimed the
// session in between, and a copy written under the epoch before is still
// its latest (StackedTier). 0 when the error says nothing of it.
inline absl::Status WithClaimedEpoch(absl::Status status, int64_t epoch) {
  status.SetPayload("turbokv/claimed-epoch", absl::Cord(std::to_string(epoch)));
  return status;
}
inline int64_t ClaimedEpoch(const absl::Status& status) {
  int64_t epoch = 0;
  if (auto payload = status.GetPayload("turbokv/claimed-epoch")) {
    if (!absl::SimpleAtoi(std::string(*payload), &epoch)) epoch = 0;
  }
  return epoch;
}

class Tier {
 public:
  virtual ~Tier() = default;
  virtual const char* name() const = 0;  // "disk", "redis"

  // Reads what the tier holds (once, before any Put).
  virtual absl::StatusOr<TierScanReport> Scan() = 0;

  // Queues a record of a page's bytes (copied, on the host: see
  // Backend::ReadPage) and returns its handle.
  // RESOURCE_EXHAUSTED when the tier's budget cannot take it; UNAVAILABLE
  // when the writer's queue is full and !force (the caller tries later).
  virtual absl::StatusOr<std::shared_ptr<TierRecord>> PutPage(const PageKey& key, absl::string_view page, bool force) = 0;
  // Queues a manifest: the session's state from now on (records listed by
  // lsn; page records of the session with larger lsns extend it).
  virtual std::shared_ptr<TierRecord> PutManifest(const TierSession& session) = 0;
  // Queues a tombstone: the session's records are dead, at every start.
  virtual void PutTombstone(const std::string& session, const std::string& tenant) = 0;

  // Until `record` and everything queued before it is written: OK, or the
  // error that failed it (nothing half-written stays behind).
  virtual absl::Status Wait(const TierRecord& record) = 0;
  // The payload of a page record into out[bytes]; DATA_LOSS when it fails
  // its CRC or is not a page of that size.
  virtual absl::Status Read(const TierRecord& record, uint8_t* out, size_t bytes) = 0;
  // A hint: these records are about to be read (the tier may start reading
  // them all now).
  virtual void WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) = 0;
  // Flushes what is written to stable storage.
  virtual absl::Status Sync() = 0;
  // From now on records whose handles go stay on the tier (the store is
  // going away; its sessions are still there at the next start).
  virtual void Close() = 0;

  virtual TierStats Stats() const = 0;
  // OK while the tier answers; why not otherwise.
  virtual absl::Status Health() const { return absl::OkStatus(); }

  // The tiers this one is made of, top first, each with its own name and
  // Stats (for metrics): itself, but for a stack of tiers.
  virtual std::vector<const Tier*> Parts() const { return {this}; }
};

// A tier shared with other daemons (Redis, or the disk stacked over it): it
// holds sessions this daemon may not, handed over by claims that raise each
// session's epoch, and this daemon's by leases it renews.
class SharedTier : public Tier {
 public:
  // A tier that holds every append (Redis, unless --redis-acknowledge=queued):
  // the store acknowledges new tokens only once they are written, the
  // partly filled last pages through PutTails, and its manifests carry
  // tails. A local tier keeps these defaults (tails are written at the
  // drain and at demotion only).
  virtual bool holds_every_append() const = 0;
  // Queues, as one write, new slots of some of a session's layers' last
  // pages; its handle is for Wait only (it names no page to Read).
  // UNIMPLEMENTED unless holds_every_append().
  virtual absl::StatusOr<std::shared_ptr<TierRecord>> PutTails(const std::string& session, const std::string& tenant,
                                                                std::vector<TailWrite> tails) = 0;

  // The session with this id of this tenant, which this daemon does not
  // hold, claimed for it: from now on this daemon is its only writer, and
  // the writes of the daemon that held it before are refused. NOT_FOUND
  // when the tier has no such session; FAILED_PRECONDITION while another
  // daemon holds it; UNAVAILABLE when the tier cannot be reached.
  // With if_epoch > 0, only when the session's epoch there is still
  // if_epoch (nobody claimed it since a copy written under it): ABORTED
  // otherwise. The session returned carries the epoch the claim raised.
  virtual absl::StatusOr<TierSession> Claim(const std::string& id, const std::string& tenant, int64_t if_epoch) = 0;
  // The session's epoch on the tier as this daemon knows it (0: none yet).
  virtual int64_t Epoch(const std::string& id, const std::string& tenant) const = 0;
  // Sessions claimed since the last call outside a call naming them (a
  // stacked daemon's local copies, once the lease of the run before
  // lapses): the store registers them, on the tier only.
  virtual std::vector<TierSession> TakeClaimed() = 0;
  // A session the tier handed over (Scan, Claim, TakeClaimed) that the
  // store could not take (its limits): let go without deleting anything
  // (its lease released, its records' handles going without their pages),
  // so that a later claim finds it.
  virtual void LetGo(TierSession image) = 0;
  // The sessions another daemon has claimed since the last call, each with
  // the FAILED_PRECONDITION that says so: this daemon drops them (without a
  // tombstone: they are the other daemon's now).
  virtual std::vector<std::pair<std::string, absl::Status>> TakeDisowned() = 0;
  // The sessions whose records the tier lost since the last call (Redis
  // restarted without its append-only file, or from an older one), their
  // ownership restored: this daemon writes those it holds in memory again.
  virtual std::vector<std::string> TakeLost() = 0;
  // FAILED_PRECONDITION when another daemon has claimed the session; OK otherwise.
  virtual absl::Status Owned(const std::string& id) const = 0;
  // Lets go of every session this daemon holds on the tier (the drain,
  // after Residency::Flush): another daemon may claim them at once.
  virtual absl::Status ReleaseAll() = 0;
};

}  // namespace turbokv
