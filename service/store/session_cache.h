// One session in the store: its id, tenant and configuration, its layers
// (LayerCache) while resident, its state on the tier below memory
// (Residency's), and the lock every call on it takes. SessionStore owns them;
// snapshots read and fill them. No gRPC types.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/codec.h"
#include "service/records/session_config.h"
#include "service/store/layer_cache.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

class SessionCache {
 public:
  // tenant: who created it (empty without --auth-tokens-file); only calls
  // from the same tenant find it.
  SessionCache(std::string id, std::string tenant, const SessionConfig& config, absl::Time now);
  ~SessionCache();

  const std::string& id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  const SessionConfig& config() const { return config_; }
  absl::Time created() const { return created_; }
  absl::Time last_used() const { return absl::FromUnixNanos(last_used_ns_.load()); }
  void Touch(absl::Time now) { last_used_ns_.store(absl::ToUnixNanos(now)); }

  // Serializes every call on the session. Holders check gone() first.
  std::mutex& mutex() { return mutex_; }
  // Set (under mutex()) when the session is deleted or evicted; its layers
  // are then empty and every call answers NOT_FOUND.
  bool gone() const { return gone_; }
  std::vector<LayerCache>& layers() { return layers_; }
  const std::vector<LayerCache>& layers() const { return layers_; }

  // Under mutex(): false while the session is on the spill tier only
  // (demoted): its layers are then empty and calls promote it first.
  bool resident() const { return tier_.demoted == nullptr; }
  // Whether a call that spans several messages (a ReadKv stream) is open on
  // it, its lock released between them (SessionInCall): it is in a call
  // then, and neither demoted, evicted nor expired.
  bool in_call() const { return calls_between_messages_.load() > 0; }
  // Under mutex(): whether it is on the spill tier (its manifest, and its
  // sealed pages as they are written through).
  bool on_tier() const { return tier_.manifest != nullptr; }
  // Under mutex(): bytes of the pages held in memory (shared pages
  // included) and what the same tokens take in fp16.
  size_t bytes_used() const;
  size_t fp16_bytes() const;
  int64_t tokens() const;  // summed over layers, wherever they are
  int64_t layer_tokens(int layer) const;
  // Layers whose keys are stored through a fitted transform, wherever they are.
  int transformed_layers() const;
  // Under mutex(): the quantization error of the keys and of the values
  // stored in each layer, as their encoder measured it (EncodeStats): every
  // vector appended while the session was in this daemon (a fork starts with
  // its source's; not lowered by truncate; not kept in snapshots or on the
  // spill tier's disk, so zero again after a restart).
  struct LayerErrors {
    EncodeStats keys;
    EncodeStats values;
  };
  std::vector<LayerErrors>& errors() { return errors_; }
  const std::vector<LayerErrors>& errors() const { return errors_; }

 private:
  friend class SessionStore;
  friend class Residency;

  const std::string id_;
  const std::string tenant_;
  const SessionConfig config_;
  const absl::Time created_;
  std::atomic<int64_t> last_used_ns_;
  std::atomic<int> calls_between_messages_{0};
  friend class SessionInCall;
  std::mutex mutex_;
  bool gone_ = false;
  std::vector<LayerCache> layers_;
  std::vector<LayerErrors> errors_;  // per layer
  // SessionMetadataBytes held in the budget: its own part, and the part
  // its forks share (SessionSharedMetadataBytes), held by each of them.
  std::shared_ptr<const void> charge_;
  std::shared_ptr<const void> shared_charge_;
  // Its state on the tier below memory: Residency's alone.
  struct TierState {
    std::unique_ptr<TierSession> demoted;  // while demoted: its layers on the tier
    std::shared_ptr<TierRecord> manifest;  // its latest manifest on the tier
    // Per layer: the LayerCache::extras_version() of its latest manifest (a
    // sealed page that depends on a later one waits for a new manifest).
    std::vector<uint64_t> manifest_extras;
    // A tier that holds every append lost the session's records and its
    // manifest since lacks the tails: the next write sends one that has them.
    bool manifest_lacks_tails = false;
    // Records of pages a refused append or a truncation dropped, kept until
    // a manifest without them is queued (their deletes go after it).
    std::vector<std::shared_ptr<TierRecord>> kept_records;
  };
  TierState tier_;

  // Under mutex(): its layers go and their memory and its metadata's charge
  // go back to the budget (evicted, deleted, demoted).
  void ReleaseMemory();
};

// What a session's metadata (its object, layer tables and codecs, and each
// layer's sink page and transform) costs in memory outside its pages:
// charged to the budget like pages.
size_t SessionMetadataBytes(const SessionConfig& config);
// The part of it that forks share, as they share pages: the codecs and each
// layer's sink page and transform (SessionCache's shared charge).
size_t SessionSharedMetadataBytes(const SessionConfig& config);

// Marks a session in a call for the life of a call that releases its lock
// between messages (SessionCache::in_call()).
class SessionInCall {
 public:
  explicit SessionInCall(std::shared_ptr<SessionCache> session) : session_(std::move(session)) {
    session_->calls_between_messages_.fetch_add(1);
  }
  ~SessionInCall() { session_->calls_between_messages_.fetch_sub(1); }
  SessionInCall(const SessionInCall&) = delete;
  SessionInCall& operator=(const SessionInCall&) = delete;

 private:
  const std::shared_ptr<SessionCache> session_;
};

}  // namespace turbokv
