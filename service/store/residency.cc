// Residency (residency.h): sealed pages written through to the tier below
// memory, new tokens acknowledged, demotion and promotion, truncation on the
// tier, the sessions a shared tier lost, the drain's flush.
#include "service/store/residency.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/thread_pool.h"
#include "service/log.h"
#include "service/records/session_id.h"
#include "service/status_macros.h"
#include "service/store/layer_cache.h"

namespace turbokv {

Residency::Residency(std::unique_ptr<Tier> tier, const ResidencyOptions& options, Backend& backend,
                     PrefixIndex& prefix_index, ResidencyHost& host)
    : options_(options),
      backend_(backend),
      prefix_index_(prefix_index),
      host_(host),
      tier_(std::move(tier)),
      shared_(dynamic_cast<SharedTier*>(tier_.get())) {}

void Residency::Close() {
  if (tier_ != nullptr) tier_->Close();
}

ResidencyStats Residency::Stats() const {
  ResidencyStats stats;
  stats.demotions = demotions_.load();
  stats.promotions = promotions_.load();
  if (tier_ != nullptr) {
    stats.tier = TierUse();
    for (const Tier* part : tier_->Parts()) stats.tier_parts.push_back(part->Stats());
  }
  return stats;
}

TierStats Residency::TierUse() const { return tier_ != nullptr ? tier_->Stats() : TierStats(); }

absl::Status Residency::Health() const { return tier_ != nullptr ? tier_->Health() : absl::OkStatus(); }

void Residency::Forget(SessionCache& session) {
  if (tier_ != nullptr && session.on_tier()) tier_->PutTombstone(session.id(), session.tenant());
  session.tier_.manifest.reset();
  session.tier_.demoted.reset();
}

void Residency::Adopt(SessionCache& session, TierSession image) {
  session.tier_.manifest = image.manifest;
  session.tier_.demoted = std::make_unique<TierSession>(std::move(image));
}

bool Residency::LetGo(SessionCache& session) {
  if (shared_ == nullptr || session.tier_.demoted == nullptr) return false;
  shared_->LetGo(std::move(*session.tier_.demoted));
  return true;
}

absl::StatusOr<TierSession> Residency::Claim(const std::string& id, const std::string& tenant) {
  if (shared_ == nullptr) return absl::FailedPreconditionError("turbokvd runs without a shared tier (--redis-url)");
  return shared_->Claim(id, tenant, /*if_epoch=*/0);
}

absl::Status Residency::Owned(const std::string& id) const {
  return shared_ != nullptr ? shared_->Owned(id) : absl::OkStatus();
}

std::vector<std::string> Residency::TakeDisowned() {
  std::vector<std::string> ids;
  if (shared_ == nullptr) return ids;
  for (auto& [id, why] : shared_->TakeDisowned()) ids.push_back(std::move(id));
  return ids;
}

std::vector<TierSession> Residency::TakeClaimed() {
  return shared_ != nullptr ? shared_->TakeClaimed() : std::vector<TierSession>();
}

absl::StatusOr<TierScanReport> Residency::Scan() {
  return tier_ != nullptr ? tier_->Scan() : absl::StatusOr<TierScanReport>(TierScanReport());
}

absl::Status Residency::WriteManifest(SessionCache& session, bool acknowledged) {
  if (tier_ == nullptr) return absl::OkStatus();
  TURBOKV_RETURN_IF_ERROR(WriteTierManifest(session));
  return acknowledged && HoldsEveryAppend() ? tier_->Wait(*session.tier_.manifest) : absl::OkStatus();
}

PageKey Residency::Key(const SessionCache& session, int layer, int index, int tokens) const {
  const SessionConfig& c = session.config();
  return PageKey{session.id(), session.tenant(), layer, index, tokens, c.KeyCodec(layer), c.ValueCodec(layer),
                 c.rotation_seed};
}

absl::StatusOr<std::shared_ptr<TierRecord>> Residency::PutPage(const PageKey& key, const LayerCache& layer,
                                                               const Page& page, bool force) {
  absl::StatusOr<std::shared_ptr<TierRecord>> record;
  absl::Status read = backend_.ReadPage(layer.page_format(), page.data, [&](absl::string_view bytes) {
    record = tier_->PutPage(key, bytes, force);
    return record.status();
  });
  if (!read.ok()) return read;
  return record;
}

absl::Status Residency::WriteThrough(SessionCache& session, bool force) {
  if (tier_ == nullptr || !session.resident() || session.gone()) return absl::OkStatus();
  const int64_t pt = options_.page_tokens;
  // A layer's sealed pages are encoded through its transform and next to
  // its sink tokens: a manifest holding them goes first, so that a restart
  // that finds the pages finds what they need.
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const LayerCache& layer = session.layers()[l];
    const bool stale = l >= session.tier_.manifest_extras.size() || session.tier_.manifest_extras[l] != layer.extras_version();
    bool unwritten = false;
    if (stale && layer.tokens() >= pt) {
      std::lock_guard<std::mutex> lock(records_mutex_);
      unwritten = layer.pages()[static_cast<size_t>(layer.tokens() / pt) - 1]->record == nullptr;
    }
    if (unwritten) {
      TURBOKV_RETURN_IF_ERROR(WriteTierManifest(session));
      break;
    }
  }
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const LayerCache& layer = session.layers()[l];
    const std::vector<std::shared_ptr<Page>>& pages = layer.pages();
    const size_t full = static_cast<size_t>(layer.tokens() / pt);
    size_t first = full;
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      while (first > 0 && pages[first - 1]->record == nullptr) --first;
    }
    for (size_t i = first; i < full; ++i) {
      absl::StatusOr<std::shared_ptr<TierRecord>> record =
          PutPage(Key(session, static_cast<int>(l), static_cast<int>(i), static_cast<int>(pt)), layer, *pages[i], force);
      if (!record.ok()) return record.status();
      std::lock_guard<std::mutex> lock(records_mutex_);
      if (pages[i]->record == nullptr) pages[i]->record = *std::move(record);  // else a fork's came first
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Residency::TierWrites> Residency::QueueNewTokens(SessionCache& session,
                                                                absl::Span<const LayerGrowth> growth) {
  TierWrites writes;
  if (tier_ == nullptr || !session.resident() || session.gone()) return writes;
  if (!HoldsEveryAppend()) {
    WriteThrough(session, /*force=*/false).IgnoreError();
    return writes;
  }
  // A claim finds a session by its manifest, with each layer's transform
  // and sink tokens: one that has the current ones goes before the tokens.
  bool stale = session.tier_.manifest == nullptr;
  for (size_t l = 0; l < session.layers().size() && !stale; ++l) {
    stale = l >= session.tier_.manifest_extras.size() || session.tier_.manifest_extras[l] != session.layers()[l].extras_version();
  }
  if (stale) TURBOKV_RETURN_IF_ERROR(WriteTierManifest(session));
  TURBOKV_RETURN_IF_ERROR(WriteThrough(session, /*force=*/false));
  if (session.tier_.manifest_lacks_tails) {
    TURBOKV_RETURN_IF_ERROR(WriteTierManifest(session));  // its sealed pages have records now
    session.tier_.manifest_lacks_tails = false;
  }
  const int64_t pt = options_.page_tokens;
  {
    std::lock_guard<std::mutex> lock(records_mutex_);
    for (const LayerGrowth& grown : growth) {
      const LayerCache& layer = session.layers()[static_cast<size_t>(grown.layer)];
      for (int64_t i = grown.undo.tokens / pt; i < layer.tokens() / pt; ++i) {
        writes.push_back(layer.pages()[static_cast<size_t>(i)]->record);
      }
    }
  }
  if (session.tier_.manifest != nullptr) writes.push_back(session.tier_.manifest);
  std::vector<TailWrite> tails;
  for (const LayerGrowth& grown : growth) {
    const LayerCache& layer = session.layers()[static_cast<size_t>(grown.layer)];
    const int64_t after = layer.tokens();
    if (after <= grown.undo.tokens || after % pt == 0) continue;
    TailWrite tail;
    tail.layer = grown.layer;
    tail.index = static_cast<int32_t>(after / pt);
    tail.from = static_cast<int32_t>(std::max(grown.undo.tokens, after / pt * pt) - after / pt * pt);
    tail.to = static_cast<int32_t>(after % pt);
    tail.shape = layer.slots();
    const Page& page = *layer.pages()[static_cast<size_t>(tail.index)];
    TURBOKV_RETURN_IF_ERROR(backend_.ReadPage(layer.page_format(), page.data, [&](absl::string_view bytes) {
      CopySlots(reinterpret_cast<const uint8_t*>(bytes.data()), tail.shape, tail.from, tail.to, &tail.slots);
      return absl::OkStatus();
    }));
    tails.push_back(std::move(tail));
  }
  if (!tails.empty()) {
    TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<TierRecord> record,
                             shared_->PutTails(session.id(), session.tenant(), std::move(tails)));
    writes.push_back(std::move(record));
  }
  return writes;
}

