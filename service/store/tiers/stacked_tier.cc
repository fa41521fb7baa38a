#include "service/store/tiers/stacked_tier.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "service/log.h"
#include "service/records/session_id.h"

namespace turbokv {
// A page or manifest on both tiers, or on the shared one only (local null:
// the local tier was full, or the record is the shared tier's alone).
class StackedTier::Record final : public TierRecord {
 public:
  Record(std::shared_ptr<TierRecord> shared, std::shared_ptr<TierRecord> local)
      : TierRecord(shared->lsn(), shared->bytes(), shared->shared_name()),
        shared(std::move(shared)),
        local(std::move(local)) {}
  const std::shared_ptr<TierRecord> shared;
  const std::shared_ptr<TierRecord> local;
};

StackedTier::StackedTier(std::unique_ptr<Tier> local, std::unique_ptr<SharedTier> shared)
    : local_(std::move(local)), shared_(std::move(shared)) {}

TierSession StackedTier::SharedView(const TierSession& session) {
  TierSession view = session;
  view.manifest = nullptr;
  for (TierLayer& layer : view.layers) {
    for (std::shared_ptr<TierRecord>& page : layer.pages)
      page = static_cast<const Record&>(*page).shared;
  }
  return view;
}

TierSession StackedTier::LocalView(const TierSession& session) {
  TierSession view = session;
  view.manifest = nullptr;
  const int64_t pt = session.header.page_tokens;
  for (TierLayer& layer : view.layers) {
    size_t copied = 0;
    while (copied < layer.pages.size() &&
           static_cast<const Record&>(*layer.pages[copied]).local != nullptr)
      ++copied;
    if (copied < layer.pages.size()) {
      layer.pages.resize(copied);
      layer.tokens = std::min<int64_t>(layer.tokens, static_cast<int64_t>(copied) * pt);
      layer.whole = false;
    }
    for (std::shared_ptr<TierRecord>& page : layer.pages)
      page = static_cast<const Record&>(*page).local;
  }
  return view;
}

TierSession StackedTier::Merge(TierSession claimed, const Copy* copy) {
  for (TierLayer& layer : claimed.layers) {
    for (std::shared_ptr<TierRecord>& page : layer.pages) {
      std::shared_ptr<TierRecord> local;
      if (copy != nullptr && !page->shared_name().empty()) {
        auto found = copy->pages.find(page->shared_name());
        if (found != copy->pages.end()) local = found->second;
      }
      page = std::make_shared<Record>(std::move(page), std::move(local));
    }
  }
  std::shared_ptr<TierRecord> local_manifest;
  if (copy != nullptr) {
    // The copy's manifest is superseded by one under the new epoch.
    local_manifest =
        local_->PutManifest(LocalView(claimed));  // its shared_epoch: the claim's
  }
  claimed.manifest =
      std::make_shared<Record>(std::move(claimed.manifest), std::move(local_manifest));
  return claimed;
}

absl::StatusOr<TierSession> StackedTier::ClaimCopy(Copy& copy) {
  const TierSession& session = copy.session;
  const std::string& id = session.header.id;
  const std::string& tenant = session.header.tenant;
  if (session.shared_epoch == 0) {
    // Written by a daemon without a shared tier: the shared tier gets it,
    // unless it has the session already (then its state is the truth: the
    // copy may be older, or another daemon's writes may be there since).
    absl::StatusOr<TierSession> there = shared_->Claim(id, tenant, /*if_epoch=*/0);
    if (absl::IsNotFound(there.status())) return Upload(session);
    if (!there.ok()) return there.status();
    Logf(LogLevel::kWarning,
         "session %s: its copy on the local %s tier was written without the %s tier, "
         "which has the session: the %s tier's is served",
         id.c_str(), local_->name(), shared_->name(), shared_->name());
    return Merge(*std::move(there), &copy);
  }
  absl::StatusOr<TierSession> claimed = shared_->Claim(id, tenant, session.shared_epoch);
  if (!claimed.ok()) {
    // A claim that raised the epoch and then failed: nobody else has
    // claimed the session since, and the copy waits under the new epoch.
    if (const int64_t raised = ClaimedEpoch(claimed.status()); raised > 0) {
      copy.session.shared_epoch = raised;
    }
    return claimed.status();
  }
  return Merge(*std::move(claimed), &copy);
}

void StackedTier::Drop(const Copy& copy, const absl::Status& why) {
  Logf(LogLevel::kWarning,
       "session %s: its copy on the local %s tier is dropped, never served: %s",
       copy.session.header.id.c_str(), local_->name(),
       std::string(why.message()).c_str());
  local_->PutTombstone(copy.session.header.id, copy.session.header.tenant);
}

bool StackedTier::Settle(const std::string& key, Copy copy,
                         absl::StatusOr<TierSession> claimed,
                         std::vector<TierSession>* out) {
  if (claimed.ok()) {
    out->push_back(*std::move(claimed));
    return true;
  }
  if (absl::IsAborted(claimed.status()) || absl::IsNotFound(claimed.status())) {
    Drop(copy, claimed.status());
    return true;
  }
  // Held by the lease of the run before (killed), the shared tier does not
  // answer, or its records are damaged: tried again later (backing off),
  // or by a call that then hears why not.
  const absl::Time now = absl::Now();
  copy.retry = now + copy.backoff;
  copy.backoff = std::min(2 * copy.backoff, kMostBackoff);
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.emplace(key, std::move(copy));
  return false;
}

absl::StatusOr<TierScanReport> StackedTier::Scan() {
  absl::StatusOr<TierScanReport> report = local_->Scan();
  if (!report.ok()) return report.status();
  // A damaged copy is not used: a call naming its session claims it from
  // the shared tier, which holds the truth.
  for (const auto& [id, why] : report->damaged) {
    Logf(LogLevel::kWarning,
         "session %s: its copy on the local %s tier is not used (%s); a call naming "
         "it claims it from the %s tier",
         id.c_str(), local_->name(), std::string(why.message()).c_str(), shared_->name());
  }
  report->damaged.clear();
  std::unordered_map<std::string, Copy> copies;
  for (TierSession& session : report->sessions) {
    copies[TenantSessionKey(session.header.tenant, session.header.id)].session = std::move(session);
  }
  for (TierScanReport::Named& named : report->named) {
    auto it = copies.find(TenantSessionKey(named.tenant, named.session));
    if (it != copies.end()) {
      it->second.pages[named.record->shared_name()] = std::move(named.record);
    }
  }
  report->sessions.clear();
  report->named.clear();
  const size_t found = copies.size();
  int waiting = 0;
  for (auto& [key, copy] : copies) {
    absl::StatusOr<TierSession> claimed = ClaimCopy(copy);
    if (!Settle(key, std::move(copy), std::move(claimed), &report->sessions)) ++waiting;
  }
  Logf(LogLevel::kInfo,
       "%zu session(s) on the local %s tier: %zu claimed from the %s tier, %d waiting "
       "for their claim (a lease not lapsed, or the tier not answering), %zu dropped "
       "(claimed by another turbokvd since, or gone from the %s tier)",
       found, local_->name(), report->sessions.size(), shared_->name(), waiting,
       found - report->sessions.size() - static_cast<size_t>(waiting), shared_->name());
  return report;
}

absl::StatusOr<TierSession> StackedTier::Upload(const TierSession& copy) {
  TierSession session = copy;
  const SessionConfig& config = session.header.config;
  const int64_t pt = session.header.page_tokens;
  std::string page;
  std::shared_ptr<TierRecord> last;
  for (size_t l = 0; l < session.layers.size(); ++l) {
    TierLayer& layer = session.layers[l];
    page.resize(LayerPageBytes(config, static_cast<int>(l), static_cast<int>(pt)));
    for (size_t i = 0; i < layer.pages.size(); ++i) {
      std::shared_ptr<TierRecord>& record = layer.pages[i];
      absl::Status read =
          local_->Read(*record, reinterpret_cast<uint8_t*>(page.data()), page.size());
      if (!read.ok()) return read;
      const int64_t tokens =
          std::min<int64_t>(pt, layer.tokens - static_cast<int64_t>(i) * pt);
      PageKey key{session.header.id,
                  session.header.tenant,
                  static_cast<int32_t>(l),
                  static_cast<int32_t>(i),
                  static_cast<int32_t>(tokens),
                  config.KeyCodec(static_cast<int>(l)),
                  config.ValueCodec(static_cast<int>(l)),
                  config.rotation_seed};
      key.for_manifest = true;
      absl::StatusOr<std::shared_ptr<TierRecord>> shared =
          shared_->PutPage(key, page, /*force=*/true);
      if (absl::IsUnavailable(shared.status()) && last != nullptr) {
        // The writer's queue is full: once what is queued is written.
        if (absl::Status written = shared_->Wait(*last); !written.ok()) return written;
        shared = shared_->PutPage(key, page, /*force=*/true);
      }
      if (!shared.ok()) return shared.status();
      last = *shared;
      // A copy that names the shared page, so that a restart finds it.
      key.shared_name = last->shared_name();
      absl::StatusOr<std::shared_ptr<TierRecord>> local =
          local_->PutPage(key, page, /*force=*/true);
      record = std::make_shared<Record>(*std::move(shared),
                                        local.ok() ? *std::move(local) : std::move(record));
    }
  }
  std::shared_ptr<TierRecord> manifest = shared_->PutManifest(SharedView(session));
  if (absl::Status written = shared_->Wait(*manifest); !written.ok()) return written;
  session.shared_epoch = shared_->Epoch(session.header.id, session.header.tenant);
  session.manifest = std::make_shared<Record>(std::move(manifest),
                                              local_->PutManifest(LocalView(session)));
  Logf(LogLevel::kInfo,
       "session %s on the local %s tier, written without the %s tier, is now in it too",
       session.header.id.c_str(), local_->name(), shared_->name());
  return session;
}

absl::StatusOr<std::shared_ptr<TierRecord>> StackedTier::PutPage(const PageKey& key,
                                                                 absl::string_view page,
                                                                 bool force) {
  absl::StatusOr<std::shared_ptr<TierRecord>> shared = shared_->PutPage(key, page, force);
  if (!shared.ok()) return shared.status();
  PageKey copy = key;
  copy.shared_name = (*shared)->shared_name();
  // A local tier that cannot take it (its budget, its queue) costs a read
  // from the shared tier later, nothing else.
  absl::StatusOr<std::shared_ptr<TierRecord>> local = local_->PutPage(copy, page, force);
  return std::shared_ptr<TierRecord>(std::make_shared<Record>(
      *std::move(shared), local.ok() ? *std::move(local) : nullptr));
}

std::shared_ptr<TierRecord> StackedTier::PutManifest(const TierSession& session) {
  std::shared_ptr<TierRecord> shared = shared_->PutManifest(SharedView(session));
  TierSession local = LocalView(session);
  // Before the session's first write reached the shared tier its epoch
  // is not known yet: that first write's claim makes it 1 (a new id's).
  local.shared_epoch =
      std::max<int64_t>(shared_->Epoch(session.header.id, session.header.tenant), 1);
  return std::make_shared<Record>(std::move(shared), local_->PutManifest(local));
}

void StackedTier::PutTombstone(const std::string& session, const std::string& tenant) {
  shared_->PutTombstone(session, tenant);
  local_->PutTombstone(session, tenant);
}

absl::StatusOr<std::shared_ptr<TierRecord>> StackedTier::PutTails(
    const std::string& session, const std::string& tenant, std::vector<TailWrite> tails) {
  absl::StatusOr<std::shared_ptr<TierRecord>> shared =
      shared_->PutTails(session, tenant, std::move(tails));
  if (!shared.ok()) return shared.status();
  return std::shared_ptr<TierRecord>(
      std::make_shared<Record>(*std::move(shared), nullptr));
}

absl::Status StackedTier::Wait(const TierRecord& record) {
  return shared_->Wait(*static_cast<const Record&>(record).shared);
}

absl::Status StackedTier::Read(const TierRecord& record, uint8_t* out, size_t bytes) {
  const auto& r = static_cast<const Record&>(record);
  if (r.local != nullptr) {
    absl::Status local = local_->Read(*r.local, out, bytes);
    if (local.ok()) return local;
    Logf(LogLevel::kWarning,
         "a page's copy on the local %s tier could not be read (%s): read from the %s "
         "tier",
         local_->name(), std::string(local.message()).c_str(), shared_->name());
  }
  return shared_->Read(*r.shared, out, bytes);
}

void StackedTier::WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) {
  std::vector<std::shared_ptr<TierRecord>> local, shared;
  for (const std::shared_ptr<TierRecord>& record : records) {
    const auto& r = static_cast<const Record&>(*record);
    if (r.local != nullptr) {
      local.push_back(r.local);
    } else {
      shared.push_back(r.shared);
    }
  }
  if (!local.empty()) local_->WillRead(local);
  if (!shared.empty()) shared_->WillRead(shared);
}

