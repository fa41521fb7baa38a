// turbokvd: flags -> ServerOptions, start, wait for a termination signal, drain.
// The only place that reads flags.
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <malloc.h>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"
#include "absl/time/time.h"
#include "google/protobuf/stubs/logging.h"
#include "service/byte_size.h"
#include "service/log.h"
#include "service/server.h"
#include "service/text_file.h"

namespace {

using turbokv::Log;
using turbokv::LogLevel;
using turbokv::Logf;

constexpr char kUsage[] = R"(turbokvd: KV-cache compression service (gRPC turbokv.v1.KvCacheService)

Flags (--name=value or --name value):
  --listen=ADDR            unix:///path or host:port (port 0: any); repeatable
                           (default unix:///tmp/turbokv.sock)
  --device=auto|cpu|cuda:N where sessions live and kernels run (default auto)
  --cuda-attention=split|tensor-cores
                           on a GPU, the attention kernel: split (CUDA cores,
                           the one measured on an H100) or tensor-cores (mma
                           on pages kept in token groups, head_dim 64, 128,
                           256; not yet run on a GPU) (default split)
  --threads=N              kernel threads, 0 = one per core this process may
                           use: its CPU affinity, capped by its cgroup's CPU
                           quota (a container's CPU limit) (default 0)
  --pin-threads=on|off     keep each kernel thread to one of the CPUs this
                           process may use, running as well as asleep (off:
                           asleep only, when the threads are as many as the
                           CPUs). Only where those CPUs are the
                           daemon's alone (Kubernetes' static CPU manager, a
                           Guaranteed pod): no faster than off in the
                           measurements of docs/OPERATIONS.md, and anything
                           else busy on one of them holds up every large call
                           for as long (default off)
  --memory-budget=SIZE     bytes of compressed pages, e.g. 4GiB (default: on
                           a GPU 80% of its free memory at start, allocated
                           then as one arena; on the CPU 4GiB)
  --eviction=reject|lru    when the budget is full: refuse the write, or evict
                           least recently used idle sessions (with
                           --spill-dir: demote them to disk) (default reject)
  --spill-dir=DIR          a disk tier: sealed pages are written through to
                           segment files in DIR, idle sessions are demoted
                           there before memory runs out and come back on
                           their next call, and a restart finds them (default
                           none)
  --spill-budget=SIZE      most bytes of live records in --spill-dir (default 64GiB)
  --redis-url=URL          a tier shared with other daemons:
                           redis://HOST[:PORT][/DB], rediss://... (TLS) or
                           unix:///PATH[?db=N]; a Redis Cluster: any node,
                           or redis://HOST1:PORT1,HOST2:PORT2,... (seeds).
                           Sealed pages are written
                           through; a call naming a session this daemon does
                           not hold takes it over from Redis; SIGTERM hands
                           every session over. With --spill-dir, the disk
                           sits between memory and Redis (a local copy read
                           first) (default none)
  --redis-budget=SIZE      most bytes turbokvd keeps in Redis (default 64GiB)
  --redis-lease=DURATION   how long a session stays this daemon's after its
                           last renewal (every third of it) (default 10s)
  --redis-timeout=DURATION to connect to Redis, and per reply (default 1s)
  --redis-acknowledge=WHEN an append answers once Redis holds its tokens
                           ("written": a daemon killed or cut off from
                           Redis loses none it acknowledged; a call waits
                           a round trip to Redis) or once they are queued
                           for Redis ("queued": what is still queued is
                           lost then) (default written)
  --redis-queue=SIZE       most bytes of writes waiting for Redis: past it an
                           append waits for room (written) or its sealed
                           pages wait in memory for the background pass
                           (queued); demotions and the drain may take twice
                           it (default 64MiB)
  --redis-orphan-ttl=DURATION  a session's keys in Redis expire this long
                           after their owner last refreshed them (every
                           quarter of it): a session nobody holds or claims
                           goes (default 168h, at least 3 x --redis-lease)
  --redis-user=NAME        the Redis ACL user (default: Redis's "default")
  --redis-password-file=PATH  the Redis password, the file's first line (else
                           $TURBOKV_REDIS_PASSWORD; default none)
  --redis-tls-ca=PATH      with rediss://: the CA (PEM) that signed Redis's
                           certificate (default: the system's trust store)
  --redis-tls-cert=PATH    with rediss://: a client certificate (PEM), with
  --redis-tls-key=PATH     its key
  --memory-watermarks=HIGH,LOW  with --spill-dir: past HIGH x the budget, idle
                           sessions are demoted until LOW x (default 0.9,0.8);
                           the same fractions of --spill-budget drop the
                           oldest sessions on disk
  --session-ttl=DURATION   delete sessions idle this long, 0 = never (default 1h)
  --max-message-bytes=SIZE largest gRPC message in or out (default 64MiB)
  --max-tokens=N           most tokens a layer of a session may hold (default 1048576)
  --shutdown-deadline=DURATION  how long calls in flight get on SIGTERM; calls
                           not started by then are cancelled (default 10s)
  --snapshot-deadline=DURATION  how long the drain's snapshot may take after
                           that; sessions not written by then are reported and
                           the exit status is 1 (default 30s)
  --tenant-max-calls=N     calls a tenant may have in flight (default 128)
  --tenant-max-inflight-bytes=SIZE  bytes a tenant may have in flight: requests,
                           and replies its client has not read yet
                           (default 1GiB)
  --max-concurrent-streams=N  HTTP/2 streams per connection (default 256)
  --metrics-listen=HOST:PORT    Prometheus endpoint /metrics, empty = none
                           (default 127.0.0.1:9464)
  --health-listen=HOST:PORT     a listener serving only grpc.health.v1, for
                           Kubernetes probes (default none)
  --shared-memory-socket=PATH  co-located clients hand the daemon shared
                           memory here (a sealed memfd) and their tensors
                           travel through it (docs/API.md "Shared memory");
                           empty = none (default: the first unix --listen
                           path with .shm appended)
  --shared-memory-max-bytes=SIZE  the largest region one client may hand
                           over (default 1GiB)
  --kv-events-endpoint=ADDR  publish KV events for routers on a ZeroMQ PUB
                           socket bound here, e.g. tcp://127.0.0.1:5557: the
                           blocks named for reuse, stored and removed, per
                           medium (memory, disk, redis), in vLLM 0.32's
                           format (docs/OPERATIONS.md "KV events") (default
                           none)
  --kv-events-replay-endpoint=ADDR  a ZeroMQ ROUTER socket bound here answers
                           replay requests (from a sequence number; older
                           than the last --kv-events-buffer batches: a
                           snapshot of what is held) (default none)
  --kv-events-topic=TOPIC  the first frame of every event message (default
                           kv-events)
  --kv-events-buffer=N     batches kept for replay (default 10000)
  --kv-events-buffer-bytes=SIZE  and at most these bytes of them (default: a
                           64th of the memory budget, from 1MiB to 64MiB)
  --kv-events-hashes=bytes|int  block hashes as the clients named them
                           (bytes), or as vLLM publishes its own (int: the
                           64-bit integer of a name's last 8 bytes, what
                           vLLM 0.32 sends by default) (default bytes)
  --kv-events-dp-rank=N    the data-parallel rank each batch carries, that of
                           the vLLM engine beside it (default 0)
  --snapshot-dir=DIR       load sessions from DIR at start, write them there on
                           SIGTERM and on the Snapshot call (default none)
  --auth-tokens-file=PATH  lines "TOKEN TENANT": calls need "authorization:
                           Bearer TOKEN" and see only their tenant's sessions
  --admin-tenant=NAME      the tenant (of --auth-tokens-file) allowed to call
                           Snapshot; without it, only SIGTERM snapshots
  --max-sessions=N         most sessions held (default 10000)
  --max-tenant-sessions=N  most sessions one tenant holds (default 10000)
  --tls-cert=PEM --tls-key=PEM  TLS on TCP listeners
  --tls-client-ca=PEM      require client certificates signed by this CA (mTLS)
  --help, --version
)";

// Termination signals: each drains (calls finish, snapshots are written)
// and stops the daemon.
constexpr int kDrainSignals[] = {SIGTERM, SIGINT, SIGQUIT, SIGHUP};
// Signals whose default action would end the process at once, without a
// drain: taken and ignored. (SIGKILL and SIGSTOP cannot be caught; the
// faults of the process itself, SIGSEGV and the like, are left alone.)
// SIGPIPE is set to be ignored outright (a closed connection is not news).
constexpr int kIgnoredSignals[] = {SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF,
                                   SIGXCPU, SIGXFSZ, SIGPWR,  SIGIO,     SIGSTKFLT};

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  if (abbrev != nullptr) return absl::StrCat("SIG", abbrev);
  return absl::StrCat("signal ", signal);
}

// libprotobuf logs only about messages that fail to parse (invalid UTF-8
// in a string field, before authentication): each such request is answered
// INVALID_ARGUMENT and counted in turbokv_rpc_errors_total, so the line per
// request is dropped rather than let one client flood the log.
void DropProtobufLog(google::protobuf::LogLevel, const char*, int, const std::string&) {}

int Fail(const std::string& message) {
  std::fprintf(stderr, "turbokvd: %s\n(see turbokvd --help)\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  turbokv::ServerOptions options;
  std::vector<std::string> listen;
  std::string redis_password_file;
  absl::Duration shutdown_deadline = absl::Seconds(10);
  absl::Duration snapshot_deadline = absl::Seconds(30);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--version") {
      std::printf("turbokvd %s\n", TURBOKV_VERSION);
      return 0;
    }
    if (!absl::StartsWith(arg, "--")) return Fail(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Fail(absl::StrCat("--", name, " needs a value"));
    }
    const std::string flag = absl::StrCat("--", name, "=", value);
    if (name == "listen") {
      listen.push_back(value);
    } else if (name == "device") {
      options.device = value;
    } else if (name == "cuda-attention") {
      if (value != "split" && value != "tensor-cores") return Fail(flag + ": expected split or tensor-cores");
      options.cuda_tensor_cores = value == "tensor-cores";
    } else if (name == "threads") {
      if (!absl::SimpleAtoi(value, &options.threads) || options.threads < 0) return Fail(flag + ": expected a count >= 0");
    } else if (name == "pin-threads") {
      if (value != "on" && value != "off") return Fail(flag + ": expected on or off");
      options.pin_threads = value == "on";
    } else if (name == "memory-budget") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--memory-budget: ", bytes.status().message()));
      if (*bytes == 0) return Fail("--memory-budget must be more than 0 (leave it out for the device's default)");
      options.memory_budget = *bytes;
    } else if (name == "eviction") {
      if (value == "reject") options.eviction = turbokv::EvictionPolicy::kReject;
      else if (value == "lru") options.eviction = turbokv::EvictionPolicy::kLru;
      else return Fail(flag + ": expected reject or lru");
    } else if (name == "session-ttl") {
      if (!absl::ParseDuration(value, &options.session_ttl)) return Fail(flag + ": expected a duration like 30m, 1h or 0");
    } else if (name == "max-message-bytes") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--max-message-bytes: ", bytes.status().message()));
      if (*bytes >= (size_t{1} << 31)) return Fail(flag + ": expected a size below 2GiB (gRPC's limit is 2GiB - 1 byte)");
      options.max_message_bytes = static_cast<int>(*bytes);
    } else if (name == "max-tokens") {
      if (!absl::SimpleAtoi(value, &options.max_tokens) || options.max_tokens < 1) return Fail(flag + ": expected a count >= 1");
    } else if (name == "kv-events-endpoint") {
      options.kv_events.endpoint = value;
    } else if (name == "kv-events-replay-endpoint") {
      options.kv_events.replay_endpoint = value;
    } else if (name == "kv-events-topic") {
      options.kv_events.topic = value;
    } else if (name == "kv-events-buffer") {
      if (!absl::SimpleAtoi(value, &options.kv_events.buffer_batches) || options.kv_events.buffer_batches < 1 ||
          options.kv_events.buffer_batches > (size_t{1} << 24)) {
        return Fail(flag + ": expected a count in [1, 16777216]");
      }
    } else if (name == "kv-events-buffer-bytes") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--kv-events-buffer-bytes: ", bytes.status().message()));
      if (*bytes == 0) return Fail("--kv-events-buffer-bytes must be more than 0");
      options.kv_events.buffer_bytes = *bytes;
    } else if (name == "kv-events-hashes") {
      if (value != "bytes" && value != "int") return Fail(flag + ": expected bytes or int");
      options.kv_events.int_hashes = value == "int";
    } else if (name == "kv-events-dp-rank") {
      if (!absl::SimpleAtoi(value, &options.kv_events.data_parallel_rank) || options.kv_events.data_parallel_rank < 0) {
        return Fail(flag + ": expected a rank >= 0");
      }
    } else if (name == "snapshot-dir") {
      options.snapshot_dir = value;
    } else if (name == "spill-dir") {
      options.tiers.spill_dir = value;
    } else if (name == "spill-budget") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--spill-budget: ", bytes.status().message()));
      options.tiers.spill_budget = *bytes;
    } else if (name == "redis-url") {
      options.tiers.redis_url = value;
    } else if (name == "redis-orphan-ttl") {
      if (!absl::ParseDuration(value, &options.tiers.redis_orphan_ttl)) return Fail(flag + ": expected a duration like 168h");
    } else if (name == "redis-acknowledge") {
      if (value != "written" && value != "queued") return Fail(flag + ": expected written or queued");
      options.tiers.redis_acknowledge_written = value == "written";
    } else if (name == "redis-user") {
      options.tiers.redis_user = value;
    } else if (name == "redis-tls-ca") {
      options.tiers.redis_tls_ca = value;
    } else if (name == "redis-tls-cert") {
      options.tiers.redis_tls_cert = value;
    } else if (name == "redis-tls-key") {
      options.tiers.redis_tls_key = value;
    } else if (name == "redis-password-file") {
      redis_password_file = value;
    } else if (name == "redis-budget") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--redis-budget: ", bytes.status().message()));
      options.tiers.redis_budget = *bytes;
    } else if (name == "redis-queue") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok() || *bytes == 0) {
        return Fail(absl::StrCat("--redis-queue: ", bytes.ok() ? "must be more than 0" : bytes.status().message()));
      }
      options.tiers.redis_queue = *bytes;
    } else if (name == "redis-lease") {
      if (!absl::ParseDuration(value, &options.tiers.redis_lease) || options.tiers.redis_lease < absl::Milliseconds(300)) {
        return Fail(flag + ": expected a duration of at least 300ms, like 10s");
      }
    } else if (name == "redis-timeout") {
      if (!absl::ParseDuration(value, &options.tiers.redis_timeout) || options.tiers.redis_timeout < absl::Milliseconds(1)) {
        return Fail(flag + ": expected a duration of at least 1ms, like 1s");
      }
    } else if (name == "memory-watermarks") {
      const std::vector<std::string> parts = absl::StrSplit(value, ',');
      if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &options.high_watermark) ||
          !absl::SimpleAtod(parts[1], &options.low_watermark) || !(options.low_watermark > 0) ||
          !(options.low_watermark < options.high_watermark) || !(options.high_watermark <= 1)) {
        return Fail(flag + ": expected HIGH,LOW with 0 < LOW < HIGH <= 1, e.g. 0.9,0.8");
      }
    } else if (name == "auth-tokens-file") {
      options.auth_tokens_file = value;
    } else if (name == "admin-tenant") {
      options.admin_tenant = value;
    } else if (name == "max-sessions") {
      if (!absl::SimpleAtoi(value, &options.max_sessions) || options.max_sessions < 1) return Fail(flag + ": expected a count >= 1");
    } else if (name == "max-tenant-sessions") {
      if (!absl::SimpleAtoi(value, &options.max_tenant_sessions) || options.max_tenant_sessions < 1) {
        return Fail(flag + ": expected a count >= 1");
      }
    } else if (name == "tls-cert") {
      options.tls_cert = value;
    } else if (name == "tls-key") {
      options.tls_key = value;
    } else if (name == "tls-client-ca") {
      options.tls_client_ca = value;
    } else if (name == "health-listen") {
      options.health_listen = value;
    } else if (name == "shared-memory-socket") {
      options.shared_memory_socket = value;
    } else if (name == "shared-memory-max-bytes") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok() || *bytes == 0) {
        return Fail(absl::StrCat("--shared-memory-max-bytes: ",
                                 bytes.ok() ? "must be more than 0" : bytes.status().message()));
      }
      options.shared_memory_max_bytes = *bytes;
    } else if (name == "metrics-listen") {
      options.metrics_listen = value;
    } else if (name == "shutdown-deadline") {
      if (!absl::ParseDuration(value, &shutdown_deadline)) return Fail(flag + ": expected a duration like 10s");
    } else if (name == "snapshot-deadline") {
      if (!absl::ParseDuration(value, &snapshot_deadline) || snapshot_deadline <= absl::ZeroDuration()) {
        return Fail(flag + ": expected a duration like 30s");
      }
    } else if (name == "tenant-max-calls") {
      if (!absl::SimpleAtoi(value, &options.tenant_max_calls) || options.tenant_max_calls < 1) {
        return Fail(flag + ": expected a count >= 1");
      }
    } else if (name == "tenant-max-inflight-bytes") {
      absl::StatusOr<size_t> bytes = turbokv::ParseByteSize(value);
      if (!bytes.ok()) return Fail(absl::StrCat("--tenant-max-inflight-bytes: ", bytes.status().message()));
      options.tenant_max_inflight_bytes = static_cast<int64_t>(*bytes);
    } else if (name == "max-concurrent-streams") {
      if (!absl::SimpleAtoi(value, &options.max_concurrent_streams) || options.max_concurrent_streams < 1) {
        return Fail(flag + ": expected a count >= 1");
      }
    } else {
      return Fail(absl::StrCat("unknown flag --", name));
    }
  }
  if (!listen.empty()) options.listen = listen;
  if (!options.kv_events.replay_endpoint.empty() && options.kv_events.endpoint.empty()) {
    return Fail("--kv-events-replay-endpoint needs --kv-events-endpoint: it replays what that socket publishes");
  }
  if (!redis_password_file.empty()) {
    std::optional<std::string> text = turbokv::ReadTextFile(redis_password_file);
    if (!text.has_value()) return Fail(absl::StrCat("--redis-password-file ", redis_password_file, ": cannot read it"));
    options.tiers.redis_password = std::string(absl::StripTrailingAsciiWhitespace(text->substr(0, text->find('\n'))));
    if (options.tiers.redis_password.empty()) return Fail(absl::StrCat("--redis-password-file ", redis_password_file, " is empty"));
  } else if (const char* password = std::getenv("TURBOKV_REDIS_PASSWORD"); password != nullptr) {
    options.tiers.redis_password = password;
  }
  if (!options.tiers.redis_user.empty() && options.tiers.redis_password.empty()) {
    return Fail("--redis-user needs a password: --redis-password-file or $TURBOKV_REDIS_PASSWORD");
  }

  // Every catchable signal whose default would end the process is taken by
  // sigwait below, not by a handler: the termination signals drain, the
  // others are logged and ignored (docs/OPERATIONS.md). Blocked here, before
  // any thread exists, so that every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : kDrainSignals) sigaddset(&signals, s);
  for (int s : kIgnoredSignals) sigaddset(&signals, s);
  for (int s = SIGRTMIN; s <= SIGRTMAX; ++s) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  // Fixed malloc thresholds: heaps give back free tops past 4 MiB, and only
  // buffers of 32 MiB and more are mapped one by one. glibc's default raises
  // the trim threshold after the first large free, after which freed message
  // buffers and pages stay in the process (docs/OPERATIONS.md).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 4 << 20);
  // Two malloc arenas unless MALLOC_ARENA_MAX says otherwise: glibc's default
  // of eight per core leaves each thread that ever allocated its own heap,
  // and their fragments kept 12-17 MiB resident after a load that had freed
  // everything (2 arenas: 7 MiB, with the same calls per second).
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, 2);
  google::protobuf::SetLogHandler(&DropProtobufLog);
  turbokv::RouteGrpcLog();
  // Every connection, stream and file takes a descriptor: the soft limit
  // (1024 under systemd and most shells) is raised to the hard one, so that
  // a thousand idle connections cannot stop the listeners accepting.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const rlim_t soft = files.rlim_cur;
    if (files.rlim_max == RLIM_INFINITY) {
      // No descriptor limit may pass the kernel's fs.nr_open.
      unsigned long long nr_open = 1 << 20;
      if (FILE* f = std::fopen("/proc/sys/fs/nr_open", "r")) {
        if (std::fscanf(f, "%llu", &nr_open) != 1) nr_open = 1 << 20;
        std::fclose(f);
      }
      files.rlim_max = static_cast<rlim_t>(nr_open);
    }
    files.rlim_cur = files.rlim_max;
    if (soft == files.rlim_max) {
      Logf(LogLevel::kInfo, "open files: up to %llu (the hard limit)", static_cast<unsigned long long>(soft));
    } else if (setrlimit(RLIMIT_NOFILE, &files) == 0) {
      Logf(LogLevel::kInfo, "open files: soft limit raised from %llu to the hard limit, %llu",
           static_cast<unsigned long long>(soft), static_cast<unsigned long long>(files.rlim_max));
    } else {
      Logf(LogLevel::kWarning, "open files: the soft limit stays %llu (raising it to %llu failed: %s)",
           static_cast<unsigned long long>(soft), static_cast<unsigned long long>(files.rlim_max),
           std::strerror(errno));
    }
  }

  absl::StatusOr<std::unique_ptr<turbokv::Server>> server = turbokv::Server::Create(options);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  Logf(LogLevel::kInfo, "device %s (%s)", (*server)->device().c_str(), (*server)->device_reason().c_str());
  // Start fails on the machine (a port in use, a folder it cannot write),
  // not on the flags: logged, exit status 2 as for bad flags.
  if (absl::Status status = (*server)->Start(); !status.ok()) {
    Log(LogLevel::kError, absl::StrCat("cannot start: ", status.message()));
    return 2;
  }
  if (!options.snapshot_dir.empty()) {
    const turbokv::SnapshotReport& loaded = (*server)->loaded();
    Logf(LogLevel::kInfo, "loaded %lld session(s), %s, from %s", static_cast<long long>(loaded.sessions),
                 turbokv::FormatByteSize(static_cast<size_t>(loaded.bytes)).c_str(), options.snapshot_dir.c_str());
    for (const auto& [id, status] : loaded.failed) {
      Logf(LogLevel::kWarning, "session %s not restored (%s): %s", id.c_str(),
                   absl::StatusCodeToString(status.code()).c_str(), std::string(status.message()).c_str());
    }
    if (!loaded.unverified.empty()) {
      Logf(LogLevel::kWarning,
                   "%zu session(s) restored from files not proven to be their last state (no "
                   "MANIFEST: the last run did not finish its drain); they may be older than what clients last "
                   "wrote: %s",
                   loaded.unverified.size(), absl::StrJoin(loaded.unverified, ", ").c_str());
    }
  }
  if (!options.tiers.spill_dir.empty()) {
    const turbokv::TierScanReport& spilled = (*server)->spilled();
    Logf(LogLevel::kInfo,
                 "spill tier %s (budget %s): %lld session(s) restored, %s of live records; %lld record(s) "
                 "read, %lld torn or failing their CRC (skipped)",
                 options.tiers.spill_dir.c_str(), turbokv::FormatByteSize(options.tiers.spill_budget).c_str(),
                 static_cast<long long>(spilled.loaded), turbokv::FormatByteSize(static_cast<size_t>(spilled.bytes)).c_str(),
                 static_cast<long long>(spilled.records), static_cast<long long>(spilled.torn));
    for (const auto& [id, status] : spilled.damaged) {
      Logf(LogLevel::kWarning, "session %s not restored from the spill tier (%s): %s", id.c_str(),
                   absl::StatusCodeToString(status.code()).c_str(), std::string(status.message()).c_str());
    }
  }
  Logf(LogLevel::kInfo, "memory budget %s, eviction %s, session ttl %s, max message %s",
       turbokv::FormatByteSize((*server)->memory_budget()), options.eviction == turbokv::EvictionPolicy::kLru ? "lru" : "reject",
       options.session_ttl == absl::ZeroDuration() ? "none" : absl::FormatDuration(options.session_ttl),
       turbokv::FormatByteSize(options.max_message_bytes));
  Logf(LogLevel::kInfo, "listening on %s", absl::StrJoin((*server)->endpoints(), ", "));
  if ((*server)->metrics_endpoint().empty()) {
    Logf(LogLevel::kInfo, "no metrics (--metrics-listen is empty)");
  } else {
    Logf(LogLevel::kInfo, "metrics on %s", (*server)->metrics_endpoint());
  }
  if ((*server)->shared_memory() != nullptr) {
    Logf(LogLevel::kInfo, "shared memory for co-located clients on %s", (*server)->shared_memory()->socket_path());
  }
  if ((*server)->health_endpoint().empty()) {
    Logf(LogLevel::kInfo, "no health-only listener (--health-listen): probes use the listeners above");
  } else {
    Logf(LogLevel::kInfo, "health-only listener (grpc.health.v1, nothing else) on %s", (*server)->health_endpoint());
  }
  Logf(LogLevel::kInfo, "authentication %s, TCP %s",
       options.auth_tokens_file.empty() ? "off" : "bearer tokens from " + options.auth_tokens_file,
       options.tls_cert.empty() ? "plaintext" : options.tls_client_ca.empty() ? "TLS" : "mTLS");

  int signal = 0;
  for (;;) {
    sigwait(&signals, &signal);
    if (std::find(std::begin(kDrainSignals), std::end(kDrainSignals), signal) != std::end(kDrainSignals)) break;
    Logf(LogLevel::kWarning, "%s ignored (SIGTERM, SIGINT, SIGQUIT and SIGHUP drain and stop)",
                 SignalName(signal).c_str());
  }
  Logf(LogLevel::kInfo, "%s, draining (calls get %s, snapshots %s more)", SignalName(signal).c_str(),
               absl::FormatDuration(shutdown_deadline).c_str(), absl::FormatDuration(snapshot_deadline).c_str());
  const absl::Status stopped = (*server)->Shutdown(shutdown_deadline, snapshot_deadline);
  if (!stopped.ok()) {
    Logf(LogLevel::kError, "stopped with an error: %s", std::string(stopped.message()).c_str());
  } else {
    Logf(LogLevel::kInfo, "stopped");
  }
  // The drain has written and synced everything it owes (snapshots, the
  // spill tier). What the destructors have left is freeing memory, and the
  // gRPC server's teardown, which after a drain that cancelled calls was
  // seen to wait 8.8 s more (one run in about ten): the process ends here.
  std::fflush(stderr);
  std::_Exit(stopped.ok() ? 0 : 1);
}
