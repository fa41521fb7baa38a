#include "service/store/session_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/rotation.h"
#include "service/backend/cpu_backend.h"
#include "service/error_side.h"
#include "service/log.h"
#include "service/status_macros.h"
#include "service/store/snapshot.h"

namespace turbokv {
namespace {

constexpr size_t kRememberedGone = 65536;

// Why a session on the tier only was dropped to bring the tier under its
// high watermark: names the tier and its budget's flag (a Redis tier's is
// not --spill-budget).
std::string TierDropReason(absl::string_view name) {
  return absl::StrCat("dropped: the ", name, " tier was over its high watermark (--", name == "redis" ? "redis" : "spill",
                      "-budget), oldest first");
}

std::string Who(const std::string& tenant) {
  return tenant.empty() ? std::string() : absl::StrCat(" of tenant '", tenant, "'");
}

}  // namespace

SessionStore::SessionStore(const StoreOptions& options, std::unique_ptr<Tier> tier)
    : options_(options),
      own_backend_(options.backend == nullptr ? std::make_unique<CpuBackend>() : nullptr),
      pool_(options.backend != nullptr ? options.backend : own_backend_.get(), options.budget_bytes),
      prefix_index_(options.on_block_events),
      residency_(std::move(tier), ResidencyOptions{options.page_tokens, options.promotion_patience}, pool_.backend(),
                 prefix_index_, *this) {}

SessionStore::~SessionStore() {
  // The sessions' records are still theirs on the tier: going away here
  // must not reclaim them.
  residency_.Close();
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Build(std::string id, std::string tenant,
                                                                  const SessionConfig& config, absl::Time created) {
  auto session = std::make_shared<SessionCache>(std::move(id), std::move(tenant), config, created);
  if (absl::Status status = Materialize(*session); !status.ok()) return status;
  return session;
}

absl::Status SessionStore::Materialize(SessionCache& session) {
  const SessionConfig& config = session.config();
  // One codec object per kind and stream, shared by the layers that use it.
  std::map<std::pair<CodecKind, RotationStream>, std::shared_ptr<const Codec>> codecs;
  auto codec = [&](CodecKind kind, RotationStream stream) -> absl::StatusOr<std::shared_ptr<const Codec>> {
    std::shared_ptr<const Codec>& slot = codecs[{kind, stream}];
    if (slot == nullptr) {
      absl::StatusOr<std::unique_ptr<Codec>> made =
          MakeCpuCodec(CodecSpec{kind, config.head_dim, DeriveRotationSeed(config.rotation_seed, stream)});
      if (!made.ok()) return made.status();
      slot = *std::move(made);
    }
    return slot;
  };
  std::vector<std::pair<std::shared_ptr<const Codec>, std::shared_ptr<const Codec>>> layer_codecs;
  for (int l = 0; l < config.layers; ++l) {
    absl::StatusOr<std::shared_ptr<const Codec>> keys = codec(config.KeyCodec(l), RotationStream::kKeys);
    if (!keys.ok()) return keys.status();
    absl::StatusOr<std::shared_ptr<const Codec>> values = codec(config.ValueCodec(l), RotationStream::kValues);
    if (!values.ok()) return values.status();
    layer_codecs.emplace_back(*std::move(keys), *std::move(values));
  }
  if (config.sink_tokens > options_.page_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sink_tokens = ", config.sink_tokens, " is more than a page's ",
                                                   options_.page_tokens, " tokens"));
  }
  auto hold_tokens = [&](int layer) {
    return HoldTokens(config.TransformOptions(layer), options_.page_tokens, config.sink_tokens);
  };
  bool holds = false;
  for (int l = 0; l < config.layers; ++l) holds = holds || hold_tokens(l) > 0;
  std::shared_ptr<const Codec> sink_codec;
  if (config.sink_tokens > 0 || holds) {
    absl::StatusOr<std::shared_ptr<const Codec>> made = codec(config.sink_codec, RotationStream::kKeys);
    if (!made.ok()) return made.status();
    sink_codec = *std::move(made);
  }
  const size_t shared = SessionSharedMetadataBytes(config);
  absl::StatusOr<std::shared_ptr<const void>> charge = pool_.Charge(SessionMetadataBytes(config) - shared);
  if (!charge.ok()) return charge.status();
  absl::StatusOr<std::shared_ptr<const void>> shared_charge = pool_.Charge(shared);
  if (!shared_charge.ok()) return shared_charge.status();
  session.charge_ = *std::move(charge);
  session.shared_charge_ = *std::move(shared_charge);
  session.layers_.reserve(config.layers);
  for (int l = 0; l < config.layers; ++l) {
    const auto& [keys, values] = layer_codecs[static_cast<size_t>(l)];
    session.layers_.emplace_back(keys, values, config.kv_heads, options_.page_tokens, &pool_,
                                 LayerStorage{config.TransformOptions(l), config.sink_tokens, hold_tokens(l), sink_codec});
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Create(const SessionConfig& config,
                                                                   const std::string& tenant, absl::Time now) {
  if (absl::Status room = MakeRoom(SessionMetadataBytes(config), {}); !room.ok()) return room;
  absl::StatusOr<std::shared_ptr<SessionCache>> session = Build(NewSessionId(), tenant, config, now);
  if (!session.ok()) return session.status();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (absl::Status inserted = Insert(*session); !inserted.ok()) return inserted;
  }
  if (residency_.has_tier()) {
    std::lock_guard<std::mutex> lock((*session)->mutex());
    // It holds no tokens yet: the first append writes one.
    residency_.WriteManifest(**session, /*acknowledged=*/false).IgnoreError();
  }
  return session;
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Find(const std::string& id, const std::string& tenant,
                                                                 absl::Time now) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it != sessions_.end() && it->second->tenant() == tenant) {
      if (absl::Status owned = residency_.Owned(id); !owned.ok()) {
        // Another daemon claimed it: this copy goes, without a tombstone.
        Erase(id);
        return owned;
      }
      it->second->Touch(now);
      return it->second;
    }
    if (residency_.shared_tier() == nullptr || it != sessions_.end() || damaged_.count(id) != 0) {
      return NotFound(id, tenant);
    }
  }
  return TakeOver(id, tenant, now);
}

