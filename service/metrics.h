// The daemon's Prometheus metrics: one registry, every family built once at
// start-up (docs/ARCHITECTURE.md, "The daemon"). Names start with turbokv_, use base units
// (bytes, seconds) and end in _total for counters; no label carries a session
// id. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "service/store/session_store.h"

namespace prometheus {
class Collectable;
class Registry;
class Counter;
class Gauge;
template <typename T>
class Family;
class Histogram;
}  // namespace prometheus

namespace turbokv {

// encode: appended tokens rotated and quantized into pages; attend: the
// attention kernels; decode: ReadKv's pages decoded back to floats.
enum class KernelOp { kEncode, kAttend, kDecode };
enum class KvKind { kKey, kValue };

class Metrics {
 public:
  // device: the label of the memory and kernel series, e.g. "cpu"; tiers:
  // where demoted sessions are, top first (Tier::Parts): "disk", "redis",
  // or both stacked ("redis" also gets turbokv_tier_up and
  // turbokv_takeovers_total); none without a tier. tenants: those the
  // daemon knows from the start ("" without --auth-tokens-file, else every
  // tenant of the file), whose series are exported at 0 before their first
  // session. Every method's turbokv_rpc_errors_total is exported from the
  // start too, at 0: code INTERNAL on the server side and INVALID_ARGUMENT
  // on the client side, so that sums and rates of it are 0, not absent,
  // before the first error.
  explicit Metrics(std::string device, const std::vector<std::string>& tiers = {"disk"},
                   const std::vector<std::string>& tenants = {""});
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // The process_* metrics (resident and virtual memory, CPU time, start
  // time, open and most file descriptors), read from /proc at each scrape.
  std::shared_ptr<prometheus::Collectable> process() const { return process_; }

  // One RPC, or one message of a stream, finished with `status`: its
  // duration by method and code, and a failure also by side (ErrorSide).
  void ObserveRpc(absl::string_view method, const absl::Status& status, double seconds);
  // A call of `method` (a KvCacheService method name) began, or ended:
  // turbokv_inflight_calls.
  void CallStarted(absl::string_view method);
  void CallEnded(absl::string_view method);
  void AddAppendedTokens(int64_t tokens);
  void AddAttendedQueries(int64_t queries);
  // A CreateSession with prefix_blocks: the tokens per layer it started
  // with (0: no stored prefix found).
  void CountPrefixLookup(int64_t tokens);
  void ObserveKernel(KernelOp op, double seconds);
  // One Decode message of `items` sessions, and each item of one that failed.
  void ObserveDecodeBatch(int64_t items);
  void AddDecodeItemFailure(absl::StatusCode code);
  // From one thread (the server's housekeeping loop).
  void SetStore(const StoreSnapshot& snapshot);
  // What the start loaded from the snapshot dir.
  void SetRestored(const SnapshotReport& report);
  // Work waiting in the executor's queue.
  void SetQueued(int64_t work);
  // Requests and replies in flight (KvCacheService::in_flight_bytes).
  void SetInFlightBytes(int64_t bytes);
  void SetSharedMemoryRegions(size_t regions, size_t bytes);
  // Bytes of KV event batches kept for replay (KvEventPublisher::kept_bytes).
  void SetKvEventsBufferBytes(size_t bytes);
  // The shared-memory listener's refusals so far (SharedMemoryRefusals),
  // from SetStore's thread.
  void SetSharedMemoryRefusals(int64_t descriptors, int64_t limits, int64_t timeouts);
  // A demoted session brought back into memory by a call.
  void ObservePromotion(double seconds);
  // How a claim from the shared tier ended (StoreOptions::on_takeover).
  void CountTakeover(TakeoverResult result);
  // The quantization error of vectors just stored with `codec` as keys or
  // values, as their encoder measured it.
  void ObserveQuantization(CodecKind codec, KvKind kind, const EncodeStats& stats);