absl::Status StackedTier::Sync() {
  absl::Status local = local_->Sync();
  absl::Status shared = shared_->Sync();
  return shared.ok() ? local : shared;
}

void StackedTier::Close() {
  local_->Close();
  shared_->Close();
}

absl::StatusOr<TierSession> StackedTier::Claim(const std::string& id,
                                               const std::string& tenant,
                                               int64_t if_epoch) {
  const std::string key = TenantSessionKey(tenant, id);
  std::optional<Copy> copy;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = waiting_.find(key);
    if (it != waiting_.end()) {
      copy = std::move(it->second);
      waiting_.erase(it);
    }
  }
  if (copy.has_value()) {
    absl::StatusOr<TierSession> claimed = ClaimCopy(*copy);
    const absl::Status status = claimed.status();
    std::vector<TierSession> out;
    Settle(key, *std::move(copy), std::move(claimed), &out);
    if (!out.empty()) return std::move(out.front());
    // Dropped (another daemon claimed it since): the session as the shared
    // tier has it, below. Otherwise the claim's error.
    if (!absl::IsAborted(status)) return status;
  }
  absl::StatusOr<TierSession> claimed = shared_->Claim(id, tenant, if_epoch);
  if (!claimed.ok()) return claimed.status();
  return Merge(*std::move(claimed), nullptr);
}

std::vector<TierSession> StackedTier::TakeClaimed() {
  const absl::Time now = absl::Now();
  std::vector<std::pair<std::string, Copy>> due;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->second.retry > now) {
        ++it;
        continue;
      }
      due.emplace_back(it->first, std::move(it->second));
      it = waiting_.erase(it);
    }
  }
  std::vector<TierSession> claimed;
  for (auto& [key, copy] : due) {
    absl::StatusOr<TierSession> session = ClaimCopy(copy);
    Settle(key, std::move(copy), std::move(session), &claimed);
  }
  return claimed;
}

}  // namespace turbokv