absl::Status SessionStore::Delete(const std::string& id, const std::string& tenant) {
  if (residency_.has_tier()) {
    // A session only a shared tier holds is claimed first, so that it goes
    // from there too.
    if (absl::StatusOr<std::shared_ptr<SessionCache>> found = Find(id, tenant, absl::Now()); !found.ok()) {
      return found.status();
    }
  }
  std::shared_ptr<SessionCache> session;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || it->second->tenant() != tenant) return NotFound(id, tenant);
    session = it->second;
    Erase(id);
  }
  // Calls in flight on the session finish first; later ones see it gone.
  std::lock_guard<std::mutex> lock(session->mutex());
  Drop(session.get());
  RemoveSnapshot(id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Fork(SessionCache& source, int64_t prefix,
                                                            absl::Time now) {
  PrefixIndex::Holding holding = prefix_index_.Get(source.id());
  holding.hashes.resize(std::min(holding.hashes.size(), static_cast<size_t>(prefix / options_.page_tokens)));
  // Cut within the chunk its transforms were fitted on, the fork's later
  // tokens follow others than those the transforms saw.
  if (prefix < holding.reuse_from_tokens) holding.reuse_from_tokens = kNeverReused;
  return ForkAs(source, prefix, source.config(), std::move(holding), now);
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::ForkAs(SessionCache& source, int64_t prefix,
                                                              const SessionConfig& config,
                                                              PrefixIndex::Holding holding, absl::Time now) {
  // The fork shares the source's records on the tier as it shares its
  // pages: every sealed page gets one first (best effort: what is not on
  // the tier yet is the fork's unsealed tail there).
  residency_.WriteThrough(source, true).IgnoreError();
  // Past the sink tokens the fork shares the source's codecs, sink pages and
  // transforms; with fewer, it makes its own.
  const bool shares = prefix > config.sink_tokens;
  const size_t shared = SessionSharedMetadataBytes(config);
  const size_t own = SessionMetadataBytes(config) - shared;
  const SessionCache* held[] = {&source};
  TURBOKV_RETURN_IF_ERROR(MakeRoom(own + (shares ? 0 : shared), held));
  absl::StatusOr<std::shared_ptr<const void>> charge = pool_.Charge(own);
  if (!charge.ok()) return charge.status();
  absl::StatusOr<std::shared_ptr<const void>> shared_charge = shares ? source.shared_charge_ : pool_.Charge(shared);
  if (!shared_charge.ok()) return shared_charge.status();
  auto fork = std::make_shared<SessionCache>(NewSessionId(), source.tenant(), config, now);
  fork->charge_ = *std::move(charge);
  fork->shared_charge_ = *std::move(shared_charge);
  fork->layers_.reserve(source.layers().size());
  for (const LayerCache& layer : source.layers()) fork->layers_.push_back(layer.Fork(prefix));
  fork->errors_ = source.errors_;
  const absl::Status written = residency_.WriteManifest(*fork, /*acknowledged=*/true);
  std::lock_guard<std::mutex> lock(mutex_);
  absl::Status inserted = written.ok() ? Insert(fork) : written;
  if (!inserted.ok()) {
    Drop(fork.get());
    return inserted;
  }
  holding.medium = kMemoryMedium;  // whatever the source's was when it was read
  prefix_index_.Set(fork->id(), std::move(holding));
  return fork;
}

PrefixIndex::Holding SessionStore::HoldingOf(const SessionCache& session, NamedBlocks named,
                                             absl::Span<const int64_t> tokens) const {
  PrefixIndex::Holding holding;
  holding.scope = PrefixScope(session.tenant(), session.config());
  holding.seed = session.config().rotation_seed;
  holding.reuse_from_tokens = named.reuse_from_tokens;
  holding.hashes = std::move(named.hashes);
  for (int64_t layer : tokens) {
    holding.hashes.resize(std::min(holding.hashes.size(), static_cast<size_t>(layer / options_.page_tokens)));
  }
  return holding;
}

absl::StatusOr<PrefixIndex::Holding> SessionStore::NameBlocks(SessionCache& session, int64_t first_block,
                                                              absl::Span<const std::string> hashes) {
  const int64_t page_tokens = options_.page_tokens;
  PrefixIndex::Holding holding = prefix_index_.Get(session.id());
  const auto named = static_cast<int64_t>(holding.hashes.size());
  if (first_block < 0 || first_block > named) {
    return absl::FailedPreconditionError(absl::StrCat(
        "first_block = ", first_block, ": the session has ", named,
        " named blocks; blocks are named in order, from block 0"));
  }
  const int64_t end = first_block + static_cast<int64_t>(hashes.size());
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const int64_t tokens = session.layers()[l].tokens();
    if (tokens < end * page_tokens) {
      return absl::FailedPreconditionError(absl::StrCat("block ", end - 1, " ends at token ", end * page_tokens,
                                                        " but layer ", l, " holds ", tokens,
                                                        " tokens: only full blocks (", page_tokens,
                                                        " tokens in every layer) are named"));
    }
  }
  for (int64_t i = first_block; i < std::min(end, named); ++i) {
    if (holding.hashes[static_cast<size_t>(i)] != hashes[static_cast<size_t>(i - first_block)]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", i, " is named already with another hash (truncate the session to name it again)"));
    }
  }
  if (end <= named) return holding;
  if (named == 0) {
    int64_t reuse_from_tokens = 0;
    for (const LayerCache& layer : session.layers()) reuse_from_tokens = std::max(reuse_from_tokens, layer.transform_end());
    holding = HoldingOf(session, NamedBlocks{reuse_from_tokens, {}}, {});
  }
  for (int64_t i = named; i < end; ++i) holding.hashes.push_back(hashes[static_cast<size_t>(i - first_block)]);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // A session removed from the map meanwhile holds nothing any more.
    auto it = sessions_.find(session.id());
    if (it != sessions_.end() && it->second.get() == &session) prefix_index_.Set(session.id(), holding);
  }
  // The names reach the tier with a manifest (best effort: else with the
  // next one, at the latest the drain's).
  residency_.WriteManifest(session, /*acknowledged=*/false).IgnoreError();
  return holding;
}

