#include "service/store/session_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "service/store/snapshot.h"
#include "kernels/rotation.h"

namespace turbokv {
namespace {

constexpr size_t kRememberedGone = 65536;

}  // namespace

std::string NewSessionId() {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz234567";
  std::random_device device;  // the kernel's CSPRNG on Linux
  unsigned __int128 bits = 0;
  for (int i = 0; i < 4; ++i) bits = (bits << 32) | device();
  std::string id(26, 'a');
  for (char& c : id) {
    c = kAlphabet[static_cast<unsigned>(bits & 31)];
    bits >>= 5;
  }
  return id;
}

SessionCache::SessionCache(std::string id, std::string tenant, const SessionConfig& config, absl::Time now)
    : id_(std::move(id)), tenant_(std::move(tenant)), config_(config), created_(now), last_used_ns_(absl::ToUnixNanos(now)) {}

size_t SessionCache::bytes_used() const {
  size_t bytes = 0;
  for (const LayerCache& layer : layers_) bytes += layer.bytes();
  return bytes;
}

int64_t SessionCache::tokens() const {
  int64_t tokens = 0;
  for (const LayerCache& layer : layers_) tokens += layer.tokens();
  return tokens;
}

size_t SessionCache::fp16_bytes() const {
  // Keys and values, two bytes a value.
  return static_cast<size_t>(tokens()) * config_.kv_heads * config_.head_dim * 2 * 2;
}

SessionStore::SessionStore(const StoreOptions& options)
    : options_(options), pool_(options.budget_bytes) {}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Build(std::string id, std::string tenant,
                                                                  const SessionConfig& config, absl::Time created) {
  const CodecSpec key_spec{config.key_codec, config.head_dim,
                           DeriveRotationSeed(config.rotation_seed, RotationStream::kKeys)};
  const CodecSpec value_spec{config.value_codec, config.head_dim,
                             DeriveRotationSeed(config.rotation_seed, RotationStream::kValues)};
  absl::StatusOr<std::unique_ptr<Codec>> key_codec = MakeCpuCodec(key_spec);
  if (!key_codec.ok()) return key_codec.status();
  absl::StatusOr<std::unique_ptr<Codec>> value_codec = MakeCpuCodec(value_spec);
  if (!value_codec.ok()) return value_codec.status();
  std::shared_ptr<const Codec> keys = *std::move(key_codec);
  std::shared_ptr<const Codec> values = *std::move(value_codec);
  auto session = std::make_shared<SessionCache>(std::move(id), std::move(tenant), config, created);
  session->layers_.reserve(config.layers);
  for (int l = 0; l < config.layers; ++l) {
    session->layers_.emplace_back(keys, values, config.kv_heads, options_.page_tokens, &pool_);
  }
  return session;
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Create(const SessionConfig& config,
                                                                   const std::string& tenant, absl::Time now) {
  absl::StatusOr<std::shared_ptr<SessionCache>> session = Build(NewSessionId(), tenant, config, now);
  if (!session.ok()) return session.status();
  std::lock_guard<std::mutex> lock(mutex_);
  sessions_.emplace((*session)->id(), *session);
  return session;
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Find(const std::string& id, const std::string& tenant,
                                                                 absl::Time now) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->tenant() != tenant) return NotFound(id, tenant);
  it->second->Touch(now);
  return it->second;
}

absl::Status SessionStore::Delete(const std::string& id, const std::string& tenant) {
  std::shared_ptr<SessionCache> session;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || it->second->tenant() != tenant) return NotFound(id, tenant);
    session = std::move(it->second);
    sessions_.erase(it);
  }
  // Calls in flight on the session finish first; later ones see it gone.
  std::lock_guard<std::mutex> lock(session->mutex());
  session->gone_ = true;
  session->layers_.clear();
  RemoveSnapshot(id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SessionCache>> SessionStore::Fork(const SessionCache& source, int64_t prefix,
                                                            absl::Time now) {
  auto fork = std::make_shared<SessionCache>(NewSessionId(), source.tenant(), source.config(), now);
  fork->layers_.reserve(source.layers().size());
  for (const LayerCache& layer : source.layers()) fork->layers_.push_back(layer.Fork(prefix));
  std::lock_guard<std::mutex> lock(mutex_);
  sessions_.emplace(fork->id(), fork);
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
    snapshot.tokens += session->tokens();
    snapshot.fp16_bytes += static_cast<int64_t>(session->fp16_bytes());
  }
  snapshot.bytes_used = static_cast<int64_t>(pool_.used_bytes());
  snapshot.budget_bytes = static_cast<int64_t>(pool_.budget_bytes());
  snapshot.lru_evictions = lru_evictions_.load();
  snapshot.ttl_expiries = ttl_expiries_.load();
  return snapshot;
}