absl::Status Residency::AwaitNewTokens(SessionCache& session, absl::Span<const LayerGrowth> growth,
                                       const absl::StatusOr<TierWrites>& queued) {
  absl::Status status = queued.status();
  for (size_t i = 0; status.ok() && i < queued->size(); ++i) {
    if ((*queued)[i] != nullptr) status = tier_->Wait(*(*queued)[i]);
  }
  if (status.ok() && HoldsEveryAppend()) {
    // Written, but to a tier that lost the rest of the session (Redis
    // restarted empty): acknowledged once the session is whole there again.
    NoteLost();
    status = RewriteIfLost(session);
  }
  if (status.ok()) return status;
  // Not acknowledged: nothing of the call stays here. What was queued and
  // not sent yet is not sent (its records go with `queued`). A page the
  // call sealed may have reached the tier, superseding the new slots it
  // held: a manifest of the session as it is again goes before the pages
  // cut off go from the tier.
  const int64_t pt = options_.page_tokens;
  bool sealed = false;
  for (const LayerGrowth& grown : growth) {
    sealed = sealed || session.layers()[static_cast<size_t>(grown.layer)].tokens() / pt > grown.undo.tokens / pt;
  }
  std::vector<std::shared_ptr<TierRecord>> held = HoldRecords(session);
  for (const LayerGrowth& grown : growth) session.layers()[static_cast<size_t>(grown.layer)].Restore(grown.undo);
  ForgetPartialRecords(session);
  if (absl::Status manifest = sealed ? WriteTierManifest(session) : absl::OkStatus(); !manifest.ok()) {
    Logf(LogLevel::kWarning, "session %s: its manifest after a refused append: %s (the next append writes one)",
         session.id().c_str(), std::string(manifest.message()).c_str());
    session.tier_.manifest_extras.clear();
    session.tier_.kept_records.insert(session.tier_.kept_records.end(), held.begin(), held.end());
  }
  // A manifest the tier refused for good (not for being unreachable): the
  // next call writes another rather than wait on it again.
  if (!absl::IsUnavailable(status)) session.tier_.manifest_extras.clear();
  held.clear();
  return absl::Status(status.code(), absl::StrCat("the new tokens were not acknowledged: the ", tier_->name(),
                                                  " tier did not take them (", status.message(),
                                                  "); the session is as it was before the call, and sending "
                                                  "them again is safe"));
}

