#include "service/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/cpu/cpu_codecs.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "service/error_side.h"
#include "service/text_file.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {
namespace {

// 50 us to about 13 s, a factor of 2 apart: decode steps on a GPU to long
// prefill chunks on a CPU.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double b = 50e-6; b < 15; b *= 2) buckets.push_back(b);
  return buckets;
}

constexpr CodecKind kAllCodecs[] = {CodecKind::kF16,    CodecKind::kQ8_0,   CodecKind::kQ4_0,
                                    CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4};

// The mean relative error of `codec` on 256 Gaussian vectors of d = 128
// (fixed seed): what well-behaved data costs it.
double TypicalRelativeError(CodecKind codec) {
  constexpr int kVectors = 256, kDim = 128;
  std::mt19937_64 random(1);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(kVectors) * kDim);
  for (float& v : x) v = normal(random);
  absl::StatusOr<std::unique_ptr<Codec>> made = MakeCpuCodec(CodecSpec{codec, kDim, 1});
  if (!made.ok()) return 0;
  std::vector<uint8_t> codes(kVectors * (*made)->code_size());
  EncodeStats stats;
  (*made)->Encode(kVectors, x.data(), codes.data(), &stats);
  return stats.mean_error();
}

// The process_* metrics of the Prometheus client conventions, from /proc.
class ProcessCollector : public prometheus::Collectable {
 public:
  ProcessCollector() : ticks_(static_cast<double>(sysconf(_SC_CLK_TCK))), page_(static_cast<double>(sysconf(_SC_PAGESIZE))) {
    // btime: the boot time, in seconds since the epoch.
    for (absl::string_view line : absl::StrSplit(ReadTextFile("/proc/stat").value_or(""), '\n')) {
      if (absl::ConsumePrefix(&line, "btime ") && !absl::SimpleAtod(line, &boot_time_)) boot_time_ = 0;
    }
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    // /proc/self/stat: "PID (COMM) STATE ..."; COMM may hold spaces, so the
    // fields are counted from after its closing parenthesis: STATE is field 3.
    const std::string stat = ReadTextFile("/proc/self/stat").value_or("");
    std::vector<std::string> fields;
    if (const size_t close = stat.rfind(')'); close != std::string::npos) {
      fields = absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
    }
    auto field = [&](int number) {  // number as in proc(5)
      double value = 0;
      const size_t index = static_cast<size_t>(number - 3);
      if (index < fields.size() && !absl::SimpleAtod(fields[index], &value)) value = 0;
      return value;
    };
    int open_fds = 0;
    if (DIR* dir = opendir("/proc/self/fd"); dir != nullptr) {
      while (const dirent* entry = readdir(dir)) {
        if (entry->d_name[0] != '.') ++open_fds;
      }
      closedir(dir);
      --open_fds;  // the one opendir holds
    }
    rlimit files{};
    getrlimit(RLIMIT_NOFILE, &files);
    std::vector<prometheus::MetricFamily> families;
    auto add = [&](const char* name, const char* help, prometheus::MetricType type, double value) {
      prometheus::MetricFamily family;
      family.name = name;
      family.help = help;
      family.type = type;
      prometheus::ClientMetric metric;
      (type == prometheus::MetricType::Counter ? metric.counter.value : metric.gauge.value) = value;
      family.metric.push_back(metric);
      families.push_back(std::move(family));
    };
    using prometheus::MetricType;
    add("process_cpu_seconds_total", "User and system CPU time spent, in seconds", MetricType::Counter,
        (field(14) + field(15)) / ticks_);
    add("process_start_time_seconds", "Start time of the process since the epoch, in seconds", MetricType::Gauge,
        boot_time_ + field(22) / ticks_);
    add("process_virtual_memory_bytes", "Virtual memory size in bytes", MetricType::Gauge, field(23));
    add("process_resident_memory_bytes", "Resident memory size in bytes", MetricType::Gauge, field(24) * page_);
    add("process_open_fds", "Open file descriptors", MetricType::Gauge, open_fds);
    add("process_max_fds", "Most open file descriptors (RLIMIT_NOFILE)", MetricType::Gauge,
        files.rlim_cur == RLIM_INFINITY ? -1.0 : static_cast<double>(files.rlim_cur));
    return families;
  }