 private:
  const std::string device_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_;
  prometheus::Family<prometheus::Counter>* rpc_errors_;
  // The series of each (method, code) seen, made once: a family's Add builds
  // a new metric object before it looks the labels up.
  struct RpcSeries {
    prometheus::Histogram* duration = nullptr;
    prometheus::Counter* errors[2] = {};  // client, server; only for codes other than OK
  };
  std::mutex rpc_mutex_;
  std::map<std::pair<std::string, absl::StatusCode>, RpcSeries> rpc_series_;
  // One series per method of the service, made at start (read-only after).
  std::map<std::string, prometheus::Gauge*, std::less<>> inflight_;
  // Per tenant (of --auth-tokens-file; "" without), under SetStore's single caller.
  prometheus::Family<prometheus::Gauge>* tenant_sessions_;
  prometheus::Family<prometheus::Gauge>* tenant_bytes_;
  std::map<std::string, std::pair<prometheus::Gauge*, prometheus::Gauge*>> tenants_;
  std::set<std::string> known_tenants_;  // kept at 0 without sessions (read-only after start)
  prometheus::Counter* appended_tokens_;
  prometheus::Counter* attended_queries_;
  prometheus::Counter* prefix_lookups_[2] = {};  // miss, hit
  prometheus::Counter* prefix_reused_tokens_;
  prometheus::Gauge* prefix_blocks_;
  prometheus::Histogram* kernel_duration_[3] = {};  // by KernelOp
  prometheus::Histogram* decode_batch_size_;
  // The canonical codes, OK (0) to UNAUTHENTICATED (16); index 0 unused.
  static constexpr int kStatusCodes = 17;
  prometheus::Counter* decode_item_failures_[kStatusCodes] = {};
  prometheus::Gauge* restored_[3] = {};  // verified, unverified, failed
  prometheus::Gauge* queued_;
  prometheus::Gauge* in_flight_bytes_;
  prometheus::Gauge* shared_memory_regions_;
  prometheus::Gauge* shared_memory_bytes_;
  prometheus::Gauge* kv_events_buffer_bytes_;
  prometheus::Counter* shared_memory_refused_[3] = {};  // descriptors, limits, timeouts
  int64_t shared_memory_refused_seen_[3] = {};         // under SetStore's single caller
  prometheus::Gauge* sessions_;
  prometheus::Gauge* tokens_;
  prometheus::Gauge* bytes_used_;
  prometheus::Gauge* budget_bytes_;
  prometheus::Gauge* fp16_bytes_;
  prometheus::Gauge* compression_ratio_;
  prometheus::Counter* lru_evictions_;
  prometheus::Counter* ttl_expiries_;
  prometheus::Counter* disk_drops_;
  prometheus::Gauge* memory_sessions_ = nullptr;  // turbokv_tier_sessions{tier="memory"}
  prometheus::Gauge* tier_up_ = nullptr;      // a shared tier only
  prometheus::Counter* tier_rewrites_ = nullptr;  // a shared tier only
  prometheus::Counter* takeovers_[kTakeoverResults] = {};
  prometheus::Gauge* spill_bytes_;
  prometheus::Gauge* spill_file_bytes_;
  prometheus::Gauge* spill_budget_bytes_;
  prometheus::Gauge* spill_queued_bytes_;
  prometheus::Counter* demotions_;
  prometheus::Counter* promotions_;
  prometheus::Counter* spill_write_errors_;
  prometheus::Counter* spill_crc_failures_;
  // The same, by tier (turbokv_tier_*{tier}, in the order of
  // StoreSnapshot::tier_parts); the spill names, which show the top tier,
  // go after 0.5.
  struct TierSeries {
    prometheus::Gauge* sessions = nullptr;  // demoted: on every tier of a stack
    prometheus::Gauge* live_bytes = nullptr;
    prometheus::Gauge* stored_bytes = nullptr;
    prometheus::Gauge* budget_bytes = nullptr;
    prometheus::Gauge* queued_bytes = nullptr;
    prometheus::Counter* write_errors = nullptr;
    prometheus::Counter* crc_failures = nullptr;
    int64_t write_errors_seen = 0;  // under SetStore's single caller
    int64_t crc_failures_seen = 0;
  };
  std::vector<TierSeries> tiers_;
  prometheus::Histogram* promotion_duration_;
  // By codec (CodecKind's value, 1 to 6) and kind (key, value).
  struct QuantizationSeries {
    prometheus::Histogram* error = nullptr;
    prometheus::Counter* fp16_fields = nullptr;
    prometheus::Counter* saturated = nullptr;
    prometheus::Counter* underflowed = nullptr;
  };
  QuantizationSeries quantization_[7][2] = {};
  // Totals already counted, under SetStore's single caller.
  int64_t lru_seen_ = 0;
  int64_t ttl_seen_ = 0;
  int64_t disk_drops_seen_ = 0;
  int64_t demotions_seen_ = 0;
  int64_t promotions_seen_ = 0;
  int64_t write_errors_seen_ = 0;
  int64_t crc_failures_seen_ = 0;
  int64_t rewrites_seen_ = 0;
};

}  // namespace turbokv
