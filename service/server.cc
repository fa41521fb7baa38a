#include "service/server.h"

#include <malloc.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/cpu/thread_pool.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "prometheus/registry.h"
#include "service/auth.h"
#include "service/byte_size.h"
#include "service/device.h"
#include "service/executor.h"
#include "service/handler/handler.h"
#include "service/log.h"
#include "service/metrics.h"
#include "service/metrics_page.h"
#include "service/rpc/kv_cache_service.h"
#include "service/store/tiers/redis_tier.h"
#include "service/store/tiers/tier_chain.h"
#include "service/text_file.h"

namespace turbokv {

namespace {

// While listeners open, gRPC's log lines are kept here instead of logged:
// a listener that fails is reported once, by the daemon, with the reason
// taken from them.
std::mutex grpc_log_mutex;
std::string* grpc_log_kept = nullptr;

void GrpcLog(gpr_log_func_args* args) {
  {
    std::lock_guard<std::mutex> lock(grpc_log_mutex);
    if (grpc_log_kept != nullptr) {
      absl::StrAppend(grpc_log_kept, args->message, "\n");
      return;
    }
  }
  Logf(args->severity == GPR_LOG_SEVERITY_ERROR ? LogLevel::kError : LogLevel::kInfo, "grpc: %s (%s:%d)", args->message,
       args->file, args->line);
}

// Keeps gRPC's log lines in `kept` until the returned object goes.
auto KeepGrpcLog(std::string* kept) {
  {
    std::lock_guard<std::mutex> lock(grpc_log_mutex);
    grpc_log_kept = kept;
  }
  return absl::MakeCleanup([] {
    std::lock_guard<std::mutex> lock(grpc_log_mutex);
    grpc_log_kept = nullptr;
  });
}

// The operating system's reasons in gRPC's error text (its os_error fields,
// e.g. "Address already in use"), or `otherwise` when it gives none.
std::string OsReasons(const std::string& grpc_said, const std::string& otherwise) {
  std::vector<std::string> reasons;
  const std::string field = "os_error:\"";
  for (size_t at = grpc_said.find(field); at != std::string::npos; at = grpc_said.find(field, at)) {
    at += field.size();
    const size_t end = grpc_said.find('"', at);
    if (end == std::string::npos) break;
    std::string reason = grpc_said.substr(at, end - at);
    if (std::find(reasons.begin(), reasons.end(), reason) == reasons.end()) reasons.push_back(std::move(reason));
  }
  return reasons.empty() ? otherwise : absl::StrJoin(reasons, "; ");
}

constexpr absl::Duration kRefusalWindow = absl::Milliseconds(200);
constexpr int kMetricsThreads = 8;
constexpr int kMetricsRequestTimeoutMs = 2000;
constexpr char kServiceName[] = "turbokv.v1.KvCacheService";
// Health of the Redis tier (with --redis-url): NOT_SERVING while Redis does
// not answer; the daemon itself keeps serving from memory.
constexpr char kRemoteTierService[] = "turbokv.RemoteTier";

// unix:///path or unix:path -> /path.
std::string UnixSocketPath(absl::string_view address) {
  absl::ConsumePrefix(&address, "unix://");
  absl::ConsumePrefix(&address, "unix:");
  return std::string(address);
}

// Whether a process accepts connections on the unix socket at `path` (a
// file left by one that died refuses them).
bool UnixSocketServed(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) return false;
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool served = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return served;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::optional<std::string> text = ReadTextFile(path);
  if (!text.has_value()) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  return *std::move(text);
}

// INVALID_ARGUMENT unless `cert` holds a PEM certificate and `key` the PEM
// private key of its public key.
absl::Status CheckKeyMatchesCertificate(const std::string& cert, const std::string& key, const ServerOptions& options) {
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(BIO_new_mem_buf(cert.data(), static_cast<int>(cert.size())), &BIO_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new_mem_buf(key.data(), static_cast<int>(key.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> x509(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr),
                                                   &X509_free);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert ", options.tls_cert, " holds no PEM certificate"));
  }
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key ", options.tls_key, " holds no PEM private key (or one with a passphrase)"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", options.tls_key, " is not the key of --tls-cert ",
                                                   options.tls_cert));
  }
  return absl::OkStatus();
}