absl::StatusOr<SessionStore::Attached> SessionStore::Attach(const SessionConfig& config, bool seed_given,
                                                            const std::string& tenant,
                                                            absl::Span<const std::string> hashes, absl::Time now) {
  const int64_t page_tokens = options_.page_tokens;
  hashes = hashes.subspan(0, static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(hashes.size()),
                                                                   config.max_tokens / page_tokens)));
  const std::string scope = PrefixScope(tenant, config);
  for (const PrefixIndex::Match& match :
       prefix_index_.Find(scope, seed_given ? &config.rotation_seed : nullptr, hashes, page_tokens)) {
    std::shared_ptr<SessionCache> source;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = sessions_.find(match.session_id);
      if (it == sessions_.end() || it->second->tenant() != tenant) continue;
      source = it->second;
    }
    std::lock_guard<std::mutex> lock(source->mutex());
    if (source->gone()) continue;
    // A truncation since the lookup may have cut what it holds.
    PrefixIndex::Holding holding = prefix_index_.Get(source->id());
    if (holding.hashes.size() < match.blocks ||
        !std::equal(hashes.begin(), hashes.begin() + static_cast<std::ptrdiff_t>(match.blocks), holding.hashes.begin())) {
      continue;
    }
    // A holder that cannot be read back or given room is passed over: the
    // next one, or a session of its own.
    const SessionCache* held[] = {source.get()};
    if (absl::Status promoted = residency_.Promote(*source, held); !promoted.ok()) {
      Logf(LogLevel::kWarning, "session %s not used for a prefix: %s", ShowId(source->id()).c_str(),
           std::string(promoted.message()).c_str());
      continue;
    }
    SessionConfig attached = config;
    attached.rotation_seed = source->config().rotation_seed;
    const int64_t tokens = static_cast<int64_t>(match.blocks) * page_tokens;
    holding.hashes.resize(match.blocks);
    absl::StatusOr<std::shared_ptr<SessionCache>> session = ForkAs(*source, tokens, attached, std::move(holding), now);
    if (session.ok()) return Attached{*std::move(session), tokens};
    if (!absl::IsResourceExhausted(session.status())) return session.status();
  }
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, Create(config, tenant, now));
  return Attached{std::move(session), 0};
}

std::vector<std::shared_ptr<SessionCache>> SessionStore::List() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<SessionCache>> sessions;
  sessions.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) sessions.push_back(session);
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->created() < b->created(); });
  return sessions;
}

