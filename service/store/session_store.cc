#include "service/store/session_store.h"

#include <dirent.h>
#include <sys/random.h>
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
#include "service/backend/cpu_backend.h"
#include "service/error_side.h"
#include "service/log.h"
#include "service/store/snapshot.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/rotation.h"

namespace turbokv {
namespace {

constexpr size_t kRememberedGone = 65536;
// Measured (tests/service/store_test.cc, SessionMetadataIsCharged) and
// rounded up.
constexpr size_t kCodecMetadataBytes = 4096;
constexpr size_t kLayerMetadataBytes = sizeof(LayerCache) + 96;

std::string Who(const std::string& tenant) {
  return tenant.empty() ? std::string() : absl::StrCat(" of tenant '", tenant, "'");
}

}  // namespace

std::string NewSessionId() {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz234567";
  // The kernel's CSPRNG (getrandom blocks only until it is first seeded).
  unsigned __int128 bits = 0;
  for (size_t got = 0; got < sizeof(bits);) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&bits) + got, sizeof(bits) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string id(26, 'a');
  for (char& c : id) {
    c = kAlphabet[static_cast<unsigned>(bits & 31)];
    bits >>= 5;
  }
  return id;
}

SessionCache::SessionCache(std::string id, std::string tenant, const SessionConfig& config, absl::Time now)
    : id_(std::move(id)),
      tenant_(std::move(tenant)),
      config_(config),
      created_(now),
      last_used_ns_(absl::ToUnixNanos(now)),
      errors_(static_cast<size_t>(config.layers)) {}

SessionCache::~SessionCache() = default;

size_t SessionCache::bytes_used() const {
  size_t bytes = 0;
  for (const LayerCache& layer : layers_) bytes += layer.bytes();
  return bytes;
}

int64_t SessionCache::layer_tokens(int layer) const {
  const size_t l = static_cast<size_t>(layer);
  return resident() ? layers_[l].tokens() : demoted_->layers[l].tokens;
}

int64_t SessionCache::tokens() const {
  int64_t tokens = 0;
  if (!resident()) {
    for (const TierLayer& layer : demoted_->layers) tokens += layer.tokens;
    return tokens;
  }
  for (const LayerCache& layer : layers_) tokens += layer.tokens();
  return tokens;
}

int SessionCache::transformed_layers() const {
  int count = 0;
  if (resident()) {
    for (const LayerCache& layer : layers_) count += layer.transformed() ? 1 : 0;
  } else {
    for (const TierLayer& layer : demoted_->layers) count += layer.extras.transform.empty() ? 0 : 1;
  }
  return count;
}

size_t SessionCache::fp16_bytes() const {
  // Keys and values, two bytes a value.
  return static_cast<size_t>(tokens()) * config_.kv_heads * config_.head_dim * 2 * 2;
}

std::string ShowId(absl::string_view id) {
  constexpr size_t kShown = 40;
  if (id.size() <= kShown) return std::string(id);
  return absl::StrCat(id.substr(0, kShown), "... (", id.size(), " bytes)");
}

size_t SessionMetadataBytes(const SessionConfig& config) {
  // The session object and its codecs (sign vectors, codebooks; a pair
  // for the keys and values of every layer, and one more for each pair the
  // ranges of layer_codecs add), then per layer its LayerCache and
  // allocator overhead.
  // Each layer's sink page and transform count at their largest.
  return sizeof(SessionCache) + kCodecMetadataBytes * (1 + config.layer_codecs.size()) +
         static_cast<size_t>(config.layers) *
             (kLayerMetadataBytes + LayerExtrasBytes(config.kv_heads, config.head_dim, config.sink_tokens,
                                                     config.sink_codec));
}

SessionStore::SessionStore(const StoreOptions& options, std::unique_ptr<Tier> tier)
    : options_(options),
      own_backend_(options.backend == nullptr ? std::make_unique<CpuBackend>() : nullptr),
      pool_(options.backend != nullptr ? options.backend : own_backend_.get(), options.budget_bytes),
      tier_(std::move(tier)) {}