void SessionStore::RemoveSnapshot(const std::string& id) const {
  if (!options_.snapshot_dir.empty()) unlink((options_.snapshot_dir + "/" + id + kSnapshotSuffix).c_str());
}

absl::StatusOr<SnapshotReport> SessionStore::SaveSnapshots() {
  if (options_.snapshot_dir.empty()) return absl::FailedPreconditionError("turbokvd runs without --snapshot-dir");
  std::lock_guard<std::mutex> saving(save_mutex_);
  SnapshotReport report;
  std::set<std::string> written;
  for (const std::shared_ptr<SessionCache>& session : List()) {
    std::string bytes;
    {
      std::lock_guard<std::mutex> lock(session->mutex());
      if (session->gone()) continue;
      bytes = EncodeSnapshot(*session, options_.page_tokens);
    }
    absl::Status status = WriteFileAtomically(options_.snapshot_dir, session->id() + kSnapshotSuffix, bytes);
    if (!status.ok()) {
      report.failed.emplace_back(session->id(), status);
      continue;
    }
    {
      // Deleted or evicted while its file was being written: it must not
      // come back at the next start.
      std::lock_guard<std::mutex> lock(session->mutex());
      if (session->gone()) {
        RemoveSnapshot(session->id());
        continue;
      }
    }
    written.insert(session->id() + kSnapshotSuffix);
    ++report.sessions;
    report.bytes += static_cast<int64_t>(bytes.size());
  }
  // Snapshots of sessions deleted meanwhile, and leftover temp files, go;
  // damaged snapshots stay for an operator to look at.
  std::set<std::string> keep = written;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, why] : damaged_) keep.insert(id + kSnapshotSuffix);
    for (const auto& [id, session] : sessions_) keep.insert(id + kSnapshotSuffix);
  }
  if (DIR* dir = opendir(options_.snapshot_dir.c_str())) {
    while (dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if ((absl::EndsWith(name, kSnapshotSuffix) || absl::EndsWith(name, std::string(kSnapshotSuffix) + ".tmp")) &&
          keep.count(name) == 0) {
        unlink((options_.snapshot_dir + "/" + name).c_str());
      }
    }
    closedir(dir);
  }
  return report;
}