StoreSnapshot SessionStore::Snapshot() const {
  StoreSnapshot snapshot;
  for (const std::shared_ptr<SessionCache>& session : List()) {
    std::lock_guard<std::mutex> lock(session->mutex());
    if (session->gone()) continue;
    ++snapshot.sessions;
    StoreSnapshot::TenantUse& tenant = snapshot.tenants[session->tenant()];
    ++tenant.sessions;
    tenant.bytes += static_cast<int64_t>(session->bytes_used());
    snapshot.tokens += session->tokens();
    const auto fp16_bytes = static_cast<int64_t>(session->fp16_bytes());
    snapshot.fp16_bytes += fp16_bytes;
    if (session->resident()) snapshot.resident_fp16_bytes += fp16_bytes;
    ++(session->resident() ? snapshot.resident_sessions : snapshot.demoted_sessions);
  }
  ResidencyStats residency = residency_.Stats();
  snapshot.tier = residency.tier;
  snapshot.tier_parts = std::move(residency.tier_parts);
  snapshot.demotions = residency.demotions;
  snapshot.promotions = residency.promotions;
  snapshot.disk_drops = disk_drops_.load();
  snapshot.named_blocks = static_cast<int64_t>(prefix_index_.blocks());
  snapshot.tier_health = residency_.Health();
  snapshot.bytes_used = static_cast<int64_t>(pool_.used_bytes());
  snapshot.budget_bytes = static_cast<int64_t>(pool_.budget_bytes());
  snapshot.lru_evictions = lru_evictions_.load();
  snapshot.ttl_expiries = ttl_expiries_.load();
  return snapshot;
}

void SessionStore::RemoveSnapshot(const std::string& id) const {
  if (!options_.snapshot_dir.empty()) unlink((options_.snapshot_dir + "/" + id + kSnapshotSuffix).c_str());
}

absl::StatusOr<SnapshotReport> SessionStore::SaveSnapshots(absl::Time deadline, bool final) {
  if (options_.snapshot_dir.empty()) return absl::FailedPreconditionError("turbokvd runs without --snapshot-dir");
  std::lock_guard<std::mutex> saving(save_mutex_);
  const std::string& dir = options_.snapshot_dir;
  // A MANIFEST describes the files of a finished drain; from the first write
  // on, they are not that any more.
  unlink((dir + "/" + kManifestName).c_str());
  SnapshotReport report;
  SnapshotManifest written;
  for (const std::shared_ptr<SessionCache>& session : List()) {
    if (absl::Now() > deadline) {
      report.failed.emplace_back(session->id(), absl::DeadlineExceededError("not written: the snapshot deadline passed"));
      continue;
    }
    std::vector<LayerCache> frozen;
    PrefixIndex::Holding holding;
    {
      std::lock_guard<std::mutex> lock(session->mutex());
      if (session->gone()) continue;
      if (!session->resident()) {
        // On the spill tier whole: an older snapshot must not stand in for it.
        RemoveSnapshot(session->id());
        continue;
      }
      frozen.reserve(session->layers().size());
      for (const LayerCache& layer : session->layers()) frozen.push_back(layer.Fork(layer.tokens()));
      holding = prefix_index_.Get(session->id());  // the names of these pages
    }
    const std::string file = dir + "/" + session->id() + kSnapshotSuffix;
    absl::StatusOr<uint32_t> crc = WriteSnapshot(dir, *session, frozen, NamedBlocks{holding.reuse_from_tokens, std::move(holding.hashes)},
                                                 options_.page_tokens, backend());
    if (!crc.ok()) {
      // The file on disk, if any, holds an older state: set aside (kept
      // for an operator), so that no start serves it as the session.
      rename(file.c_str(), (file + kStaleSuffix).c_str());
      report.failed.emplace_back(session->id(), crc.status());
      continue;
    }
    unlink((file + kStaleSuffix).c_str());
    {
      // Deleted or evicted while its file was being written: it must not
      // come back at the next start.
      std::lock_guard<std::mutex> lock(session->mutex());
      if (session->gone()) {
        RemoveSnapshot(session->id());
        continue;
      }
    }
    written[session->id()] = *crc;
    ++report.sessions;
    for (const LayerCache& layer : frozen) report.bytes += static_cast<int64_t>(layer.bytes());
  }
  // Snapshots of sessions deleted meanwhile, and leftover temp files, go;
  // damaged snapshots, and the older files of sessions that failed, stay
  // for an operator to look at.
  std::set<std::string> keep;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, why] : damaged_) keep.insert(id + kSnapshotSuffix);
    for (const auto& [id, session] : sessions_) keep.insert(id + kSnapshotSuffix);
  }
  for (const auto& [id, crc] : written) keep.insert(id + kSnapshotSuffix);
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      const std::string name = entry->d_name;
      if ((absl::EndsWith(name, kSnapshotSuffix) || absl::EndsWith(name, ".tmp")) && keep.count(name) == 0) {
        unlink((dir + "/" + name).c_str());
      }
    }
    closedir(d);
  }
  if (final && report.failed.empty()) {
    if (absl::Status status = WriteManifest(dir, written); !status.ok()) {
      return absl::InternalError(absl::StrCat("every session was written but the manifest was not (", status.message(),
                                              "): the next start will report them unverified"));
    }
  }
  return report;
}

