#include "service/store/tiers/stacked_tier.h"

#include <algorithm>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "service/byte_size.h"
#include "service/log.h"
#include "service/store/session_id.h"

namespace turbokv {
namespace {

std::string KeyOf(const std::string& tenant, const std::string& id) {
  return absl::StrCat(tenant, std::string(1, '\0'), id);
}

// Bytes of pages a start-up upload queues before it waits for them (within
// the shared writer's queue, whose default is 64 MiB).
constexpr size_t kUploadWindow = size_t{32} << 20;

}  // namespace

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

StackedTier::StackedTier(std::unique_ptr<Tier> local, std::unique_ptr<Tier> shared)
    : local_(std::move(local)), shared_(std::move(shared)) {}

StackedTier::~StackedTier() {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.clear();
}

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
  // Written by a daemon without a shared tier (epoch 0): the shared tier
  // gets it.
  if (session.shared_epoch == 0) return Upload(session);
  absl::StatusOr<TierSession> claimed =
      shared_->Claim(session.header.id, session.header.tenant, session.shared_epoch);
  if (!claimed.ok()) return claimed.status();
  return Merge(*std::move(claimed), &copy);
}

void StackedTier::Drop(const Copy& copy, const absl::Status& why) {
  Logf(LogLevel::kWarning,
       "session %s: its copy on the local %s tier is dropped, never served: %s",
       copy.session.header.id.c_str(), local_->name(),
       std::string(why.message()).c_str());
  local_->PutTombstone(copy.session.header.id, copy.session.header.tenant);
}

absl::StatusOr<TierScanReport> StackedTier::Scan() {
  absl::StatusOr<TierScanReport> report = local_->Scan();
  if (!report.ok()) return report.status();
  std::unordered_map<std::string, Copy> copies;
  for (TierSession& session : report->sessions) {
    copies[KeyOf(session.header.tenant, session.header.id)].session = std::move(session);
  }
  for (TierScanReport::Named& named : report->named) {
    auto it = copies.find(KeyOf(named.tenant, named.session));
    if (it != copies.end())
      it->second.pages[named.record->shared_name()] = std::move(named.record);
  }
  report->sessions.clear();
  report->named.clear();
  int dropped = 0, waiting = 0;
  for (auto& [key, copy] : copies) {
    absl::StatusOr<TierSession> session = ClaimCopy(copy);
    if (session.ok()) {
      report->sessions.push_back(*std::move(session));
    } else if (absl::IsAborted(session.status()) || absl::IsNotFound(session.status())) {
      Drop(copy, session.status());
      ++dropped;
    } else {
      // Held by the lease of the run before (killed), the shared tier does
      // not answer, or its records are damaged: claimed later, or by a
      // call that then hears why not.
      ++waiting;
      waiting_.emplace(key, std::move(copy));
    }
  }
  Logf(LogLevel::kInfo,
       "%zu session(s) on the local %s tier: %zu claimed from the %s tier, %d waiting "
       "for their claim (a lease not "
       "lapsed, or the tier not answering), %d dropped (claimed by another turbokvd "
       "since, or gone from the %s tier)",
       copies.size(), local_->name(), report->sessions.size(), shared_->name(), waiting,
       dropped, shared_->name());
  return report;
}

absl::StatusOr<TierSession> StackedTier::Upload(const TierSession& copy) {
  TierSession session = copy;
  const SessionConfig& config = session.header.config;
  const int64_t pt = session.header.page_tokens;
  std::string page;
  size_t unwaited = 0;
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
      if (!shared.ok()) return shared.status();
      last = *shared;
      record = std::make_shared<Record>(*std::move(shared), std::move(record));
      unwaited += page.size();
      if (unwaited >= kUploadWindow) {
        if (absl::Status written = shared_->Wait(*last); !written.ok()) return written;
        unwaited = 0;
      }
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
  Copy copy;
  bool had_copy = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = waiting_.find(KeyOf(tenant, id));
    if (it != waiting_.end()) {
      copy = std::move(it->second);
      waiting_.erase(it);
      had_copy = true;
    }
  }
  if (had_copy) {
    absl::StatusOr<TierSession> session = ClaimCopy(copy);
    if (session.ok() ||
        !(absl::IsAborted(session.status()) || absl::IsNotFound(session.status()))) {
      if (!session.ok()) {
        std::lock_guard<std::mutex> lock(mutex_);
        waiting_.emplace(KeyOf(tenant, id), std::move(copy));
      }
      return session;
    }
    Drop(copy, session.status());
  }
  absl::StatusOr<TierSession> claimed = shared_->Claim(id, tenant, if_epoch);
  if (!claimed.ok()) return claimed.status();
  return Merge(*std::move(claimed), nullptr);
}

std::vector<TierSession> StackedTier::TakeClaimed() {
  std::unordered_map<std::string, Copy> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    copies.swap(waiting_);
  }
  std::vector<TierSession> claimed;
  for (auto& [key, copy] : copies) {
    absl::StatusOr<TierSession> session = ClaimCopy(copy);
    if (session.ok()) {
      claimed.push_back(*std::move(session));
    } else if (absl::IsAborted(session.status()) || absl::IsNotFound(session.status())) {
      Drop(copy, session.status());
    } else {
      std::lock_guard<std::mutex> lock(mutex_);
      waiting_.emplace(key, std::move(copy));
    }
  }
  return claimed;
}

}  // namespace turbokv