// Plaintext, TLS, or TLS requiring client certificates, from the flags.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(const ServerOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (options.tls_cert.empty()) {
    if (!options.tls_client_ca.empty()) return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadFile(options.tls_cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(options.tls_key, "--tls-key");
  if (!key.ok()) return key.status();
  if (absl::Status matched = CheckKeyMatchesCertificate(*cert, *key, options); !matched.ok()) return matched;
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadFile(options.tls_client_ca, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

Server::Server(const ServerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options) {
  if (options.listen.empty()) return absl::InvalidArgumentError("no --listen address");
  for (const std::string& address : options.listen) {
    if (address.empty() || (!absl::StartsWith(address, "unix:") && address.find(':') == std::string::npos)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen=", address, ": expected unix:///path or host:port"));
    }
  }
  if (options.threads < 0) return absl::InvalidArgumentError("--threads must be >= 0 (0: one per core)");
  if (options.max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError("--max-message-bytes must be at least 1MiB");
  }
  if (options.max_sessions < 1 || options.max_tenant_sessions < 1) {
    return absl::InvalidArgumentError("--max-sessions and --max-tenant-sessions must be at least 1");
  }
  if (!options.admin_tenant.empty() && options.auth_tokens_file.empty()) {
    return absl::InvalidArgumentError("--admin-tenant needs --auth-tokens-file (without it every caller is the one tenant)");
  }
  if (options.tenant_max_calls < 1) return absl::InvalidArgumentError("--tenant-max-calls must be at least 1");
  if (options.tenant_max_inflight_bytes < 1) {
    return absl::InvalidArgumentError("--tenant-max-inflight-bytes must be more than 0");
  }
  if (options.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError("--max-concurrent-streams must be at least 1");
  }
  if (options.session_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session-ttl must not be negative");
  }
  std::unique_ptr<Server> server(new Server(options));
  int threads = options.threads;
  std::string threads_why = "--threads";
  if (threads == 0) {
    const CoreAllowance cores = AvailableCores();
    threads = cores.cores;
    threads_why = absl::StrCat("--threads=0: ", cores.why);
  }
  // Kernel calls of 64 indices or more (a kv head's span of 256-1,024
  // tokens each: a Step past 8K tokens of 8 kv heads, a Decode batch), a
  // promotion's layers and encodes of 256 token x kv heads or more in many
  // chunks (a Decode message's appends) run on the pool's background
  // workers; smaller ones on their caller.
  server->kernel_pool_ = std::make_unique<ThreadPool>(threads, /*background_from=*/64, options.pin_threads);
  if (options.pin_threads) {
    if (server->kernel_pool_->pinned() != threads) {
      return absl::FailedPreconditionError(absl::StrCat("--pin-threads=on: ", server->kernel_pool_->pinned(), " of ",
                                                        threads, " kernel threads could be kept to one CPU"));
    }
    absl::StrAppend(&threads_why, ", each kept to one CPU (--pin-threads=on)");
  }
  // Enough workers that cheap calls are not queued behind kernels; one
  // tenant holds at most half of them. On a GPU, up to four calls run on
  // the device at once (a stream, with its own staging, each).
  const int workers = threads + 2;
  absl::StatusOr<DeviceChoice> device =
      ChooseDevice(options.device, server->kernel_pool_.get(), options.memory_budget, std::min(workers, 4),
                   options.cuda_tensor_cores);
  if (!device.ok()) return device.status();
  server->backend_ = std::move(device->backend);
  server->device_ = server->backend_->name();
  server->device_reason_ = absl::StrCat(device->why, "; threads from ", threads_why);
  // The budget: as given, else the GPU's page arena, else 4 GiB of host memory.
  server->budget_ = options.memory_budget != 0          ? options.memory_budget
                    : server->backend_->capacity_bytes() != 0 ? server->backend_->capacity_bytes()
                                                              : kDefaultHostBudget;
  // The tiers below memory, top first (a stack: the disk, then Redis).
  if (!options.tiers.redis_url.empty() && !options.snapshot_dir.empty()) {
    return absl::InvalidArgumentError(
        "--redis-url and --snapshot-dir cannot go together: Redis keeps the sessions across restarts (the drain "
        "hands them over), and a snapshot loaded at start would bring back a copy of a session another daemon may "
        "hold by then");
  }
  absl::StatusOr<TierChain> chain = MakeTierChain(options.tiers, options.page_tokens);
  if (!chain.ok()) return chain.status();
  server->redis_tier_ = chain->redis;
  if (!options.auth_tokens_file.empty()) {
    absl::StatusOr<std::unique_ptr<Authenticator>> authenticator = Authenticator::FromFile(options.auth_tokens_file);
    if (!authenticator.ok()) return authenticator.status();
    if ((*authenticator)->tokens() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--auth-tokens-file ", options.auth_tokens_file, " holds no tokens"));
    }
    server->authenticator_ = *std::move(authenticator);
  }
  server->metrics_ = std::make_unique<Metrics>(
      server->backend_->label(), chain->names,
      server->authenticator_ != nullptr ? server->authenticator_->tenant_names() : std::vector<std::string>{""});
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = TcpCredentials(options);
  if (!credentials.ok()) return credentials.status();
  server->tcp_credentials_ = *std::move(credentials);
  StoreOptions store;
  store.backend = server->backend_.get();
  store.budget_bytes = server->budget_;
  store.eviction = options.eviction;
  store.page_tokens = options.page_tokens;
  store.snapshot_dir = options.snapshot_dir;
  store.max_sessions = options.max_sessions;
  store.max_tenant_sessions = options.max_tenant_sessions;
  store.high_watermark = options.high_watermark;
  store.low_watermark = options.low_watermark;
  store.on_takeover = [metrics = server->metrics_.get()](TakeoverResult result) { metrics->CountTakeover(result); };
  if (!options.kv_events.endpoint.empty()) {
    KvEventsOptions kv_events = options.kv_events;
    kv_events.block_tokens = options.page_tokens;
    if (kv_events.buffer_bytes == 0) kv_events.buffer_bytes = KvEventsBufferBytes(server->budget_);
    absl::StatusOr<std::unique_ptr<KvEventPublisher>> publisher = KvEventPublisher::Start(kv_events);
    if (!publisher.ok()) return publisher.status();
    server->kv_events_ = *std::move(publisher);
    store.on_block_events = [publisher = server->kv_events_.get()](std::vector<BlockEvent> events) {
      publisher->Publish(events);
    };
  }
  server->store_ = std::make_unique<SessionStore>(store, std::move(chain->top));
  if (server->kv_events_ != nullptr) {
    server->kv_events_->SetSnapshot(
        [index = &server->store_->prefix_index()](const std::function<void(std::vector<BlockEvent>)>& fill) {
          index->Snapshot(fill);
        });
  }
  HandlerOptions handler;
  handler.kernel_pool = server->kernel_pool_.get();
  handler.max_tokens = options.max_tokens;
  handler.session_ttl = options.session_ttl;
  handler.max_message_bytes = static_cast<size_t>(options.max_message_bytes) / 2;
  handler.device = server->device_;
  handler.metrics = server->metrics_.get();
  if (server->authenticator_ != nullptr) handler.snapshot_tenant = options.admin_tenant;
  std::string shared_memory_socket = options.shared_memory_socket;
  if (shared_memory_socket == "auto") {
    auto unix_listener = std::find_if(options.listen.begin(), options.listen.end(),
                                      [](const std::string& a) { return absl::StartsWith(a, "unix:"); });
    shared_memory_socket = unix_listener == options.listen.end() ? "" : UnixSocketPath(*unix_listener) + ".shm";
  }
  if (!shared_memory_socket.empty()) {
    SharedMemoryOptions shared;
    shared.socket_path = shared_memory_socket;
    shared.max_region_bytes = options.shared_memory_max_bytes;
    if (server->authenticator_ != nullptr) {
      shared.tenant_of = [authenticator = server->authenticator_.get()](absl::string_view token) {
        const std::string authorization = absl::StrCat("Bearer ", token);
        const absl::string_view value(authorization);
        return authenticator->Authenticate(&value);
      };
    }
    server->shared_memory_ = std::make_unique<SharedMemory>(shared);
    handler.shared_memory = server->shared_memory_.get();
  }
  server->handler_ = std::make_unique<Handler>(server->store_.get(), handler);
  server->executor_ = std::make_unique<Executor>(workers, std::max(1, workers / 2));
  ServiceLimits limits;
  limits.tenant_calls = options.tenant_max_calls;
  limits.tenant_bytes = options.tenant_max_inflight_bytes;
  server->service_ = std::make_unique<KvCacheService>(server->handler_.get(), server->executor_.get(),
                                                      server->metrics_.get(), server->authenticator_.get(), limits);
  return server;
}

Server::~Server() { Shutdown(absl::ZeroDuration()).IgnoreError(); }

absl::Status Server::Start() {
  if (!options_.snapshot_dir.empty()) {
    absl::StatusOr<SnapshotReport> loaded = store_->LoadSnapshots(absl::Now());
    if (!loaded.ok()) return loaded.status();
    loaded_ = *std::move(loaded);
    metrics_->SetRestored(loaded_);
  }
  if (!options_.tiers.spill_dir.empty()) {
    absl::StatusOr<TierScanReport> spilled = store_->LoadTier(absl::Now());
    if (!spilled.ok()) return spilled.status();
    spilled_ = *std::move(spilled);
  }
  metrics_->SetStore(store_->Snapshot());
  if (!options_.metrics_listen.empty()) {
    // More threads than scrapers, and a short read timeout: a few
    // connections that never send a request cannot hold /metrics.
    absl::StatusOr<std::unique_ptr<MetricsPage>> page =
        MetricsPage::Start(options_.metrics_listen, {metrics_->registry(), metrics_->process()}, kMetricsThreads,
                           kMetricsRequestTimeoutMs);
    if (!page.ok()) return page.status();
    metrics_page_ = *std::move(page);
    const std::string host = options_.metrics_listen.substr(0, options_.metrics_listen.rfind(':'));
    metrics_endpoint_ = absl::StrCat("http://", host, ":", metrics_page_->port(), "/metrics");
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<int> ports(options_.listen.size(), 0);
  for (size_t i = 0; i < options_.listen.size(); ++i) {
    const bool unix_socket = absl::StartsWith(options_.listen[i], "unix:");
    // gRPC would replace a socket file another process serves on (and
    // remove it at exit, leaving that process unreachable): refused.
    if (unix_socket && UnixSocketServed(UnixSocketPath(options_.listen[i]))) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen[i],
                                                 ": another process (a turbokvd?) is serving on it"));
    }
    builder.AddListeningPort(options_.listen[i], unix_socket ? grpc::InsecureServerCredentials() : tcp_credentials_,
                             &ports[i]);
  }
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_concurrent_streams);
  // No SO_REUSEPORT: a second daemon on the same port fails to bind rather
  // than share the port's calls with the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service_.get());
  // Unix sockets are created 0660: the daemon's user and group only.
  const mode_t umask_before = umask(0117);
  std::string grpc_said;
  {
    auto keep = KeepGrpcLog(&grpc_said);
    server_ = builder.BuildAndStart();
  }
  umask(umask_before);
  const bool listening = server_ != nullptr && std::find(ports.begin(), ports.end(), 0) == ports.end();
  if (listening && !grpc_said.empty()) Logf(LogLevel::kWarning, "grpc, while listening: %s", grpc_said);
  for (size_t i = 0; i < options_.listen.size(); ++i) {
    const std::string& address = options_.listen[i];
    if (ports[i] == 0) {
      if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
      server_.reset();
      return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ",
                                                 OsReasons(grpc_said, "in use, bad address or no permission")));
    }
    if (absl::StartsWith(address, "unix:")) {
      endpoints_.push_back(address);
      chmod(UnixSocketPath(address).c_str(), 0660);
    } else {
      endpoints_.push_back(absl::StrCat(address.substr(0, address.rfind(':')), ":", ports[i]));
    }
  }
  if (server_ == nullptr) return absl::UnavailableError("the gRPC server did not start");
  if (shared_memory_ != nullptr) {
    const mode_t umask_shared = umask(0117);  // 0660, as the gRPC sockets
    const absl::Status started = shared_memory_->Start();
    umask(umask_shared);
    if (!started.ok()) return started;
  }
  if (!options_.health_listen.empty()) {
    grpc::ServerBuilder health;
    int port = 0;
    health.AddListeningPort(options_.health_listen, grpc::InsecureServerCredentials(), &port);
    health.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    std::string health_said;
    {
      auto keep = KeepGrpcLog(&health_said);
      health_server_ = health.BuildAndStart();
    }
    if (health_server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.health_listen, " (--health-listen): ",
                                                 OsReasons(health_said, "in use, bad address or no permission")));
    }
    if (!health_said.empty()) Logf(LogLevel::kWarning, "grpc, while listening: %s", health_said);
    health_endpoint_ = absl::StrCat(options_.health_listen.substr(0, options_.health_listen.rfind(':')), ":", port);
    health_server_->GetHealthCheckService()->SetServingStatus(true);
    health_server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  }
  // Health answers for the server ("") and for the service by name; the
  // drain turns both NOT_SERVING.
  server_->GetHealthCheckService()->SetServingStatus(true);
  server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  SetTierHealth();
  if (!options_.tiers.redis_url.empty()) {
    const RedisTier* redis = redis_tier_;
    const absl::Status health = redis->Health();
    Logf(LogLevel::kInfo, "Redis tier %s%s (budget %s, lease %s, timeout %s) as owner %s: %s", options_.tiers.redis_url.c_str(),
         options_.tiers.redis_password.empty()
             ? ""
             : absl::StrCat(" as user '", options_.tiers.redis_user.empty() ? "default" : options_.tiers.redis_user, "'").c_str(),
         FormatByteSize(options_.tiers.redis_budget).c_str(), absl::FormatDuration(options_.tiers.redis_lease).c_str(),
         absl::FormatDuration(options_.tiers.redis_timeout).c_str(), redis->owner().c_str(),
         health.ok() ? "answering" : absl::StrCat("not answering yet (", health.message(), "); writes wait").c_str());
  }
  expiry_thread_ = std::thread([this] { ExpireLoop(); });
  return absl::OkStatus();
}

