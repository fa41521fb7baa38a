// Two tiers stacked (--spill-dir with --redis-url, docs/ARCHITECTURE.md, "Tiers"): a local
// tier (the disk) under memory and a shared one (Redis) under it, seen by
// the store as one tier. Every page and manifest goes to both; the shared
// tier is the truth (claims, leases, the acknowledgement of appends, the
// budget that drops sessions), the local one a copy that promotion reads
// first. A local copy is used only through the shared tier's names: each
// local page record keeps the name of the shared page it copies (a Redis
// key, written once), and each local manifest the epoch it was written
// under. At start every session found on the local tier is claimed from
// the shared one only while its epoch there is still that one; a copy of a
// session another daemon has claimed since is dropped, never served. A
// local tier that is full or failing only costs reads from the shared one.
// No gRPC types.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

class StackedTier final : public SharedTier {
 public:
  StackedTier(std::unique_ptr<Tier> local, std::unique_ptr<SharedTier> shared);

  // Messages name the shared tier: it holds every session, and its budget
  // is the one that drops them.
  const char* name() const override { return shared_->name(); }
  // Scans the local tier and claims its sessions from the shared one (see
  // above). Those whose claim must wait (the lease of the daemon that ran
  // here before, killed, has not lapsed; the shared tier does not answer)
  // are claimed later: by a call naming them, or by TakeClaimed.
  absl::StatusOr<TierScanReport> Scan() override;
  absl::StatusOr<std::shared_ptr<TierRecord>> PutPage(const PageKey& key,
                                                      absl::string_view page,
                                                      bool force) override;
  std::shared_ptr<TierRecord> PutManifest(const TierSession& session) override;
  void PutTombstone(const std::string& session, const std::string& tenant) override;
  // The shared tier's write: the local one's is read back once written.
  absl::Status Wait(const TierRecord& record) override;
  // The local copy, or the shared tier's when there is none or it fails.
  absl::Status Read(const TierRecord& record, uint8_t* out, size_t bytes) override;
  void WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) override;
  absl::Status Sync() override;
  void Close() override;
  TierStats Stats() const override { return shared_->Stats(); }
  bool holds_every_append() const override { return shared_->holds_every_append(); }
  absl::StatusOr<std::shared_ptr<TierRecord>> PutTails(
      const std::string& session, const std::string& tenant,
      std::vector<TailWrite> tails) override;
  absl::StatusOr<TierSession> Claim(const std::string& id, const std::string& tenant,
                                    int64_t if_epoch) override;
  int64_t Epoch(const std::string& id, const std::string& tenant) const override {
    return shared_->Epoch(id, tenant);
  }
  std::vector<TierSession> TakeClaimed() override;
  void LetGo(TierSession image) override { shared_->LetGo(SharedView(image)); }
  std::vector<std::pair<std::string, absl::Status>> TakeDisowned() override {
    return shared_->TakeDisowned();
  }
  std::vector<std::string> TakeLost() override { return shared_->TakeLost(); }
  absl::Status Owned(const std::string& id) const override { return shared_->Owned(id); }
  absl::Status ReleaseAll() override { return shared_->ReleaseAll(); }
  absl::Status Health() const override { return shared_->Health(); }
  std::vector<const Tier*> Parts() const override {
    return {local_.get(), shared_.get()};
  }

 private:
  class Record;
  // A session's copy on the local tier, not claimed yet: its manifest's
  // session and the local page records that name shared pages, by name;
  // when its claim is tried next, backing off while it fails.
  struct Copy {
    TierSession session;
    std::unordered_map<std::string, std::shared_ptr<TierRecord>> pages;
    absl::Time retry = absl::InfinitePast();
    absl::Duration backoff = absl::Seconds(1);
  };
  static constexpr absl::Duration kMostBackoff = absl::Seconds(30);
  // `claimed` (the shared tier's records) with each page's local copy from
  // `copy` when it has one (null: none), and a local manifest of it
  // written when there was a copy.
  TierSession Merge(TierSession claimed, const Copy* copy);
  // Claims the copy's session while its epoch is still the copy's (or
  // uploads one written without the shared tier); the session, or the
  // claim's error (ABORTED: claimed by another since).
  absl::StatusOr<TierSession> ClaimCopy(Copy& copy);
  // A session written by a daemon without the shared tier, written to it
  // (its pages read back from the local tier): the session with both
  // tiers' records.
  absl::StatusOr<TierSession> Upload(const TierSession& copy);
  // The copy goes from the local tier, saying why in the log.
  void Drop(const Copy& copy, const absl::Status& why);
  // What a claim of the copy (stored under `key`) came to: a session into
  // *out, or the copy dropped (ABORTED, NOT_FOUND), or back among the
  // waiting ones to be tried later; false in the last case.
  bool Settle(const std::string& key, Copy copy, absl::StatusOr<TierSession> claimed,
              std::vector<TierSession>* out);
  // The session as one of the two tiers holds it: the shared tier's
  // records, or the local ones (each layer up to its first page without a
  // local copy).
  static TierSession SharedView(const TierSession& session);
  static TierSession LocalView(const TierSession& session);

  const std::unique_ptr<Tier> local_;
  const std::unique_ptr<SharedTier> shared_;
  std::mutex mutex_;
  // Copies waiting for their claim, by "tenant\0id" (declared after the
  // tiers: their records go first).
  std::unordered_map<std::string, Copy> waiting_;
};

}  // namespace turbokv