absl::StatusOr<TierSession> Residency::TierImage(const SessionCache& session, bool tails) {
  TierSession image;
  image.header = SessionHeader{session.id(), session.tenant(), session.config(), session.created(),
                               options_.page_tokens};
  image.pinned = session.config().pinned;
  PrefixIndex::Holding holding = prefix_index_.Get(session.id());
  image.named = NamedBlocks{holding.reuse_from_tokens, std::move(holding.hashes)};
  const int64_t pt = options_.page_tokens;
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const LayerCache& layer = session.layers()[l];
    const std::vector<std::shared_ptr<Page>>& pages = layer.pages();
    const size_t full = static_cast<size_t>(layer.tokens() / pt);
    TierLayer out;
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      for (size_t i = 0; i < full && pages[i]->record != nullptr; ++i) out.pages.push_back(pages[i]->record);
    }
    out.tokens = static_cast<int64_t>(out.pages.size()) * pt;
    out.whole = out.tokens == layer.tokens();
    out.extras = layer.Extras();
    if (tails && out.pages.size() == full && layer.tokens() % pt != 0) {
      absl::StatusOr<std::shared_ptr<TierRecord>> tail = PutPage(
          Key(session, static_cast<int>(l), static_cast<int>(full), static_cast<int>(layer.tokens() % pt)), layer,
          *pages[full], true);
      if (!tail.ok()) return tail.status();
      out.pages.push_back(*std::move(tail));
      out.tokens = layer.tokens();
      out.whole = true;
    }
    image.layers.push_back(std::move(out));
  }
  return image;
}