absl::StatusOr<SnapshotReport> SessionStore::LoadSnapshots(absl::Time now) {
  const std::string& dir = options_.snapshot_dir;
  if (dir.empty()) return absl::FailedPreconditionError("turbokvd runs without --snapshot-dir");
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("cannot create --snapshot-dir ", dir, ": ", std::strerror(errno)));
  }
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::InternalError(absl::StrCat("cannot read --snapshot-dir ", dir, ": ", std::strerror(errno)));
  std::vector<std::string> names;
  std::vector<std::string> stale;
  while (dirent* entry = readdir(d)) {
    if (absl::EndsWith(entry->d_name, kSnapshotSuffix)) names.push_back(entry->d_name);
    if (absl::EndsWith(entry->d_name, kStaleSuffix)) stale.push_back(entry->d_name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  absl::StatusOr<SnapshotManifest> manifest = ReadManifest(dir);
  if (!manifest.ok() && !absl::IsNotFound(manifest.status())) return manifest.status();
  SnapshotReport report;
  for (const std::string& name : names) {
    const std::string id = name.substr(0, name.size() - std::strlen(kSnapshotSuffix));
    uint32_t crc = 0;
    NamedBlocks named;
    absl::StatusOr<std::shared_ptr<SessionCache>> loaded =
        ReadSnapshot(dir + "/" + name, options_.page_tokens, [&](const SnapshotHeader& header) -> absl::StatusOr<std::shared_ptr<SessionCache>> {
          if (header.id != id) return absl::DataLossError(absl::StrCat("the file holds session ", header.id));
          named = header.named;
          return Build(header.id, header.tenant, header.config, header.created);
        }, &crc);
    absl::Status status = loaded.status();
    if (status.ok() && manifest.ok()) {
      auto listed = manifest->find(id);
      if (listed == manifest->end() || listed->second != crc) {
        status = absl::DataLossError(
            "the last drain did not write this session (see its log); the file on disk holds an older state of it");
      }
    }
    if (status.ok()) {
      std::vector<int64_t> tokens;
      for (const LayerCache& layer : (*loaded)->layers()) tokens.push_back(layer.tokens());
      PrefixIndex::Holding holding = HoldingOf(**loaded, std::move(named), tokens);
      std::lock_guard<std::mutex> lock(mutex_);
      status = Insert(*loaded);
      if (status.ok()) prefix_index_.Set(id, std::move(holding));
    }
    if (!status.ok()) {
      report.failed.emplace_back(id, status);
      std::lock_guard<std::mutex> lock(mutex_);
      damaged_[id] = absl::StrCat("from its snapshot: ", status.message());  // kept on disk, answered with DATA_LOSS
      continue;
    }
    (*loaded)->Touch(now);
    if (!manifest.ok()) report.unverified.push_back(id);
    ++report.sessions;
    report.bytes += static_cast<int64_t>((*loaded)->bytes_used());
  }
  for (const std::string& name : stale) {
    const std::string id = name.substr(0, name.size() - std::strlen(kSnapshotSuffix) - std::strlen(kStaleSuffix));
    if (std::find(names.begin(), names.end(), id + kSnapshotSuffix) != names.end()) continue;
    const absl::Status status = absl::DataLossError(absl::StrCat(
        "a drain or Snapshot could not write this session; its file on disk holds an older state of it, kept as ",
        dir, "/", name));
    report.failed.emplace_back(id, status);
    std::lock_guard<std::mutex> lock(mutex_);
    damaged_[id] = absl::StrCat("from its snapshot: ", status.message());
  }
  if (manifest.ok()) unlink((dir + "/" + kManifestName).c_str());
  return report;
}

size_t SessionStore::session_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sessions_.size();
}

absl::Status SessionStore::NotFound(const std::string& id, const std::string& tenant) const {
  auto damaged = damaged_.find(id);
  if (damaged != damaged_.end()) {
    return absl::DataLossError(absl::StrCat("session ", ShowId(id), " could not be restored ", damaged->second));
  }
  auto gone = gone_reasons_.find(id);
  if (gone != gone_reasons_.end() && gone->second.first == tenant) {
    return absl::NotFoundError(absl::StrCat("session ", ShowId(id), " was ", gone->second.second));
  }
  return absl::NotFoundError(absl::StrCat("no session ", ShowId(id)));
}

absl::Status SessionStore::HasRoomFor(const std::string& tenant) const {
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("turbokvd holds ", sessions_.size(),
                                                     " sessions, the most allowed (--max-sessions); delete some"));
  }
  auto count = tenant_sessions_.find(tenant);
  if (count != tenant_sessions_.end() && count->second >= options_.max_tenant_sessions) {
    return CallerLimit(absl::ResourceExhaustedError(absl::StrCat("the ", count->second, " sessions", Who(tenant),
                                                                 " are the most one tenant may hold "
                                                                 "(--max-tenant-sessions); delete some")));
  }
  return absl::OkStatus();
}