SessionStore::~SessionStore() {
  // The sessions' records are still theirs on the tier: going away here
  // must not reclaim them.
  if (tier_ != nullptr) tier_->Close();
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
  std::shared_ptr<const Codec> sink_codec;
  if (config.sink_tokens > 0) {
    if (config.sink_tokens > options_.page_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("sink_tokens = ", config.sink_tokens, " is more than a page's ",
                                                     options_.page_tokens, " tokens"));
    }
    absl::StatusOr<std::shared_ptr<const Codec>> made = codec(config.sink_codec, RotationStream::kKeys);
    if (!made.ok()) return made.status();
    sink_codec = *std::move(made);
  }
  absl::StatusOr<std::shared_ptr<const void>> charge = pool_.Charge(SessionMetadataBytes(config));
  if (!charge.ok()) return charge.status();
  session.charge_ = *std::move(charge);
  session.layers_.reserve(config.layers);
  for (int l = 0; l < config.layers; ++l) {
    const auto& [keys, values] = layer_codecs[static_cast<size_t>(l)];
    session.layers_.emplace_back(keys, values, config.kv_heads, options_.page_tokens, &pool_,
                                 LayerStorage{config.TransformOptions(l), config.sink_tokens, sink_codec});
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
  if (tier_ != nullptr) {
    std::lock_guard<std::mutex> lock((*session)->mutex());
    WriteTierManifest(**session);
  }
  return session;
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Find(const std::string& id, const std::string& tenant,
                                                                 absl::Time now) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it != sessions_.end() && it->second->tenant() == tenant) {
      if (tier_ != nullptr) {
        if (absl::Status owned = tier_->Owned(id); !owned.ok()) {
          // Another daemon claimed it: this copy goes, without a tombstone.
          Erase(id);
          return owned;
        }
      }
      it->second->Touch(now);
      return it->second;
    }
    if (tier_ == nullptr || it != sessions_.end() || damaged_.count(id) != 0) return NotFound(id, tenant);
  }
  return TakeOver(id, tenant, now);
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
  absl::StatusOr<TierSession> image = tier_->Claim(id, tenant);
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
  session->manifest_ = image->manifest;
  session->demoted_ = std::make_unique<TierSession>(*std::move(image));
  std::lock_guard<std::mutex> lock(mutex_);
  if (absl::Status inserted = Insert(session); !inserted.ok()) return inserted;
  CountTakeover(kTakeoverOk);
  Logf(LogLevel::kInfo, "session %s taken over from the %s tier (%lld tokens in layer 0, %d layers)", id.c_str(),
       tier_->name(), static_cast<long long>(session->layer_tokens(0)), config.layers);
  return session;
}