absl::Status Residency::WriteTierManifest(SessionCache& session) {
  if (HoldsEveryAppend()) {
    // It holds every layer whole: sealed pages without records get theirs
    // first, for it (not entered as sealed since the manifest before it,
    // which a claim still reads until this one is written).
    const int64_t pt = options_.page_tokens;
    for (size_t l = 0; l < session.layers().size(); ++l) {
      const LayerCache& layer = session.layers()[l];
      for (size_t i = 0; i < static_cast<size_t>(layer.tokens() / pt); ++i) {
        {
          std::lock_guard<std::mutex> lock(records_mutex_);
          if (layer.pages()[i]->record != nullptr) continue;
        }
        PageKey key = Key(session, static_cast<int>(l), static_cast<int>(i), static_cast<int>(pt));
        key.for_manifest = true;
        TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<TierRecord> record,
                                 PutPage(key, layer, *layer.pages()[i], /*force=*/false));
        std::lock_guard<std::mutex> lock(records_mutex_);
        if (layer.pages()[i]->record == nullptr) layer.pages()[i]->record = std::move(record);
      }
    }
  }
  absl::StatusOr<TierSession> image = TierImage(session, HoldsEveryAppend());
  if (!image.ok()) return image.status();
  session.tier_.manifest = tier_->PutManifest(*image);
  NoteManifestExtras(session);
  session.tier_.kept_records.clear();  // their deletes go after it
  return absl::OkStatus();
}

std::vector<std::shared_ptr<TierRecord>> Residency::HoldRecords(const SessionCache& session) {
  std::vector<std::shared_ptr<TierRecord>> held;
  std::lock_guard<std::mutex> lock(records_mutex_);
  for (const LayerCache& layer : session.layers()) {
    for (const std::shared_ptr<Page>& page : layer.pages()) {
      if (page->record != nullptr) held.push_back(page->record);
    }
  }
  return held;
}

void Residency::NoteManifestExtras(SessionCache& session) {
  session.tier_.manifest_extras.clear();
  for (const LayerCache& layer : session.layers()) session.tier_.manifest_extras.push_back(layer.extras_version());
}

namespace {

// Waits for every record of `image` and its manifest; the first error.
absl::Status WaitForImage(Tier& tier, const TierSession& image, const TierRecord& manifest) {
  for (const TierLayer& layer : image.layers) {
    for (const auto& page : layer.pages) {
      if (absl::Status status = tier.Wait(*page); !status.ok()) return status;
    }
  }
  return tier.Wait(manifest);
}

}  // namespace

absl::Status Residency::Demote(SessionCache& session) {
  if (tier_ == nullptr) return absl::FailedPreconditionError("turbokvd runs without --spill-dir");
  if (!session.resident() || session.gone()) return absl::OkStatus();
  absl::Status status = WriteThrough(session, true);
  absl::StatusOr<TierSession> image = status.ok() ? TierImage(session, true) : status;
  if (image.ok()) {
    for (size_t l = 0; l < image->layers.size(); ++l) {
      if (image->layers[l].tokens != session.layers()[l].tokens()) {
        image = absl::UnavailableError(absl::StrCat("a sealed page of the session is not on the ", tier_->name(), " tier"));
        break;
      }
    }
  }
  std::shared_ptr<TierRecord> manifest;
  if (image.ok()) {
    manifest = tier_->PutManifest(*image);
    status = WaitForImage(*tier_, *image, *manifest);
  } else {
    status = image.status();
  }
  if (!status.ok()) {
    // Pages whose record failed get a new one at the next try.
    std::vector<std::pair<Page*, std::shared_ptr<TierRecord>>> records;
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      for (const LayerCache& layer : session.layers()) {
        for (const std::shared_ptr<Page>& page : layer.pages()) {
          if (page->record != nullptr) records.emplace_back(page.get(), page->record);
        }
      }
    }
    for (auto& [page, record] : records) {
      if (tier_->Wait(*record).ok()) continue;
      std::lock_guard<std::mutex> lock(records_mutex_);
      if (page->record == record) page->record.reset();
    }
    return status;
  }
  image->manifest = manifest;
  session.tier_.manifest = std::move(manifest);
  session.tier_.manifest_extras.clear();
  session.ReleaseMemory();
  session.tier_.demoted = std::make_unique<TierSession>(*std::move(image));
  demotions_.fetch_add(1);
  prefix_index_.Move(session.id(), tier_->name());
  return absl::OkStatus();
}

