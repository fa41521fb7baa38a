// turbokvd: the gRPC server around the Handler. Create checks the options and
// builds the store; Start binds the listeners; Shutdown drains.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/dataplane/shared_memory.h"
#include "service/kv_events.h"
#include "service/store/session_store.h"
#include "service/store/tiers/tier_chain.h"

namespace grpc {
class Server;
class ServerCredentials;
}

namespace turbokv {

class Authenticator;
class Backend;
class Executor;
class Handler;
class KvCacheService;
class MetricsPage;
class Metrics;
class RedisTier;
class ThreadPool;

struct ServerOptions {
  // unix:///path or host:port (port 0: one the OS picks).
  std::vector<std::string> listen = {"unix:///tmp/turbokv.sock"};
  std::string device = "auto";  // auto, cpu or cuda:N
  // On a GPU: pages in the token groups order, attention on the tensor-core
  // kernel (CudaBackendOptions::tensor_cores).
  bool cuda_tensor_cores = false;
  int threads = 0;              // kernel threads; 0: one per core
  bool pin_threads = false;     // each kernel thread kept to one CPU (ThreadPool's `pin`)
  // Bytes of compressed pages; 0: the device's default (on a GPU, the CUDA
  // backend's share of its free memory; on the CPU, kDefaultHostBudget).
  size_t memory_budget = 0;
  EvictionPolicy eviction = EvictionPolicy::kReject;
  absl::Duration session_ttl = absl::Hours(1);  // zero: sessions never expire
  int max_message_bytes = 64 << 20;
  int64_t max_tokens = int64_t{1} << 20;  // per layer of a session
  int page_tokens = 64;
  // Per tenant: calls (stream messages count one each) and request bytes in
  // flight; past either, calls are refused with RESOURCE_EXHAUSTED.
  int64_t tenant_max_calls = 128;
  int64_t tenant_max_inflight_bytes = int64_t{1} << 30;
  // HTTP/2 streams one connection may have open at once.
  int max_concurrent_streams = 256;
  absl::Duration expiry_interval = absl::Seconds(1);  // how often idle sessions are checked (and gauges refreshed)
  // host:port of the Prometheus endpoint (/metrics); port 0 picks one; empty: none.
  std::string metrics_listen = "127.0.0.1:9464";
  // KV events (empty endpoint: none): the blocks held for reuse, per medium,
  // as vLLM's KV events over ZeroMQ (service/kv_events.h).
  KvEventsOptions kv_events;
  // Sessions are loaded from here at start and written here on Shutdown and
  // on the Snapshot call (empty: in memory only).
  std::string snapshot_dir;
  // The tiers below memory (MakeTierChain): the disk, Redis, or both.
  TierChainOptions tiers;
  // Of the memory budget (and of tiers.spill_budget): past high, the background
  // pass demotes idle sessions (drops the oldest on disk) down to low.
  double high_watermark = 0.90;
  double low_watermark = 0.80;
  // "TOKEN TENANT" lines: every call needs "authorization: Bearer TOKEN" and
  // sees only its tenant's sessions. Empty: no authentication.
  std::string auth_tokens_file;
  // With auth_tokens_file: the tenant allowed to call Snapshot (an operator
  // action over every tenant's sessions); empty: none.
  std::string admin_tenant;
  // Most sessions the daemon holds, and one tenant holds.
  int64_t max_sessions = 10000;
  int64_t max_tenant_sessions = 10000;
  // PEM files. With a certificate and key, TCP listeners speak TLS; with a
  // client CA too, they require client certificates it signed (mTLS). Unix
  // sockets stay plaintext (their file mode, 0660, guards them).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // host:port serving only grpc.health.v1 (for Kubernetes probes, while the
  // API stays on a unix socket); port 0 picks one; empty: none.
  std::string health_listen;
  // The unix socket co-located clients hand their shared memory to
  // (docs/API.md, "Shared memory"). "auto": the first unix listener's path
  // with ".shm" appended (none without a unix listener); empty: none.
  std::string shared_memory_socket = "auto";
  size_t shared_memory_max_bytes = size_t{1} << 30;  // the largest region one client may register
};

// Sends gRPC core's own log lines (its errors: a listener that fails, a
// connection that breaks) to the daemon's log (service/log.h), as
// "grpc: message (file:line)". Once, before the first server starts.
void RouteGrpcLog();

// The budget of a CPU daemon when --memory-budget does not set one.
constexpr size_t kDefaultHostBudget = size_t{4} << 30;

class Server {
 public:
  // Checks the options and chooses the device; nothing listens yet.
  static absl::StatusOr<std::unique_ptr<Server>> Create(const ServerOptions& options);
  ~Server();  // Shutdown(zero deadline) if still running

  // Loads the snapshots (a damaged one fails only its session), binds every
  // listener and starts serving. UNAVAILABLE naming the address that could
  // not be bound.
  absl::Status Start();
  // What Start loaded from the snapshot dir, and found on the spill tier.
  const SnapshotReport& loaded() const { return loaded_; }
  const TierScanReport& spilled() const { return spilled_; }

  // Health turns NOT_SERVING and new calls get UNAVAILABLE while the
  // listeners stay open; calls in flight get until `deadline` from now to
  // finish and are cancelled after (work not started is dropped); then the
  // workers stop and, with a snapshot dir, every session is written within
  // `snapshot_deadline`. DATA_LOSS when some session was not written (they
  // are logged), the store's error when the snapshot failed as a whole.
  // Idempotent (later calls return OK).
  absl::Status Shutdown(absl::Duration deadline, absl::Duration snapshot_deadline = absl::Seconds(30));

  // The listeners as bound, with the OS-chosen TCP ports filled in.
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // The shared-memory socket's path, or nullptr when there is none.
  const SharedMemory* shared_memory() const { return shared_memory_.get(); }
  // The health-only listener as bound, or empty.
  const std::string& health_endpoint() const { return health_endpoint_; }
  // http://host:port/metrics as bound, or empty.
  const std::string& metrics_endpoint() const { return metrics_endpoint_; }
  const std::string& device() const { return device_; }
  size_t memory_budget() const { return budget_; }
  const std::string& device_reason() const { return device_reason_; }
  Handler& handler() { return *handler_; }
  SessionStore& store() { return *store_; }

 private:
  explicit Server(const ServerOptions& options);
  void ExpireLoop();
  // With the Redis tier: its health in the health service.
  void SetTierHealth();
  // A device that failed for good (Backend::Health) turns the health service
  // NOT_SERVING, for "" and the service, and logs why, once.
  void SetDeviceHealth();

  ServerOptions options_;
  std::string device_;
  std::string device_reason_;
  size_t budget_ = 0;
  bool device_failed_ = false;  // the expiry thread's
  std::unique_ptr<Authenticator> authenticator_;
  std::shared_ptr<grpc::ServerCredentials> tcp_credentials_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsPage> metrics_page_;
  std::string metrics_endpoint_;
  std::unique_ptr<ThreadPool> kernel_pool_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvEventPublisher> kv_events_;  // the store's index publishes through it: it goes after
  std::unique_ptr<SessionStore> store_;
  const RedisTier* redis_tier_ = nullptr;  // with --redis-url: in store_'s tier
  std::unique_ptr<SharedMemory> shared_memory_;  // the handler reads its regions: it goes after
  std::unique_ptr<Handler> handler_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::string health_endpoint_;
  std::vector<std::string> endpoints_;
  SnapshotReport loaded_;
  TierScanReport spilled_;

  std::mutex mutex_;
  std::condition_variable stop_expiry_;
  bool stopping_ = false;
  std::thread expiry_thread_;
};

}  // namespace turbokv