 private:
  const double ticks_;
  const double page_;
  double boot_time_ = 0;
};

}  // namespace

Metrics::Metrics(std::string device, const std::vector<std::string>& tiers, const std::vector<std::string>& tenants)
    : device_(std::move(device)), registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  prometheus::Registry& r = *registry_;
  auto counter_family = [&](const char* name, const char* help) -> prometheus::Family<prometheus::Counter>& {
    return BuildCounter().Name(name).Help(help).Register(r);
  };
  rpc_duration_ = &BuildHistogram()
                       .Name("turbokv_rpc_duration_seconds")
                       .Help("Time to serve an RPC, or one message of an Append, Attend or Decode stream, by method and gRPC status code")
                       .Register(r);
  rpc_errors_ = &BuildCounter()
                     .Name("turbokv_rpc_errors_total")
                     .Help("RPCs and stream messages that failed, by method, gRPC status code and side: client (the "
                           "request, or a limit of the caller's own) or server (the daemon's fault or capacity)")
                     .Register(r);
  auto& inflight = BuildGauge()
                       .Name("turbokv_inflight_calls")
                       .Help("Calls in progress, streams counted while open, by method")
                       .Register(r);
  const google::protobuf::ServiceDescriptor* service =
      v1::CreateSessionRequest::descriptor()->file()->FindServiceByName("KvCacheService");
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string& name = service->method(i)->name();
    inflight_.emplace(name, &inflight.Add({{"method", name}}));
    rpc_errors_->Add({{"method", name}, {"code", "INTERNAL"}, {"side", "server"}});
    rpc_errors_->Add({{"method", name}, {"code", "INVALID_ARGUMENT"}, {"side", "client"}});
  }
  BuildGauge()
      .Name("turbokv_build_info")
      .Help("Always 1: the daemon's version, the SIMD target its CPU kernels run, and its device")
      .Register(r)
      .Add({{"version", TURBOKV_VERSION}, {"simd", ChosenSimdTarget()}, {"device", device_}})
      .Set(1);
  tenant_sessions_ = &BuildGauge()
                          .Name("turbokv_tenant_sessions")
                          .Help("Sessions held per tenant (tenant=\"\" without --auth-tokens-file)")
                          .Register(r);
  tenant_bytes_ = &BuildGauge()
                       .Name("turbokv_tenant_memory_bytes")
                       .Help("Bytes of pages in memory per tenant (a page its forks share counted for each)")
                       .Register(r);
  known_tenants_.insert(tenants.begin(), tenants.end());
  for (const std::string& tenant : known_tenants_) {
    tenants_[tenant] = {&tenant_sessions_->Add({{"tenant", tenant}}), &tenant_bytes_->Add({{"tenant", tenant}})};
  }
  process_ = std::make_shared<ProcessCollector>();
  appended_tokens_ = &BuildCounter()
                          .Name("turbokv_appended_tokens_total")
                          .Help("Token-layers newly stored by Append, Step and Decode (repeats not counted)")
                          .Register(r)
                          .Add({});
  attended_queries_ = &BuildCounter()
                           .Name("turbokv_attended_queries_total")
                           .Help("Queries answered by Attend, Step and Decode")
                           .Register(r)
                           .Add({});
  auto& lookups = BuildCounter()
                      .Name("turbokv_prefix_lookups_total")
                      .Help("CreateSession calls with prefix_blocks, by whether a stored prefix was found")
                      .Register(r);
  prefix_lookups_[0] = &lookups.Add({{"result", "miss"}});
  prefix_lookups_[1] = &lookups.Add({{"result", "hit"}});
  prefix_reused_tokens_ = &BuildCounter()
                               .Name("turbokv_prefix_reused_tokens_total")
                               .Help("Tokens per layer that new sessions started with from stored prefixes")
                               .Register(r)
                               .Add({});
  prefix_blocks_ = &BuildGauge()
                        .Name("turbokv_prefix_blocks")
                        .Help("Distinct blocks named for reuse that some session holds")
                        .Register(r)
                        .Add({});
  auto& kernel = BuildHistogram()
                     .Name("turbokv_kernel_duration_seconds")
                     .Help("Time in the compute kernels per call, by operation and device")
                     .Register(r);
  kernel_duration_[static_cast<int>(KernelOp::kEncode)] =
      &kernel.Add({{"op", "encode"}, {"device", device_}}, LatencyBuckets());
  kernel_duration_[static_cast<int>(KernelOp::kAttend)] =
      &kernel.Add({{"op", "attend"}, {"device", device_}}, LatencyBuckets());
  kernel_duration_[static_cast<int>(KernelOp::kDecode)] =
      &kernel.Add({{"op", "decode"}, {"device", device_}}, LatencyBuckets());
  prometheus::Histogram::BucketBoundaries batch_buckets;
  for (double b = 1; b <= 4096; b *= 2) batch_buckets.push_back(b);
  decode_batch_size_ = &BuildHistogram()
                            .Name("turbokv_decode_batch_sessions")
                            .Help("Sessions per Decode message")
                            .Register(r)
                            .Add({}, batch_buckets);
  // Every code's series exists from the start (at 0), so rates and alerts
  // see them before the first failure.
  auto& decode_failures = BuildCounter()
                              .Name("turbokv_decode_item_failures_total")
                              .Help("Items of Decode messages that failed alone, by gRPC status code")
                              .Register(r);
  for (int code = 1; code < kStatusCodes; ++code) {
    decode_item_failures_[code] =
        &decode_failures.Add({{"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
  }
  sessions_ = &BuildGauge().Name("turbokv_sessions").Help("Sessions held").Register(r).Add({});
  auto& restored = BuildGauge()
                       .Name("turbokv_snapshot_restored_sessions")
                       .Help("Sessions the start found in --snapshot-dir: verified (the MANIFEST of a finished drain "
                             "lists their file), unverified (no MANIFEST: may be older than their last state), "
                             "failed (answered DATA_LOSS)")
                       .Register(r);
  restored_[0] = &restored.Add({{"state", "verified"}});
  restored_[1] = &restored.Add({{"state", "unverified"}});
  restored_[2] = &restored.Add({{"state", "failed"}});
  queued_ = &BuildGauge()
                 .Name("turbokv_executor_queued")
                 .Help("Work waiting for a worker (or for its session to be free)")
                 .Register(r)
                 .Add({});
  in_flight_bytes_ = &BuildGauge()
                          .Name("turbokv_inflight_bytes")
                          .Help("Bytes of requests and replies in flight (a reply counted from its request's "
                                "admission until its client takes it), over tenants; "
                                "--tenant-max-inflight-bytes bounds each tenant's")
                          .Register(r)
                          .Add({});
  shared_memory_regions_ = &BuildGauge()
                                .Name("turbokv_shared_memory_regions")
                                .Help("Shared-memory regions co-located clients have registered (one a client "
                                      "connected over a unix socket that uses them)")
                                .Register(r)
                                .Add({});
  shared_memory_bytes_ = &BuildGauge()
                              .Name("turbokv_shared_memory_bytes")
                              .Help("Bytes of the shared-memory regions registered: client memory the daemon maps "
                                    "and writes results into (its resident memory counts the pages it touched, as "
                                    "RssShmem), each region at most --shared-memory-max-bytes")
                              .Register(r)
                              .Add({});
  kv_events_buffer_bytes_ = &BuildGauge()
                                 .Name("turbokv_kv_events_buffer_bytes")
                                 .Help("Bytes of KV event batches kept for replay (--kv-events-buffer-bytes bounds "
                                       "them; 0 without --kv-events-endpoint)")
                                 .Register(r)
                                 .Add({});
  auto& refused = BuildCounter()
                      .Name("turbokv_shared_memory_refused_connections_total")
                      .Help("Connections the shared-memory socket turned away: descriptors (the process was out of "
                            "file descriptors; accepting rests 100 ms), limits (too many open, or waiting to "
                            "register: closed with the reason), timeout (not registered in time: closed)")
                      .Register(r);
  const char* reasons[3] = {"descriptors", "limits", "timeout"};
  for (int i = 0; i < 3; ++i) shared_memory_refused_[i] = &refused.Add({{"reason", reasons[i]}});
  tokens_ = &BuildGauge()
                 .Name("turbokv_tokens_stored")
                 .Help("Tokens stored, summed over sessions and layers")
                 .Register(r)
                 .Add({});
  auto device_gauge = [&](const char* name, const char* help) {
    return &BuildGauge().Name(name).Help(help).Register(r).Add({{"device", device_}});
  };
  bytes_used_ = device_gauge("turbokv_memory_used_bytes", "Bytes of compressed pages held, shared pages once, by device");
  budget_bytes_ = device_gauge("turbokv_memory_budget_bytes", "--memory-budget, by device");
  fp16_bytes_ = device_gauge("turbokv_memory_fp16_equivalent_bytes",
                             "What the tokens of the sessions in memory would take as an fp16 cache, by device");
  compression_ratio_ = &BuildGauge()
                            .Name("turbokv_compression_ratio")
                            .Help("Over the sessions in memory: their fp16-equivalent bytes over the bytes they use")
                            .Register(r)
                            .Add({});
  auto& evictions = BuildCounter()
                        .Name("turbokv_evictions_total")
                        .Help("Sessions removed by the daemon, by reason: lru (the memory budget was full), ttl (idle past "
                              "their ttl) or disk_full (dropped from the spill tier, oldest first, "
                              "once it passed its high watermark)")
                        .Register(r);
  lru_evictions_ = &evictions.Add({{"reason", "lru"}});
  ttl_expiries_ = &evictions.Add({{"reason", "ttl"}});
  disk_drops_ = &evictions.Add({{"reason", "disk_full"}});
  auto& tier_sessions = BuildGauge()
                            .Name("turbokv_tier_sessions")
                            .Help("Sessions by where their pages are: memory (resident), or disk or redis (demoted "
                                  "to --spill-dir or --redis-url; with both, on each)")
                            .Register(r);
  memory_sessions_ = &tier_sessions.Add({{"tier", "memory"}});
  tiers_.resize(tiers.size());
  for (size_t i = 0; i < tiers.size(); ++i) tiers_[i].sessions = &tier_sessions.Add({{"tier", tiers[i]}});
  if (std::find(tiers.begin(), tiers.end(), "redis") != tiers.end()) {
    tier_up_ = &BuildGauge()
                    .Name("turbokv_tier_up")
                    .Help("1 while the shared tier answers, 0 while it does not (writes then wait in the queue)")
                    .Register(r)
                    .Add({{"tier", "redis"}});
    tier_rewrites_ = &BuildCounter()
                          .Name("turbokv_tier_rewrites_total")
                          .Help("Sessions written to the shared tier again because it lost their records (Redis "
                                "restarted without its append-only file, or from an older one)")
                          .Register(r)
                          .Add({{"tier", "redis"}});
    auto& takeovers = BuildCounter()
                          .Name("turbokv_takeovers_total")
                          .Help("Calls naming a session this daemon did not hold, by how its claim from the shared "
                                "tier ended: ok, not_found (in no tier), held (by another daemon), unavailable (the "
                                "tier did not answer, or its records were damaged)")
                          .Register(r);
    const char* results[kTakeoverResults] = {"ok", "not_found", "held", "unavailable"};
    for (int i = 0; i < kTakeoverResults; ++i) takeovers_[i] = &takeovers.Add({{"result", results[i]}});
  }
  auto gauge = [&](const char* name, const char* help) { return &BuildGauge().Name(name).Help(help).Register(r).Add({}); };
  auto counter = [&](const char* name, const char* help) {
    return &BuildCounter().Name(name).Help(help).Register(r).Add({});
  };
  auto& live = BuildGauge().Name("turbokv_tier_live_bytes").Help("Bytes of live records on the tier below memory").Register(r);
  auto& stored = BuildGauge()
                     .Name("turbokv_tier_stored_bytes")
                     .Help("Bytes the tier below memory holds: live records and dead ones not yet reclaimed (the disk "
                           "tier's segment files)")
                     .Register(r);
  auto& budget = BuildGauge().Name("turbokv_tier_budget_bytes").Help("--spill-budget or --redis-budget").Register(r);
  auto& queued = BuildGauge().Name("turbokv_tier_queued_bytes").Help("Bytes waiting for the tier's writer").Register(r);
  auto& write_errors =
      BuildCounter().Name("turbokv_tier_write_errors_total").Help("Records the tier's writer could not write").Register(r);
  auto& crc_failures = BuildCounter()
                           .Name("turbokv_tier_crc_failures_total")
                           .Help("Records of the tier that failed their CRC when read (at start or on promotion)")
                           .Register(r);
  for (size_t i = 0; i < tiers.size(); ++i) {
    const std::map<std::string, std::string> label = {{"tier", tiers[i]}};
    TierSeries& t = tiers_[i];
    t.live_bytes = &live.Add(label);
    t.stored_bytes = &stored.Add(label);
    t.budget_bytes = &budget.Add(label);
    t.queued_bytes = &queued.Add(label);
    t.write_errors = &write_errors.Add(label);
    t.crc_failures = &crc_failures.Add(label);
  }
  spill_bytes_ = gauge("turbokv_spill_bytes", "Deprecated (goes after 0.5): turbokv_tier_live_bytes");
  spill_file_bytes_ = gauge("turbokv_spill_file_bytes", "Deprecated (goes after 0.5): turbokv_tier_stored_bytes");
  spill_budget_bytes_ = gauge("turbokv_spill_budget_bytes", "Deprecated (goes after 0.5): turbokv_tier_budget_bytes");
  spill_queued_bytes_ = gauge("turbokv_spill_queued_bytes", "Deprecated (goes after 0.5): turbokv_tier_queued_bytes");
  demotions_ = counter("turbokv_demotions_total", "Sessions demoted from memory to the spill tier");
  promotions_ = counter("turbokv_promotions_total", "Sessions brought back from the spill tier into memory");
  spill_write_errors_ = counter("turbokv_spill_write_errors_total",
                                "Deprecated (goes after 0.5): turbokv_tier_write_errors_total");
  spill_crc_failures_ = counter("turbokv_spill_crc_failures_total",
                                "Deprecated (goes after 0.5): turbokv_tier_crc_failures_total");
  promotion_duration_ = &BuildHistogram()
                             .Name("turbokv_promotion_duration_seconds")
                             .Help("Time to bring a demoted session back into memory")
                             .Register(r)
                             .Add({}, LatencyBuckets());
  auto& error = BuildHistogram()
                    .Name("turbokv_quantization_relative_error")
                    .Help("Relative error ||x - decoded|| / ||x|| of each key and value vector stored, as its encoder "
                          "measured it, by codec and kind")
                    .Register(r);
  auto& fields = counter_family("turbokv_quantization_fp16_fields_total",
                                "fp16 block scales (every value for f16) written, by codec and kind");
  auto& saturated = counter_family("turbokv_quantization_fp16_saturated_total",
                                   "fp16 fields whose value was past +-65504 and was stored as +-65504");
  auto& underflowed = counter_family("turbokv_quantization_fp16_underflowed_total",
                                     "fp16 fields whose nonzero value was stored as zero or subnormal (below 2^-14)");
  auto& typical = BuildGauge()
                      .Name("turbokv_quantization_typical_relative_error")
                      .Help("Mean relative error of each codec on Gaussian vectors (d = 128), measured at start: "
                            "the yardstick of turbokv_quantization_relative_error")
                      .Register(r);
  const prometheus::Histogram::BucketBoundaries bounds(std::begin(kEncodeErrorBounds),
                                                       std::end(kEncodeErrorBounds) - 1);  // without +Inf
  for (CodecKind codec : kAllCodecs) {
    typical.Add({{"codec", CodecName(codec)}}).Set(TypicalRelativeError(codec));
    for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
      const prometheus::Labels labels = {{"codec", CodecName(codec)}, {"kind", kind == KvKind::kKey ? "key" : "value"}};
      QuantizationSeries& series = quantization_[static_cast<int>(codec)][static_cast<int>(kind)];
      series.error = &error.Add(labels, bounds);
      series.fp16_fields = &fields.Add(labels);
      series.saturated = &saturated.Add(labels);
      series.underflowed = &underflowed.Add(labels);
    }
  }
}

Metrics::~Metrics() = default;

void Metrics::ObserveRpc(absl::string_view method, const absl::Status& status, double seconds) {
  const absl::StatusCode code = status.code();
  const ErrorSide side = SideOf(status);
  RpcSeries series;
  {
    std::lock_guard<std::mutex> lock(rpc_mutex_);
    RpcSeries& slot = rpc_series_[{std::string(method), code}];
    if (slot.duration == nullptr) {
      prometheus::Labels labels = {{"method", std::string(method)}, {"code", absl::StatusCodeToString(code)}};
      slot.duration = &rpc_duration_->Add(labels, LatencyBuckets());
      if (code != absl::StatusCode::kOk) {
        labels["side"] = "client";
        slot.errors[0] = &rpc_errors_->Add(labels);
        labels["side"] = "server";
        slot.errors[1] = &rpc_errors_->Add(labels);
      }
    }
    series = slot;
  }
  series.duration->Observe(seconds);
  if (code != absl::StatusCode::kOk) series.errors[side == ErrorSide::kClient ? 0 : 1]->Increment();
}

void Metrics::CallStarted(absl::string_view method) {
  if (auto it = inflight_.find(method); it != inflight_.end()) it->second->Increment();
}

void Metrics::CallEnded(absl::string_view method) {
  if (auto it = inflight_.find(method); it != inflight_.end()) it->second->Decrement();
}

void Metrics::AddAppendedTokens(int64_t tokens) { appended_tokens_->Increment(static_cast<double>(tokens)); }

void Metrics::CountPrefixLookup(int64_t tokens) {
  prefix_lookups_[tokens > 0 ? 1 : 0]->Increment();
  prefix_reused_tokens_->Increment(static_cast<double>(tokens));
}

void Metrics::AddAttendedQueries(int64_t queries) { attended_queries_->Increment(static_cast<double>(queries)); }

void Metrics::ObserveKernel(KernelOp op, double seconds) {
  kernel_duration_[static_cast<int>(op)]->Observe(seconds);
}

void Metrics::ObserveDecodeBatch(int64_t items) { decode_batch_size_->Observe(static_cast<double>(items)); }

void Metrics::AddDecodeItemFailure(absl::StatusCode code) {
  const int index = static_cast<int>(code);
  decode_item_failures_[index > 0 && index < kStatusCodes ? index : static_cast<int>(absl::StatusCode::kUnknown)]
      ->Increment();
}

void Metrics::SetRestored(const SnapshotReport& report) {
  const double unverified = static_cast<double>(report.unverified.size());
  restored_[0]->Set(static_cast<double>(report.sessions) - unverified);
  restored_[1]->Set(unverified);
  restored_[2]->Set(static_cast<double>(report.failed.size()));
}

void Metrics::SetQueued(int64_t work) { queued_->Set(static_cast<double>(work)); }

void Metrics::SetInFlightBytes(int64_t bytes) { in_flight_bytes_->Set(static_cast<double>(bytes)); }

void Metrics::SetSharedMemoryRegions(size_t regions, size_t bytes) {
  shared_memory_regions_->Set(static_cast<double>(regions));
  shared_memory_bytes_->Set(static_cast<double>(bytes));
}

void Metrics::SetKvEventsBufferBytes(size_t bytes) { kv_events_buffer_bytes_->Set(static_cast<double>(bytes)); }

void Metrics::ObservePromotion(double seconds) { promotion_duration_->Observe(seconds); }

void Metrics::CountTakeover(TakeoverResult result) {
  if (takeovers_[result] != nullptr) takeovers_[result]->Increment();
}

void Metrics::ObserveQuantization(CodecKind codec, KvKind kind, const EncodeStats& stats) {
  const int c = static_cast<int>(codec);
  if (c < 1 || c > 6) return;
  QuantizationSeries& series = quantization_[c][static_cast<int>(kind)];
  if (stats.vectors > 0) {
    series.error->ObserveMultiple(std::vector<double>(std::begin(stats.histogram), std::end(stats.histogram)),
                                  stats.error_sum);
  }
  series.fp16_fields->Increment(static_cast<double>(stats.fp16_fields));
  series.saturated->Increment(static_cast<double>(stats.saturated));
  series.underflowed->Increment(static_cast<double>(stats.underflowed));
}

namespace {

// Adds what a running total gained since `seen` to a counter.
void Advance(prometheus::Counter* counter, int64_t total, int64_t* seen) {
  counter->Increment(static_cast<double>(total - *seen));
  *seen = total;
}

}  // namespace

void Metrics::SetSharedMemoryRefusals(int64_t descriptors, int64_t limits, int64_t timeouts) {
  const int64_t totals[3] = {descriptors, limits, timeouts};
  for (int i = 0; i < 3; ++i) Advance(shared_memory_refused_[i], totals[i], &shared_memory_refused_seen_[i]);
}

void Metrics::SetStore(const StoreSnapshot& s) {
  prefix_blocks_->Set(static_cast<double>(s.named_blocks));
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    if (s.tenants.count(it->first) != 0) {
      ++it;
    } else if (known_tenants_.count(it->first) != 0) {
      it->second.first->Set(0);
      it->second.second->Set(0);
      ++it;
    } else {
      tenant_sessions_->Remove(it->second.first);
      tenant_bytes_->Remove(it->second.second);
      it = tenants_.erase(it);
    }
  }
  for (const auto& [tenant, use] : s.tenants) {
    auto [it, added] = tenants_.try_emplace(tenant);
    if (added) {
      it->second = {&tenant_sessions_->Add({{"tenant", tenant}}), &tenant_bytes_->Add({{"tenant", tenant}})};
    }
    it->second.first->Set(static_cast<double>(use.sessions));
    it->second.second->Set(static_cast<double>(use.bytes));
  }
  sessions_->Set(static_cast<double>(s.sessions));
  tokens_->Set(static_cast<double>(s.tokens));
  bytes_used_->Set(static_cast<double>(s.bytes_used));
  budget_bytes_->Set(static_cast<double>(s.budget_bytes));
  fp16_bytes_->Set(static_cast<double>(s.resident_fp16_bytes));
  compression_ratio_->Set(s.compression_ratio());
  Advance(lru_evictions_, s.lru_evictions, &lru_seen_);
  Advance(ttl_expiries_, s.ttl_expiries, &ttl_seen_);
  Advance(disk_drops_, s.disk_drops, &disk_drops_seen_);
  memory_sessions_->Set(static_cast<double>(s.resident_sessions));
  const TierStats top = s.tier_parts.empty() ? TierStats() : s.tier_parts.front();
  spill_bytes_->Set(static_cast<double>(top.live_bytes));
  spill_file_bytes_->Set(static_cast<double>(top.bytes));
  spill_budget_bytes_->Set(static_cast<double>(top.budget_bytes));
  spill_queued_bytes_->Set(static_cast<double>(top.queued_bytes));
  Advance(spill_write_errors_, top.write_errors, &write_errors_seen_);
  Advance(spill_crc_failures_, top.crc_failures, &crc_failures_seen_);
  Advance(demotions_, s.demotions, &demotions_seen_);
  Advance(promotions_, s.promotions, &promotions_seen_);
  for (size_t i = 0; i < tiers_.size() && i < s.tier_parts.size(); ++i) {
    TierSeries& t = tiers_[i];
    const TierStats& stats = s.tier_parts[i];
    t.sessions->Set(static_cast<double>(s.demoted_sessions));
    t.live_bytes->Set(static_cast<double>(stats.live_bytes));
    t.stored_bytes->Set(static_cast<double>(stats.bytes));
    t.budget_bytes->Set(static_cast<double>(stats.budget_bytes));
    t.queued_bytes->Set(static_cast<double>(stats.queued_bytes));
    Advance(t.write_errors, stats.write_errors, &t.write_errors_seen);
    Advance(t.crc_failures, stats.crc_failures, &t.crc_failures_seen);
  }
  if (tier_up_ != nullptr) {
    tier_up_->Set(s.tier_health.ok() ? 1 : 0);
    Advance(tier_rewrites_, s.tier.rewrites, &rewrites_seen_);
  }
}

}  // namespace turbokv