absl::Status Residency::Promote(SessionCache& session, absl::Span<const SessionCache* const> held,
                                ThreadPool* pool, absl::Time call_deadline) {
  if (session.resident()) return absl::OkStatus();
  const TierSession& image = *session.tier_.demoted;
  const SessionConfig& config = session.config();
  size_t bytes = SessionMetadataBytes(config);
  for (size_t l = 0; l < image.layers.size(); ++l) {
    const int layer = static_cast<int>(l);
    bytes += image.layers[l].pages.size() * LayerPageBytes(config, layer, options_.page_tokens);
    if (HoldsPastSinks(image.layers[l].extras, config.sink_tokens)) {
      // Its sink page comes back wide (LayerCache::LoadPages charges it).
      bytes += HoldChargeBytes(config.kv_heads, config.head_dim, config.sink_tokens,
                               HoldTokens(config.TransformOptions(layer), options_.page_tokens, config.sink_tokens),
                               config.sink_codec);
    }
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline =
      call_deadline == absl::InfiniteFuture() ? start + options_.promotion_patience : call_deadline;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(line_mutex_);
    ticket = ++tickets_;
    line_.push_back(ticket);
  }
  absl::Status status;
  size_t ahead = 0;
  for (absl::Duration wait = absl::Milliseconds(1);; wait = std::min(2 * wait, absl::Milliseconds(20))) {
    bool turn;
    {
      std::unique_lock<std::mutex> lock(line_mutex_);
      ahead = static_cast<size_t>(std::find(line_.begin(), line_.end(), ticket) - line_.begin());
      turn = line_turn_.wait_until(lock, absl::ToChronoTime(deadline), [&] { return line_.front() == ticket; });
    }
    if (!turn) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("session ", ShowId(session.id()), " is on the ", tier_->name(), " tier and waited ",
                       absl::FormatDuration(absl::Now() - start), " (until its call's deadline, or ",
                       absl::FormatDuration(options_.promotion_patience), " without one) behind ", ahead,
                       " other sessions coming back into memory (the memory budget holds too few of them at once)"));
      break;
    }
    bool calls_hold_it = false;
    status = PromoteNow(session, bytes, held, pool, &calls_hold_it);
    if (status.ok() || !calls_hold_it) break;
    // Room held by sessions in calls comes back when they end: wait for it.
    if (absl::Now() + wait > deadline) {
      status = absl::Status(status.code(), absl::StrCat(status.message(), "; waited ",
                                                        absl::FormatDuration(absl::Now() - start),
                                                        " for the calls holding memory to end"));
      break;
    }
    absl::SleepFor(wait);
  }
  {
    std::lock_guard<std::mutex> lock(line_mutex_);
    line_.erase(std::find(line_.begin(), line_.end(), ticket));
  }
  line_turn_.notify_all();
  return status;
}