absl::Status SessionStore::Delete(const std::string& id, const std::string& tenant) {
  if (tier_ != nullptr) {
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
  // The fork shares the source's records on the tier as it shares its
  // pages: every sealed page gets one first (best effort: what is not on
  // the tier yet is the fork's unsealed tail there).
  if (tier_ != nullptr) WriteThrough(source, true).IgnoreError();
  absl::StatusOr<std::shared_ptr<const void>> charge = pool_.Charge(SessionMetadataBytes(source.config()));
  if (!charge.ok()) return charge.status();
  auto fork = std::make_shared<SessionCache>(NewSessionId(), source.tenant(), source.config(), now);
  fork->charge_ = *std::move(charge);
  fork->layers_.reserve(source.layers().size());
  for (const LayerCache& layer : source.layers()) fork->layers_.push_back(layer.Fork(prefix));
  fork->errors_ = source.errors_;
  if (tier_ != nullptr) WriteTierManifest(*fork);
  std::lock_guard<std::mutex> lock(mutex_);
  if (absl::Status inserted = Insert(fork); !inserted.ok()) {
    Drop(fork.get());
    return inserted;
  }
  return fork;
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
  if (tier_ != nullptr) snapshot.tier = tier_->Stats();
  snapshot.demotions = demotions_.load();
  snapshot.promotions = promotions_.load();
  snapshot.disk_drops = disk_drops_.load();
  if (tier_ != nullptr) snapshot.tier_health = tier_->Health();
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
    }
    const std::string file = dir + "/" + session->id() + kSnapshotSuffix;
    absl::StatusOr<uint32_t> crc = WriteSnapshot(dir, *session, frozen, options_.page_tokens, backend());
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
    absl::StatusOr<std::shared_ptr<SessionCache>> loaded =
        ReadSnapshot(dir + "/" + name, options_.page_tokens, [&](const SnapshotHeader& header) -> absl::StatusOr<std::shared_ptr<SessionCache>> {
          if (header.id != id) return absl::DataLossError(absl::StrCat("the file holds session ", header.id));
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
      std::lock_guard<std::mutex> lock(mutex_);
      status = Insert(*loaded);
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
}

void SessionStore::Drop(SessionCache* session) {
  session->gone_ = true;
  session->layers_.clear();
  session->charge_.reset();
  if (tier_ != nullptr && session->on_tier()) tier_->PutTombstone(session->id(), session->tenant());
  session->manifest_.reset();
  session->demoted_.reset();
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
    if (tier_ != nullptr) {
      const TierStats stats = tier_->Stats();
      tier = absl::StrCat("; spill tier: ", stats.live_bytes + stats.queued_bytes, " bytes used of ",
                          stats.budget_bytes);
    }
    return absl::Status(code, absl::StrCat("memory budget exceeded: ", pool_.used_bytes(), " bytes used, ", bytes,
                                           " needed, budget ", budget, " bytes", why, tier));
  };
  if (options_.eviction != EvictionPolicy::kLru) return refuse("");
  const char* verb = tier_ != nullptr ? "demot" : "evict";
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
  std::unordered_map<const Page*, long> victim_refs;
  std::vector<std::unique_lock<std::mutex>> victim_locks;
  std::vector<SessionCache*> victims;
  for (const std::shared_ptr<SessionCache>& candidate : candidates) {
    if (freeable >= needed) break;
    // A session with a call in flight is not idle: skip it.
    std::unique_lock<std::mutex> candidate_lock(candidate->mutex(), std::try_to_lock);
    if (tier_ != nullptr && candidate->config().pinned) continue;
    if (!candidate_lock.owns_lock() || candidate->in_call()) {
      busy = true;
      continue;
    }
    if (candidate->gone() || !candidate->resident()) continue;
    freeable += SessionMetadataBytes(candidate->config());
    for (const LayerCache& layer : candidate->layers()) {
      for (const std::shared_ptr<Page>& page : layer.pages()) {
        if (++victim_refs[page.get()] == page.use_count()) freeable += page->bytes;
      }
    }
    victim_locks.push_back(std::move(candidate_lock));
    victims.push_back(candidate.get());
  }
  if (freeable < needed) {
    if (calls_hold_it != nullptr) *calls_hold_it = busy;
    return refuse(absl::StrCat("; ", verb, "ing every idle session would free only ", freeable, " bytes, so none was ",
                               verb, "ed", busy ? " (others are in calls)" : ""));
  }
  if (tier_ != nullptr) {
    // Demotion writes to the tier: not under the store's mutex.
    lock.unlock();
    for (SessionCache* victim : victims) {
      if (absl::Status status = Demote(*victim); !status.ok()) {
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

PageKey SessionStore::Key(const SessionCache& session, int layer, int index, int tokens) {
  const SessionConfig& c = session.config();
  return PageKey{session.id(), session.tenant(), layer, index, tokens, c.KeyCodec(layer), c.ValueCodec(layer),
                 c.rotation_seed};
}

absl::StatusOr<std::shared_ptr<TierRecord>> SessionStore::PutPage(const PageKey& key, const Page& page, bool force) {
  absl::StatusOr<std::shared_ptr<TierRecord>> record;
  absl::Status read = backend().ReadPage(page.data, page.bytes, [&](absl::string_view bytes) {
    record = tier_->PutPage(key, bytes, force);
    return record.status();
  });
  if (!read.ok()) return read;
  return record;
}

absl::Status SessionStore::WriteThrough(SessionCache& session, bool force) {
  if (tier_ == nullptr || !session.resident() || session.gone()) return absl::OkStatus();
  const int64_t pt = options_.page_tokens;
  // A layer's sealed pages are encoded through its transform and next to
  // its sink tokens: a manifest holding them goes first, so that a restart
  // that finds the pages finds what they need.
  for (size_t l = 0; l < session.layers().size(); ++l) {
    const LayerCache& layer = session.layers()[l];
    const bool stale = l >= session.manifest_extras_.size() || session.manifest_extras_[l] != layer.extras_version();
    bool unwritten = false;
    if (stale && layer.tokens() >= pt) {
      std::lock_guard<std::mutex> lock(records_mutex_);
      unwritten = layer.pages()[static_cast<size_t>(layer.tokens() / pt) - 1]->record == nullptr;
    }
    if (unwritten) {
      WriteTierManifest(session);
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
          PutPage(Key(session, static_cast<int>(l), static_cast<int>(i), static_cast<int>(pt)), *pages[i], force);
      if (!record.ok()) return record.status();
      std::lock_guard<std::mutex> lock(records_mutex_);
      if (pages[i]->record == nullptr) pages[i]->record = *std::move(record);  // else a fork's came first
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TierSession> SessionStore::TierImage(const SessionCache& session, bool tails) {
  TierSession image;
  image.header = SessionHeader{session.id(), session.tenant(), session.config(), session.created(),
                               options_.page_tokens};
  image.pinned = session.config().pinned;
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
    out.extras = layer.Extras();
    if (tails && out.pages.size() == full && layer.tokens() % pt != 0) {
      absl::StatusOr<std::shared_ptr<TierRecord>> tail = PutPage(
          Key(session, static_cast<int>(l), static_cast<int>(full), static_cast<int>(layer.tokens() % pt)),
          *pages[full], true);
      if (!tail.ok()) return tail.status();
      out.pages.push_back(*std::move(tail));
      out.tokens = layer.tokens();
    }
    image.layers.push_back(std::move(out));
  }
  return image;
}

void SessionStore::WriteTierManifest(SessionCache& session) {
  absl::StatusOr<TierSession> image = TierImage(session, false);
  if (!image.ok()) return;
  session.manifest_ = tier_->PutManifest(*image);
  NoteManifestExtras(session);
}

void SessionStore::NoteManifestExtras(SessionCache& session) {
  session.manifest_extras_.clear();
  for (const LayerCache& layer : session.layers()) session.manifest_extras_.push_back(layer.extras_version());
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

absl::Status SessionStore::Demote(SessionCache& session) {
  if (tier_ == nullptr) return absl::FailedPreconditionError("turbokvd runs without --spill-dir");
  if (!session.resident() || session.gone()) return absl::OkStatus();
  absl::Status status = WriteThrough(session, true);
  absl::StatusOr<TierSession> image = status.ok() ? TierImage(session, true) : status;
  if (image.ok()) {
    for (size_t l = 0; l < image->layers.size(); ++l) {
      if (image->layers[l].tokens != session.layers()[l].tokens()) {
        image = absl::UnavailableError("a sealed page of the session is not on the spill tier");
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
  session.manifest_ = std::move(manifest);
  session.manifest_extras_.clear();
  session.layers_.clear();
  session.charge_.reset();
  session.demoted_ = std::make_unique<TierSession>(*std::move(image));
  demotions_.fetch_add(1);
  return absl::OkStatus();
}

absl::Status SessionStore::Promote(SessionCache& session, absl::Span<const SessionCache* const> held,
                                   ThreadPool* pool) {
  if (session.resident()) return absl::OkStatus();
  const TierSession& image = *session.demoted_;
  const SessionConfig& config = session.config();
  size_t bytes = SessionMetadataBytes(config);
  for (size_t l = 0; l < image.layers.size(); ++l) {
    bytes += image.layers[l].pages.size() * LayerPageBytes(config, static_cast<int>(l), options_.page_tokens);
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.promotion_patience;
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
                       absl::FormatDuration(options_.promotion_patience), " behind ", ahead,
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

absl::Status SessionStore::PromoteNow(SessionCache& session, size_t bytes, absl::Span<const SessionCache* const> held,
                                      ThreadPool* pool, bool* calls_hold_it) {
  const TierSession& image = *session.demoted_;
  if (absl::Status status = MakeRoom(bytes, held, calls_hold_it); !status.ok()) {
    return absl::Status(status.code(), absl::StrCat("session ", ShowId(session.id()), " is on the ", tier_->name(),
                                                    " tier and cannot come back into memory: ", status.message()));
  }
  std::vector<std::shared_ptr<TierRecord>> records;
  for (const TierLayer& layer : image.layers) records.insert(records.end(), layer.pages.begin(), layer.pages.end());
  tier_->WillRead(records);
  absl::Status status = Materialize(session);
  if (status.ok()) {
    // Layers load in parallel: one thread's reads wait on the disk while
    // another's pages are checked and copied.
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
      pool->ParallelFor(static_cast<int64_t>(image.layers.size()), load);
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
    session.layers_.clear();
    session.charge_.reset();
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
  session.demoted_.reset();
  NoteManifestExtras(session);  // what was loaded is what its manifest held
  promotions_.fetch_add(1);
  return absl::OkStatus();
}

void SessionStore::Truncate(SessionCache& session, int64_t n) {
  for (LayerCache& layer : session.layers()) layer.Truncate(n);
  if (tier_ == nullptr) return;
  {
    // A partly filled last page that only this session holds is written in
    // place from now on: it is not its record any more.
    std::lock_guard<std::mutex> lock(records_mutex_);
    for (LayerCache& layer : session.layers()) {
      if (layer.tokens() % options_.page_tokens != 0 && layer.pages().back().use_count() == 1) {
        layer.pages().back()->record.reset();
      }
    }
  }
  WriteTierManifest(session);
}

size_t SessionStore::TierBytes(const SessionCache& session) {
  if (!session.on_tier()) return 0;
  size_t bytes = session.manifest_->bytes();
  if (!session.resident()) {
    for (const TierLayer& layer : session.demoted_->layers) {
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

SessionStore::RebalanceReport SessionStore::Rebalance() {
  RebalanceReport report;
  if (tier_ == nullptr) return report;
  for (const auto& disowned : tier_->TakeDisowned()) {
    // Another daemon claimed it: this copy goes, without a tombstone.
    std::lock_guard<std::mutex> lock(mutex_);
    Erase(disowned.first);
  }
  std::vector<std::shared_ptr<SessionCache>> sessions = List();
  // Write-through that the request path left for later (its queue was full).
  for (const std::shared_ptr<SessionCache>& session : sessions) {
    std::unique_lock<std::mutex> lock(session->mutex(), std::try_to_lock);
    if (lock.owns_lock() && !WriteThrough(*session, false).ok()) break;
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
      if (absl::Status status = Demote(*session); !status.ok()) {
        report.error = status;
        break;
      }
      ++report.demoted;
    }
  }
  const TierStats stats = tier_->Stats();
  const double tier_budget = static_cast<double>(stats.budget_bytes);
  int64_t live = stats.live_bytes + stats.queued_bytes;
  if (static_cast<double>(live) > options_.high_watermark * tier_budget) {
    // The oldest sessions on disk only go, whole, until the tier is under
    // its low watermark.
    for (const std::shared_ptr<SessionCache>& session : sessions) {
      if (static_cast<double>(live) <= options_.low_watermark * tier_budget) break;
      std::unique_lock<std::mutex> session_lock(session->mutex(), std::try_to_lock);
      if (!session_lock.owns_lock() || session->gone() || session->resident()) continue;
      live -= static_cast<int64_t>(TierBytes(*session));
      std::lock_guard<std::mutex> lock(mutex_);
      Drop(session.get());
      RememberGone(*session, "dropped: the spill tier was over its high watermark (--spill-budget), oldest first",
                   &disk_drops_);
      report.dropped.push_back(session->id());
    }
  }
  return report;
}

absl::Status SessionStore::FlushTier(absl::Time deadline) {
  if (tier_ == nullptr) return absl::OkStatus();
  absl::Status first_error;
  int failed = 0;
  for (const std::shared_ptr<SessionCache>& session : List()) {
    std::lock_guard<std::mutex> lock(session->mutex());
    if (session->gone() || !session->resident()) continue;
    absl::Status status = absl::Now() > deadline ? absl::DeadlineExceededError("the drain's deadline passed")
                                                 : WriteThrough(*session, true);
    absl::StatusOr<TierSession> image = status.ok() ? TierImage(*session, true) : status;
    if (image.ok()) {
      std::shared_ptr<TierRecord> manifest = tier_->PutManifest(*image);
      status = WaitForImage(*tier_, *image, *manifest);
      if (status.ok()) {
        session->manifest_ = std::move(manifest);
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
    return absl::Status(first_error.code(), absl::StrCat(failed, " session(s) not flushed to the spill tier; ",
                                                         first_error.message()));
  }
  return first_error;
}

absl::StatusOr<TierScanReport> SessionStore::LoadTier(absl::Time now) {
  if (tier_ == nullptr) return TierScanReport();
  absl::StatusOr<TierScanReport> report = tier_->Scan();
  if (!report.ok()) return report.status();
  std::vector<TierSession> sessions = std::move(report->sessions);
  report->sessions.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  for (TierSession& image : sessions) {
    if (sessions_.count(image.header.id) != 0) continue;  // its snapshot holds it whole
    SessionConfig config = image.header.config;
    config.pinned = image.pinned;
    auto session = std::make_shared<SessionCache>(image.header.id, image.header.tenant, config, image.header.created);
    session->Touch(now);
    session->manifest_ = image.manifest;
    const std::string id = image.header.id;
    session->demoted_ = std::make_unique<TierSession>(std::move(image));
    if (absl::Status status = Insert(session); !status.ok()) {
      report->damaged.emplace_back(id, status);
      continue;
    }
    ++report->loaded;
  }
  for (const auto& [id, status] : report->damaged) damaged_[id] = absl::StrCat("from the spill tier: ", status.message());
  return report;
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

}  // namespace turbokv