absl::Status SessionStore::Insert(std::shared_ptr<SessionCache> session) {
  if (absl::Status room = HasRoomFor(session->tenant()); !room.ok()) return room;
  ++tenant_sessions_[session->tenant()];
  const std::string id = session->id();
  sessions_.emplace(id, std::move(session));
  return absl::OkStatus();
}

void SessionStore::Erase(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  auto count = tenant_sessions_.find(it->second->tenant());
  if (count != tenant_sessions_.end() && --count->second == 0) tenant_sessions_.erase(count);
  sessions_.erase(it);
  prefix_index_.Remove(id);
}

void SessionStore::Drop(SessionCache* session) {
  session->gone_ = true;
  session->ReleaseMemory();
  residency_.Forget(*session);
}

void SessionStore::RememberGone(const SessionCache& session, std::string reason, std::atomic<int64_t>* counter) {
  const std::string& id = session.id();
  gone_reasons_[id] = {session.tenant(), std::move(reason)};
  gone_order_.push_back(id);
  RemoveSnapshot(id);
  Erase(id);
  if (gone_order_.size() > kRememberedGone) {
    gone_reasons_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  counter->fetch_add(1);
}

absl::Status SessionStore::MakeRoom(size_t bytes, absl::Span<const SessionCache* const> held, bool* calls_hold_it) {
  if (calls_hold_it != nullptr) *calls_hold_it = false;
  const size_t budget = pool_.budget_bytes();
  auto fits = [&] { return bytes <= budget && pool_.used_bytes() <= budget - bytes; };
  if (fits()) return absl::OkStatus();
  auto refuse = [&](const std::string& why, absl::StatusCode code = absl::StatusCode::kResourceExhausted) {
    std::string tier;
    if (residency_.has_tier()) {
      const TierStats stats = residency_.TierUse();
      tier = absl::StrCat("; spill tier: ", stats.live_bytes + stats.queued_bytes, " bytes used of ",
                          stats.budget_bytes);
    }
    return absl::Status(code, absl::StrCat("memory budget exceeded: ", pool_.used_bytes(), " bytes used, ", bytes,
                                           " needed, budget ", budget, " bytes", why, tier));
  };
  if (options_.eviction != EvictionPolicy::kLru) return refuse("");
  const char* verb = residency_.has_tier() ? "demot" : "evict";
  if (bytes > budget) return refuse(absl::StrCat(" (more than the whole budget: nothing was ", verb, "ed)"));
  std::unique_lock<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<SessionCache>> candidates;
  for (const auto& [id, session] : sessions_) {
    if (std::find(held.begin(), held.end(), session.get()) == held.end()) candidates.push_back(session);
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a->last_used() < b->last_used(); });
  // First prove that evicting (or demoting) enough idle sessions, oldest
  // first, frees the bytes: a page counts once every holder of it is among
  // the victims.
  const size_t used = pool_.used_bytes();
  const size_t needed = used > budget - bytes ? used - (budget - bytes) : 0;
  size_t freeable = 0;
  bool busy = false;  // a session was skipped for being in a call
  std::unordered_map<const Page*, long> victim_refs;  // holders of each page among the victims
  std::map<std::weak_ptr<const void>, long, std::owner_less<std::weak_ptr<const void>>> victim_charges;
  std::vector<std::unique_lock<std::mutex>> victim_locks;
  std::vector<SessionCache*> victims;
  for (const std::shared_ptr<SessionCache>& candidate : candidates) {
    if (freeable >= needed) break;
    // A session with a call in flight is not idle: skip it.
    std::unique_lock<std::mutex> candidate_lock(candidate->mutex(), std::try_to_lock);
    if (residency_.has_tier() && candidate->config().pinned) continue;
    if (!candidate_lock.owns_lock() || candidate->in_call()) {
      busy = true;
      continue;
    }
    if (candidate->gone() || !candidate->resident()) continue;
    const size_t shared = SessionSharedMetadataBytes(candidate->config());
    freeable += SessionMetadataBytes(candidate->config()) - shared;
    // Charges all point at the pool: told apart by their owners.
    if (++victim_charges[candidate->shared_charge_] == candidate->shared_charge_.use_count()) freeable += shared;
    for (const LayerCache& layer : candidate->layers()) {
      for (const std::shared_ptr<Page>& page : layer.pages()) {
        if (++victim_refs[page.get()] == page.use_count()) freeable += page->bytes;
      }
      const std::shared_ptr<const void>& hold = layer.hold_charge();
      if (hold != nullptr && ++victim_charges[hold] == hold.use_count()) freeable += layer.hold_charge_bytes();
    }
    victim_locks.push_back(std::move(candidate_lock));
    victims.push_back(candidate.get());
  }
  if (freeable < needed) {
    if (calls_hold_it != nullptr) *calls_hold_it = busy;
    return refuse(absl::StrCat("; ", verb, "ing every idle session would free only ", freeable, " bytes, so none was ",
                               verb, "ed", busy ? " (others are in calls)" : ""));
  }
  if (residency_.has_tier()) {
    // Demotion writes to the tier: not under the store's mutex.
    lock.unlock();
    for (SessionCache* victim : victims) {
      if (absl::Status status = residency_.Demote(*victim); !status.ok()) {
        return refuse(absl::StrCat("; demoting an idle session to the spill tier failed: ", status.message()),
                      absl::IsUnavailable(status) ? absl::StatusCode::kUnavailable
                                                  : absl::StatusCode::kResourceExhausted);
      }
    }
  } else {
    for (SessionCache* victim : victims) {
      Logf(LogLevel::kInfo, "session %s evicted (least recently used, idle %s) to make room in the memory budget",
                   victim->id().c_str(), absl::FormatDuration(absl::Now() - victim->last_used()).c_str());
      Drop(victim);
      RememberGone(*victim, "evicted (least recently used) to make room in the memory budget", &lru_evictions_);
    }
  }
  victim_locks.clear();
  if (fits()) return absl::OkStatus();
  if (calls_hold_it != nullptr) *calls_hold_it = true;
  return refuse(absl::StrCat(" (after ", verb, "ing; another call took the room first)"));
}