absl::Status Residency::PromoteNow(SessionCache& session, size_t bytes, absl::Span<const SessionCache* const> held,
                                   ThreadPool* pool, bool* calls_hold_it) {
  const TierSession& image = *session.tier_.demoted;
  if (absl::Status status = host_.MakeRoom(bytes, held, calls_hold_it); !status.ok()) {
    return absl::Status(status.code(), absl::StrCat("session ", ShowId(session.id()), " is on the ", tier_->name(),
                                                    " tier and cannot come back into memory: ", status.message()));
  }
  std::vector<std::shared_ptr<TierRecord>> records;
  for (const TierLayer& layer : image.layers) records.insert(records.end(), layer.pages.begin(), layer.pages.end());
  tier_->WillRead(records);
  absl::Status status = host_.Materialize(session);
  if (status.ok()) {
    // Layers load in parallel, as a large call (on the kernel workers, in
    // the background, whatever the count of layers): one thread's reads
    // wait on the tier while another's pages are checked and copied.
    std::vector<absl::Status> loaded(image.layers.size());
    auto load = [&](int64_t l) {
      size_t next = 0;
      const TierLayer& layer = image.layers[static_cast<size_t>(l)];
      loaded[static_cast<size_t>(l)] =
          session.layers_[static_cast<size_t>(l)].LoadPages(layer.tokens, layer.extras, [&](uint8_t* data, size_t n) {
            return tier_->Read(*layer.pages[next++], data, n);
          });
    };
    if (pool != nullptr) {
      pool->ParallelFor(static_cast<int64_t>(image.layers.size()), load, /*heavy=*/true);
    } else {
      for (size_t l = 0; l < image.layers.size(); ++l) load(static_cast<int64_t>(l));
    }
    for (const absl::Status& one : loaded) {
      if (!one.ok()) {
        status = one;
        break;
      }
    }
  }
  if (!status.ok()) {
    session.ReleaseMemory();
    return absl::Status(status.code(), absl::StrCat("session ", ShowId(session.id()), " could not be read back from the ",
                                                    tier_->name(), " tier: ", status.message()));
  }
  {
    // Its sealed pages are on the tier already.
    std::lock_guard<std::mutex> lock(records_mutex_);
    const int64_t pt = options_.page_tokens;
    for (size_t l = 0; l < image.layers.size(); ++l) {
      const std::vector<std::shared_ptr<Page>>& pages = session.layers_[l].pages();
      for (size_t i = 0; i < static_cast<size_t>(image.layers[l].tokens / pt); ++i) {
        pages[i]->record = image.layers[l].pages[i];
      }
    }
  }
  session.tier_.demoted.reset();
  NoteManifestExtras(session);  // what was loaded is what its manifest held
  promotions_.fetch_add(1);
  prefix_index_.Move(session.id(), kMemoryMedium);
  return absl::OkStatus();
}

void Residency::ForgetPartialRecords(SessionCache& session) {
  std::lock_guard<std::mutex> lock(records_mutex_);
  for (LayerCache& layer : session.layers()) {
    if (layer.tokens() % options_.page_tokens != 0 && layer.pages().back().use_count() == 1) {
      layer.pages().back()->record.reset();
    }
  }
}

absl::Status Residency::Truncate(SessionCache& session, int64_t n) {
  std::vector<std::shared_ptr<TierRecord>> held = tier_ != nullptr ? HoldRecords(session) : decltype(held)();
  for (LayerCache& layer : session.layers()) layer.Truncate(n);
  prefix_index_.Truncate(session.id(), static_cast<size_t>(std::max<int64_t>(n, 0) / options_.page_tokens), n);
  if (tier_ == nullptr) return absl::OkStatus();
  ForgetPartialRecords(session);
  const absl::Status manifest = WriteTierManifest(session);
  if (!manifest.ok()) {
    session.tier_.manifest_extras.clear();  // the next write sends one
    session.tier_.kept_records.insert(session.tier_.kept_records.end(), held.begin(), held.end());
  }
  held.clear();  // the pages cut off go after the manifest
  if (!HoldsEveryAppend() || !session.resident()) return absl::OkStatus();
  TURBOKV_RETURN_IF_ERROR(manifest);
  // The slots each layer's last page was written with past n are no longer
  // its: a cut (from == to) after them says so to a claim.
  std::vector<TailWrite> cuts;
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const LayerCache& layer = session.layers()[l];
    TailWrite cut;
    cut.layer = static_cast<int32_t>(l);
    cut.index = static_cast<int32_t>(layer.tokens() / options_.page_tokens);
    cut.from = cut.to = static_cast<int32_t>(layer.tokens() % options_.page_tokens);
    cut.shape = layer.slots();
    cuts.push_back(std::move(cut));
  }
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<TierRecord> record,
                           shared_->PutTails(session.id(), session.tenant(), std::move(cuts)));
  if (session.tier_.manifest != nullptr) TURBOKV_RETURN_IF_ERROR(tier_->Wait(*session.tier_.manifest));
  return tier_->Wait(*record);
}