void Server::SetDeviceHealth() {
  const absl::Status device = backend_->Health();
  if (device.ok() || device_failed_) return;
  // Once the device fails it stays failed: the daemon stops answering
  // SERVING, so that a liveness probe restarts it.
  device_failed_ = true;
  Logf(LogLevel::kError, "%s; health turns NOT_SERVING", std::string(device.message()).c_str());
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    server->GetHealthCheckService()->SetServingStatus(false);
  }
}

void Server::SetTierHealth() {
  if (options_.tiers.redis_url.empty()) return;
  const bool up = store_->residency().Health().ok();
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(kRemoteTierService, up);
  }
}

void Server::ExpireLoop() {
  // Host pages under CpuBackend::kMapThreshold, and the requests and replies
  // of calls in flight, come from the heap, which keeps what is freed: once
  // the pool and the bytes in flight have shrunk by kTrimBytes, the free heap
  // goes back to the kernel, so the process's memory follows them (a
  // client that sent large calls and never read their replies leaves nothing
  // behind).
  constexpr size_t kTrimBytes = size_t{8} << 20;
  const auto held = [this] { return store_->pool().used_bytes() + static_cast<size_t>(service_->in_flight_bytes()); };
  size_t used_at_trim = held();
  size_t released_at_trim = store_->pool().released_bytes();
  std::string last_demotion_error;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_expiry_.wait_for(lock, absl::ToChronoNanoseconds(options_.expiry_interval),
                                [this] { return stopping_; })) {
    lock.unlock();
    const int expired = store_->ExpireIdle(absl::Now());
    if (expired > 0) Logf(LogLevel::kInfo, "%d idle session(s) expired", expired);
    const SessionStore::RebalanceReport rebalanced = store_->Rebalance();
    for (const std::string& id : rebalanced.dropped) {
      Logf(LogLevel::kWarning, "session %s dropped: the %s tier is over its high watermark", id.c_str(),
           store_->residency().tier_name());
    }
    SetTierHealth();
    SetDeviceHealth();
    // A failure is logged when it first happens, not every pass.
    const std::string error(rebalanced.error.message());
    if (!error.empty() && error != last_demotion_error) {
      Logf(LogLevel::kError, "demotion failed, sessions stay in memory: %s", error.c_str());
    }
    last_demotion_error = error;
    backend_->Trim();
    const size_t used = held();
    // Also when pages were freed since the last trim although no pass saw
    // them held (made and freed between two passes).
    const size_t released = store_->pool().released_bytes();
    if (used + kTrimBytes < used_at_trim || released - released_at_trim >= kTrimBytes) {
      malloc_trim(0);
      used_at_trim = used;
      released_at_trim = released;
    } else {
      used_at_trim = std::max(used_at_trim, used);
    }
    metrics_->SetStore(store_->Snapshot());
    metrics_->SetQueued(static_cast<int64_t>(executor_->queued()));
    metrics_->SetInFlightBytes(service_->in_flight_bytes());
    if (kv_events_ != nullptr) metrics_->SetKvEventsBufferBytes(kv_events_->kept_bytes());
    if (shared_memory_ != nullptr) {
      metrics_->SetSharedMemoryRegions(shared_memory_->regions(), shared_memory_->region_bytes());
      const SharedMemoryRefusals refused = shared_memory_->refusals();
      metrics_->SetSharedMemoryRefusals(refused.descriptors, refused.limits, refused.timeouts);
    }
    lock.lock();
  }
}