absl::Status SessionStore::Truncate(SessionCache& session, int64_t n) {
  if (n <= session.config().sink_tokens && session.shared_charge_.use_count() > 1) {
    // Its sink pages and transforms will be its own from now on.
    const size_t shared = SessionSharedMetadataBytes(session.config());
    const SessionCache* held[] = {&session};
    TURBOKV_RETURN_IF_ERROR(MakeRoom(shared, held));
    TURBOKV_ASSIGN_OR_RETURN(session.shared_charge_, pool_.Charge(shared));
  }
  return residency_.Truncate(session, n);
}

std::shared_ptr<SessionCache> SessionStore::Held(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sessions_.find(id);
  return it != sessions_.end() ? it->second : nullptr;
}

int SessionStore::ExpireIdle(absl::Time now) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<SessionCache>> expired;
  for (const auto& [id, session] : sessions_) {
    const absl::Duration ttl = session->config().idle_ttl;
    if (ttl > absl::ZeroDuration() && now - session->last_used() > ttl) expired.push_back(session);
  }
  int count = 0;
  for (const std::shared_ptr<SessionCache>& session : expired) {
    std::unique_lock<std::mutex> session_lock(session->mutex(), std::try_to_lock);
    if (!session_lock.owns_lock() || session->in_call()) continue;  // in use: not idle
    Drop(session.get());
    RememberGone(*session, absl::StrCat("expired after ", absl::FormatDuration(session->config().idle_ttl), " idle"),
                 &ttl_expiries_);
    ++count;
  }
  return count;
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::TakeOver(const std::string& id, const std::string& tenant,
                                                                     absl::Time now) {
  // One claim at a time: two calls naming the same session claim it once.
  std::lock_guard<std::mutex> claiming(claim_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      if (it->second->tenant() != tenant) return NotFound(id, tenant);
      it->second->Touch(now);
      return it->second;
    }
    if (absl::Status room = HasRoomFor(tenant); !room.ok()) return room;
  }
  absl::StatusOr<TierSession> image = residency_.Claim(id, tenant);
  if (!image.ok()) {
    if (absl::IsNotFound(image.status())) {
      CountTakeover(kTakeoverNotFound);
      std::lock_guard<std::mutex> lock(mutex_);
      return NotFound(id, tenant);
    }
    CountTakeover(absl::IsFailedPrecondition(image.status()) ? kTakeoverHeld : kTakeoverFailed);
    return image.status();
  }
  SessionConfig config = image->header.config;
  config.pinned = image->pinned;
  auto session = std::make_shared<SessionCache>(id, tenant, config, image->header.created);
  session->Touch(now);
  PrefixIndex::Holding holding = DemotedHolding(*session, *image);
  Residency::Adopt(*session, *std::move(image));
  absl::Status inserted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inserted = Insert(session);
    if (inserted.ok()) prefix_index_.Set(id, std::move(holding));
  }
  if (!inserted.ok()) {
    residency_.LetGo(*session);  // its pages stay on the tier
    return inserted;
  }
  CountTakeover(kTakeoverOk);
  Logf(LogLevel::kInfo, "session %s taken over from the %s tier (%lld tokens in layer 0, %d layers)", id.c_str(),
       residency_.tier_name(), static_cast<long long>(session->layer_tokens(0)), config.layers);
  return session;
}