size_t Residency::TierBytes(const SessionCache& session) {
  if (!session.on_tier()) return 0;
  size_t bytes = session.tier_.manifest->bytes();
  if (!session.resident()) {
    for (const TierLayer& layer : session.tier_.demoted->layers) {
      for (const auto& page : layer.pages) bytes += page->bytes();
    }
    return bytes;
  }
  std::lock_guard<std::mutex> lock(records_mutex_);
  for (const LayerCache& layer : session.layers()) {
    for (const std::shared_ptr<Page>& page : layer.pages()) {
      if (page->record != nullptr) bytes += page->record->bytes();
    }
  }
  return bytes;
}

absl::Status Residency::RewriteDemoted(SessionCache& session) {
  const TierSession& old = *session.tier_.demoted;
  TierSession image = old;
  const int64_t pt = options_.page_tokens;
  std::vector<uint8_t> bytes;
  std::shared_ptr<TierRecord> last;
  for (size_t l = 0; l < old.layers.size(); ++l) {
    const TierLayer& layer = old.layers[l];
    bytes.resize(LayerPageBytes(session.config(), static_cast<int>(l), options_.page_tokens));
    image.layers[l].pages.clear();
    for (size_t i = 0; i < layer.pages.size(); ++i) {
      TURBOKV_RETURN_IF_ERROR(tier_->Read(*layer.pages[i], bytes.data(), bytes.size()));
      PageKey key = Key(session, static_cast<int>(l), static_cast<int>(i),
                        static_cast<int>(std::min<int64_t>(pt, layer.tokens - static_cast<int64_t>(i) * pt)));
      key.for_manifest = true;
      const absl::string_view page(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      absl::StatusOr<std::shared_ptr<TierRecord>> record = tier_->PutPage(key, page, /*force=*/true);
      if (absl::IsUnavailable(record.status()) && last != nullptr) {
        // The writer's queue is full (the disk reads faster than Redis
        // takes): once what is queued is written.
        TURBOKV_RETURN_IF_ERROR(tier_->Wait(*last));
        record = tier_->PutPage(key, page, /*force=*/true);
      }
      if (!record.ok()) return record.status();
      last = *record;
      image.layers[l].pages.push_back(*std::move(record));
    }
  }
  image.manifest = tier_->PutManifest(image);
  TURBOKV_RETURN_IF_ERROR(WaitForImage(*tier_, image, *image.manifest));
  session.tier_.manifest = image.manifest;
  *session.tier_.demoted = std::move(image);  // the lost records go
  return absl::OkStatus();
}

absl::Status Residency::Rewrite(SessionCache& session) {
  if (session.gone()) return absl::OkStatus();
  if (!session.resident()) {
    absl::Status status = RewriteDemoted(session);
    if (!status.ok()) {
      Logf(LogLevel::kWarning, "session %s was on the %s tier only when it lost its records: writing it again: %s",
           session.id().c_str(), tier_->name(), std::string(status.message()).c_str());
    }
    return status;
  }
  // Every page gets a new record, after a manifest that lists none of the
  // old ones; the old records go (their keys are deleted) after it.
  std::vector<std::shared_ptr<TierRecord>> old;
  {
    std::lock_guard<std::mutex> lock(records_mutex_);
    for (const LayerCache& layer : session.layers()) {
      for (const std::shared_ptr<Page>& page : layer.pages()) {
        if (page->record != nullptr) old.push_back(std::move(page->record));
      }
    }
  }
  session.tier_.manifest_extras.clear();
  session.tier_.manifest_lacks_tails = HoldsEveryAppend();
  absl::Status status = WriteTierManifest(session);
  if (status.ok()) status = WriteThrough(session, true);
  // Its sealed pages have records now: a manifest that holds the tails too
  // (or, failing it, the next append's).
  if (status.ok() && session.tier_.manifest_lacks_tails) status = WriteTierManifest(session);
  if (status.ok()) {
    session.tier_.manifest_lacks_tails = false;
    status = tier_->Wait(*session.tier_.manifest);
  }
  if (!status.ok()) {
    Logf(LogLevel::kWarning, "session %s: writing it again to the %s tier: %s", session.id().c_str(), tier_->name(),
         std::string(status.message()).c_str());
  }
  return status;
}

void Residency::NoteLost() {
  // Under lost_mutex_: an id the tier hands over is in lost_ before any
  // call can look for it there (an append of that session acknowledged
  // meanwhile would skip its rewrite).
  if (shared_ == nullptr) return;
  std::lock_guard<std::mutex> lock(lost_mutex_);
  for (std::string& id : shared_->TakeLost()) lost_.insert(std::move(id));
}

absl::Status Residency::RewriteIfLost(SessionCache& session) {
  {
    std::lock_guard<std::mutex> lock(lost_mutex_);
    if (lost_.erase(session.id()) == 0) return absl::OkStatus();
  }
  absl::Status status = Rewrite(session);
  // Tried again by the next pass or call, unless another daemon took the
  // session, or a demoted one's records cannot be read back (they are gone:
  // reading it is DATA_LOSS, as the log says).
  const bool unreadable = !session.resident() && (absl::IsDataLoss(status) || absl::IsNotFound(status));
  if (!status.ok() && !absl::IsFailedPrecondition(status) && !unreadable) {
    std::lock_guard<std::mutex> lock(lost_mutex_);
    if (!session.gone()) lost_.insert(session.id());
  }
  if (unreadable) {
    Logf(LogLevel::kWarning, "session %s: what the %s tier lost of it is DATA_LOSS when it is read",
         session.id().c_str(), tier_->name());
  }
  return status;
}

void Residency::RewriteLost() {
  NoteLost();
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(lost_mutex_);
    ids.assign(lost_.begin(), lost_.end());
  }
  for (const std::string& id : ids) {
    std::shared_ptr<SessionCache> session;
    {
      // Looked up and let go in one step: an id the tier hands over again
      // meanwhile stays.
      std::lock_guard<std::mutex> lock(lost_mutex_);
      session = host_.Held(id);
      if (session == nullptr) {
        lost_.erase(id);  // gone meanwhile: nothing to write
        continue;
      }
    }
    std::lock_guard<std::mutex> lock(session->mutex());
    RewriteIfLost(*session).IgnoreError();  // logged; the next pass or call tries again
  }
}