absl::Status Server::Shutdown(absl::Duration deadline, absl::Duration snapshot_deadline) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return absl::OkStatus();
    stopping_ = true;
  }
  // The housekeeping loop stops at its next wait; it is joined once the
  // calls are done, since it may be waiting for a busy session's lock (to
  // count it) and the drain must not wait for that.
  stop_expiry_.notify_all();
  // Drain while still listening, so that health checks see NOT_SERVING and
  // new calls get a clear UNAVAILABLE; then cancel what is left: work queued
  // for a cancelled call is dropped, not computed.
  const absl::Time until = absl::Now() + deadline;
  if (service_ != nullptr) service_->StartDraining();
  if (health_server_ != nullptr) health_server_->GetHealthCheckService()->SetServingStatus(false);
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    while (service_->active_calls() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    // Keep answering UNAVAILABLE a moment longer, so that a client that sent
    // its next call just as the last one finished gets that answer rather
    // than a call cancelled by the closing listener.
    absl::SleepFor(std::min(kRefusalWindow, std::max(until - absl::Now(), absl::ZeroDuration())));
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  if (health_server_ != nullptr) health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
  if (executor_ != nullptr) executor_->Shutdown();
  if (server_ != nullptr) server_->Wait();
  if (shared_memory_ != nullptr) shared_memory_->Stop();  // no call runs any more
  if (expiry_thread_.joinable()) expiry_thread_.join();
  absl::Status status;
  if (store_ != nullptr && store_->residency().has_tier()) {
    // Every session's unsealed tail joins its sealed pages on the tier: a
    // restart on the same spill dir finds it whole, and on Redis, any
    // daemon does, once its lease is let go.
    status = store_->residency().Flush(absl::Now() + snapshot_deadline);
    if (!status.ok()) {
      Logf(LogLevel::kError, "%s tier not flushed: %s", store_->residency().tier_name(), std::string(status.message()).c_str());
    }
    SharedTier* shared = store_->residency().shared_tier();
    if (absl::Status released = shared != nullptr ? shared->ReleaseAll() : absl::OkStatus(); !released.ok()) {
      Logf(LogLevel::kError, "%s", std::string(released.message()).c_str());
      if (status.ok()) status = released;
    } else if (!options_.tiers.redis_url.empty()) {
      Logf(LogLevel::kInfo, "sessions handed over: their leases in Redis are let go");
    }
  }
  if (store_ != nullptr && !options_.snapshot_dir.empty()) {
    absl::StatusOr<SnapshotReport> saved =
        store_->SaveSnapshots(absl::Now() + snapshot_deadline, /*final=*/true);
    if (!saved.ok()) {
      status = saved.status();
      Logf(LogLevel::kError, "snapshots not written: %s", std::string(saved.status().message()).c_str());
    } else {
      Logf(LogLevel::kInfo, "wrote %lld session(s), %s, to %s", static_cast<long long>(saved->sessions),
                   FormatByteSize(static_cast<size_t>(saved->bytes)).c_str(), options_.snapshot_dir.c_str());
      for (const auto& [id, why] : saved->failed) {
        Logf(LogLevel::kWarning, "session %s not written: %s", id.c_str(), std::string(why.message()).c_str());
      }
      if (!saved->failed.empty()) {
        status = absl::DataLossError(absl::StrCat(saved->failed.size(), " session(s) not written to ",
                                                  options_.snapshot_dir, "; their older files, if any, will be "
                                                  "refused with DATA_LOSS at the next start"));
      }
    }
  }
  // The events of the drain are sent; a replay no longer reads the store.
  if (kv_events_ != nullptr) kv_events_->Stop();
  // Last: stopping the metrics endpoint takes about 2 s (its threads poll).
  metrics_page_.reset();
  return status;
}

void RouteGrpcLog() { gpr_set_log_function(&GrpcLog); }

}  // namespace turbokv