SessionStore::RebalanceReport SessionStore::Rebalance() {
  RebalanceReport report;
  if (!residency_.has_tier()) return report;
  for (const std::string& id : residency_.TakeDisowned()) {
    // Another daemon claimed it: this copy goes, without a tombstone.
    std::lock_guard<std::mutex> lock(mutex_);
    Erase(id);
  }
  if (residency_.shared_tier() != nullptr) {
    // Sessions a shared tier claimed by itself (a stacked daemon's copies on
    // its disk, once the lease of its run before lapsed), one claim at a
    // time with calls' takeovers.
    std::lock_guard<std::mutex> claiming(claim_mutex_);
    for (TierSession& image : residency_.TakeClaimed()) {
      const std::string id = image.header.id;
      bool kept_on_tier = false;
      if (absl::Status status = RegisterDemoted(std::move(image), absl::Now(), &kept_on_tier); !status.ok()) {
        Logf(LogLevel::kWarning, "session %s, claimed from the %s tier, is not registered: %s", id.c_str(),
             residency_.tier_name(), std::string(status.message()).c_str());
      }
    }
  }
  residency_.RewriteLost();
  std::vector<std::shared_ptr<SessionCache>> sessions = List();
  // Write-through that the request path left for later (its queue was full).
  for (const std::shared_ptr<SessionCache>& session : sessions) {
    std::unique_lock<std::mutex> lock(session->mutex(), std::try_to_lock);
    if (lock.owns_lock() && !residency_.WriteThrough(*session, false).ok()) break;
  }
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->last_used() < b->last_used(); });
  const double budget = static_cast<double>(pool_.budget_bytes());
  if (static_cast<double>(pool_.used_bytes()) > options_.high_watermark * budget) {
    for (const std::shared_ptr<SessionCache>& session : sessions) {
      if (static_cast<double>(pool_.used_bytes()) <= options_.low_watermark * budget) break;
      std::unique_lock<std::mutex> lock(session->mutex(), std::try_to_lock);
      if (!lock.owns_lock() || session->gone() || !session->resident() || session->config().pinned ||
          session->in_call()) {
        continue;
      }
      if (absl::Status status = residency_.Demote(*session); !status.ok()) {
        report.error = status;
        break;
      }
      ++report.demoted;
    }
  }
  const TierStats stats = residency_.TierUse();
  const double tier_budget = static_cast<double>(stats.budget_bytes);
  int64_t live = stats.live_bytes + stats.queued_bytes;
  if (static_cast<double>(live) > options_.high_watermark * tier_budget) {
    // The oldest sessions on disk only go, whole, until the tier is under
    // its low watermark.
    for (const std::shared_ptr<SessionCache>& session : sessions) {
      if (static_cast<double>(live) <= options_.low_watermark * tier_budget) break;
      std::unique_lock<std::mutex> session_lock(session->mutex(), std::try_to_lock);
      if (!session_lock.owns_lock() || session->gone() || session->resident()) continue;
      live -= static_cast<int64_t>(residency_.TierBytes(*session));
      std::lock_guard<std::mutex> lock(mutex_);
      Drop(session.get());
      RememberGone(*session, TierDropReason(residency_.tier_name()), &disk_drops_);
      report.dropped.push_back(session->id());
    }
  }
  return report;
}

PrefixIndex::Holding SessionStore::DemotedHolding(const SessionCache& session, const TierSession& image) const {
  std::vector<int64_t> tokens;
  for (const TierLayer& layer : image.layers) tokens.push_back(layer.tokens);
  PrefixIndex::Holding holding = HoldingOf(session, image.named, tokens);
  holding.medium = residency_.tier_name();
  return holding;
}

absl::Status SessionStore::RegisterDemoted(TierSession image, absl::Time now, bool* kept_on_tier) {
  *kept_on_tier = false;
  SessionConfig config = image.header.config;
  config.pinned = image.pinned;
  auto session = std::make_shared<SessionCache>(image.header.id, image.header.tenant, config, image.header.created);
  session->Touch(now);
  PrefixIndex::Holding holding = DemotedHolding(*session, image);
  Residency::Adopt(*session, std::move(image));
  absl::Status inserted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (sessions_.count(session->id()) != 0) {
      return absl::AlreadyExistsError("its snapshot holds it whole");
    }
    inserted = Insert(session);
    if (inserted.ok()) prefix_index_.Set(session->id(), std::move(holding));
  }
  if (!inserted.ok()) {
    // A shared tier keeps it for a later claim; a local one's records die
    // with their handles.
    *kept_on_tier = residency_.LetGo(*session);
  }
  return inserted;
}

absl::StatusOr<TierScanReport> SessionStore::LoadTier(absl::Time now) {
  absl::StatusOr<TierScanReport> report = residency_.Scan();
  if (!report.ok()) return report.status();
  std::vector<TierSession> sessions = std::move(report->sessions);
  report->sessions.clear();
  for (const auto& [id, status] : report->damaged) damaged_[id] = absl::StrCat("from the spill tier: ", status.message());
  for (TierSession& image : sessions) {
    const std::string id = image.header.id;
    bool kept_on_tier = false;
    absl::Status status = RegisterDemoted(std::move(image), now, &kept_on_tier);
    if (status.ok()) {
      ++report->loaded;
    } else if (!absl::IsAlreadyExists(status)) {
      report->damaged.emplace_back(id, status);
      // Lost, unless the tier still holds it for a later claim.
      if (!kept_on_tier) damaged_[id] = absl::StrCat("from the spill tier: ", status.message());
    }
  }
  return report;
}

}  // namespace turbokv