absl::Status Residency::Flush(absl::Time deadline) {
  if (tier_ == nullptr) return absl::OkStatus();
  absl::Status first_error;
  int failed = 0;
  // Sessions whose records the tier lost go back whole first, the demoted
  // ones too (from a stacked daemon's disk).
  NoteLost();
  for (const std::shared_ptr<SessionCache>& session : host_.List()) {
    std::lock_guard<std::mutex> lock(session->mutex());
    bool lost;
    {
      std::lock_guard<std::mutex> lost_lock(lost_mutex_);
      lost = lost_.count(session->id()) > 0;
    }
    if (session->gone() || (!session->resident() && !lost)) continue;
    absl::Status status = absl::Now() > deadline ? absl::DeadlineExceededError("the drain's deadline passed")
                                                 : RewriteIfLost(*session);
    if (status.ok() && !session->resident()) continue;
    if (status.ok()) status = WriteThrough(*session, true);
    absl::StatusOr<TierSession> image = status.ok() ? TierImage(*session, true) : status;
    if (image.ok()) {
      std::shared_ptr<TierRecord> manifest = tier_->PutManifest(*image);
      status = WaitForImage(*tier_, *image, *manifest);
      if (status.ok()) {
        session->tier_.manifest = std::move(manifest);
        NoteManifestExtras(*session);
      }
    } else {
      status = image.status();
    }
    if (!status.ok()) {
      ++failed;
      if (first_error.ok()) first_error = absl::Status(status.code(), absl::StrCat("session ", session->id(), ": ", status.message()));
    }
  }
  if (absl::Status status = tier_->Sync(); !status.ok() && first_error.ok()) first_error = status;
  if (!first_error.ok() && failed > 0) {
    return absl::Status(first_error.code(), absl::StrCat(failed, " session(s) not flushed to the ", tier_->name(), " tier; ",
                                                         first_error.message()));
  }
  return first_error;
}

}  // namespace turbokv