absl::StatusOr<SnapshotReport> SessionStore::LoadSnapshots(absl::Time now) {
  if (options_.snapshot_dir.empty()) return absl::FailedPreconditionError("turbokvd runs without --snapshot-dir");
  if (mkdir(options_.snapshot_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("cannot create --snapshot-dir ", options_.snapshot_dir, ": ",
                                            std::strerror(errno)));
  }
  DIR* dir = opendir(options_.snapshot_dir.c_str());
  if (dir == nullptr) {
    return absl::InternalError(absl::StrCat("cannot read --snapshot-dir ", options_.snapshot_dir, ": ",
                                            std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* entry = readdir(dir)) {
    if (absl::EndsWith(entry->d_name, kSnapshotSuffix)) names.push_back(entry->d_name);
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  SnapshotReport report;
  for (const std::string& name : names) {
    const std::string id = name.substr(0, name.size() - std::strlen(kSnapshotSuffix));
    std::ifstream in(options_.snapshot_dir + "/" + name, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    const std::string bytes = text.str();
    absl::Status status;
    absl::StatusOr<DecodedSnapshot> decoded = DecodeSnapshot(bytes, options_.page_tokens);
    if (!decoded.ok()) {
      status = decoded.status();
    } else if (decoded->id != id) {
      status = absl::DataLossError(absl::StrCat("the file holds session ", decoded->id));
    }
    std::shared_ptr<SessionCache> session;
    if (status.ok()) {
      absl::StatusOr<std::shared_ptr<SessionCache>> built =
          Build(decoded->id, decoded->tenant, decoded->config, decoded->created);
      status = built.status();
      if (built.ok()) session = *std::move(built);
      for (size_t l = 0; status.ok() && l < decoded->tokens.size(); ++l) {
        status = session->layers_[l].LoadPages(decoded->tokens[l], decoded->pages[l]);
      }
    }
    if (!status.ok()) {
      report.failed.emplace_back(id, status);
      std::lock_guard<std::mutex> lock(mutex_);
      damaged_[id] = std::string(status.message());  // kept on disk, answered with DATA_LOSS
      continue;
    }
    session->Touch(now);
    ++report.sessions;
    report.bytes += static_cast<int64_t>(bytes.size());
    std::lock_guard<std::mutex> lock(mutex_);
    sessions_.emplace(id, std::move(session));
  }
  return report;
}

size_t SessionStore::session_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sessions_.size();
}

absl::Status SessionStore::NotFound(const std::string& id, const std::string& tenant) const {
  auto damaged = damaged_.find(id);
  if (damaged != damaged_.end()) {
    return absl::DataLossError(absl::StrCat("session ", id, " could not be restored from its snapshot: ", damaged->second));
  }
  auto gone = gone_reasons_.find(id);
  if (gone != gone_reasons_.end() && gone->second.first == tenant) {
    return absl::NotFoundError(absl::StrCat("session ", id, " was ", gone->second.second));
  }
  return absl::NotFoundError(absl::StrCat("no session ", id));
}

void SessionStore::RememberGone(const SessionCache& session, std::string reason, std::atomic<int64_t>* counter) {
  const std::string& id = session.id();
  gone_reasons_[id] = {session.tenant(), std::move(reason)};
  gone_order_.push_back(id);
  RemoveSnapshot(id);
  sessions_.erase(id);
  if (gone_order_.size() > kRememberedGone) {
    gone_reasons_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  counter->fetch_add(1);
}

absl::Status SessionStore::MakeRoom(size_t bytes, absl::Span<const SessionCache* const> held) {
  auto fits = [&] { return bytes <= pool_.budget_bytes() && pool_.used_bytes() <= pool_.budget_bytes() - bytes; };
  if (fits()) return absl::OkStatus();
  if (options_.eviction == EvictionPolicy::kLru) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<SessionCache>> candidates;
    for (const auto& [id, session] : sessions_) {
      if (std::find(held.begin(), held.end(), session.get()) == held.end()) candidates.push_back(session);
    }
    std::sort(candidates.begin(), candidates.end(),
              [](const auto& a, const auto& b) { return a->last_used() < b->last_used(); });
    for (const std::shared_ptr<SessionCache>& victim : candidates) {
      if (fits()) break;
      // A session with a call in flight is not idle: skip it.
      std::unique_lock<std::mutex> victim_lock(victim->mutex(), std::try_to_lock);
      if (!victim_lock.owns_lock()) continue;
      victim->gone_ = true;
      victim->layers_.clear();
      RememberGone(*victim, "evicted (least recently used) to make room in the memory budget", &lru_evictions_);
    }
  }
  if (fits()) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("memory budget exceeded: ", pool_.used_bytes(),
                                                   " bytes used, ", bytes, " needed, budget ",
                                                   pool_.budget_bytes(), " bytes"));
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
    if (!session_lock.owns_lock()) continue;  // in use: not idle
    session->gone_ = true;
    session->layers_.clear();
    RememberGone(*session, absl::StrCat("expired after ", absl::FormatDuration(session->config().idle_ttl), " idle"),
                 &ttl_expiries_);
    ++count;
  }
  return count;
}

}  // namespace turbokv
