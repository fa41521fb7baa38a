// Redis for the tests of the tiers that use it (redis_test.cc,
// stacked_tier_test.cc): a redis-server of the test's own, the session shape
// and token sequence the tests append, daemons' flags and clients, and what
// a session gives back compared with a memory-only reference.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "service/store/tiers/redis_client.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/daemon_testing.h"

namespace turbokv {

constexpr int kLayers = 2, kKvHeads = 2, kQHeads = 4, kDim = 64;
constexpr char kRedisServer[] = "/usr/bin/redis-server";

#define SKIP_WITHOUT_REDIS() \
  if (!HaveRedis())          \
  GTEST_SKIP() << kRedisServer << " is not installed (make deps installs redis-server)"

inline std::string TempPath(const std::string& name) {
  return absl::StrCat("/tmp/turbokv-redis-test-", getpid(), "-", name);
}

// TLS for a test: a CA, a server certificate it signed for 127.0.0.1, a
// client certificate it signed, and another CA, made with the openssl
// command (PEM files in a directory of the test's own).
struct Certificates {
  std::string dir = TempPath("tls");
  std::string ca = dir + "/ca.crt", other_ca = dir + "/other-ca.crt";
  std::string server_cert = dir + "/server.crt", server_key = dir + "/server.key";
  std::string client_cert = dir + "/client.crt", client_key = dir + "/client.key";
  Certificates() {
    const std::string script =
        absl::StrCat("set -e; rm -rf ", dir, "; mkdir -p ", dir, "; cd ", dir, "\n",
                     "for ca in ca other-ca; do openssl req -x509 -newkey rsa:2048 "
                     "-nodes -days 1 -subj /CN=$ca "
                     "-keyout $ca.key -out $ca.crt; done\n",
                     "echo subjectAltName=IP:127.0.0.1 > server.ext\n",
                     "for who in server client; do openssl req -newkey rsa:2048 -nodes "
                     "-subj /CN=turbokv-$who "
                     "-keyout $who.key -out $who.csr; done\n",
                     "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key "
                     "-CAcreateserial -days 1 -extfile server.ext "
                     "-out server.crt\n",
                     "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key "
                     "-CAcreateserial -days 1 -out client.crt\n");
    EXPECT_EQ(std::system(absl::StrCat("sh -c '", script, "' >/dev/null 2>&1").c_str()),
              0);
  }
};

// Binds `port` on 127.0.0.1 (0: any free one) and lets it go: the port,
// or 0 when it is taken.
inline int BindPort(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  socklen_t size = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
  close(fd);
  return bound ? ntohs(address.sin_port) : 0;
}

// A free TCP port on 127.0.0.1 (for a server that takes no port 0).
inline int FreePort() { return BindPort(0); }

// A free port for a Redis Cluster node, whose cluster bus takes the port
// 10000 above it (so at most 55535), free too.
inline int FreeClusterPort() {
  for (;;) {
    const int port = FreePort();
    if (port <= 55535 && BindPort(port + 10000) != 0) return port;
  }
}

// In a child: execs redis-server with these arguments (they follow the
// binary's path).
[[noreturn]] inline void ExecRedisServer(std::vector<std::string> args) {
  args.insert(args.begin(), kRedisServer);
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  execv(kRedisServer, argv.data());
  _exit(127);
}

// Until the Redis at `address` answers PING (5 s at most; a failure then).
inline void WaitForPing(const RedisAddress& address, const std::string& name) {
  RedisNodeConnection connection(address, absl::Seconds(1));
  for (int i = 0; i < 200; ++i) {
    if (connection.Run(std::vector<std::string>{"PING"}).ok()) return;
    absl::SleepFor(absl::Milliseconds(25));
  }
  ADD_FAILURE() << "redis-server did not start on " << name;
}

inline void KillRedisServer(pid_t* pid) {
  if (*pid <= 0) return;
  kill(*pid, SIGKILL);
  waitpid(*pid, nullptr, 0);
  *pid = -1;
}

// A redis-server of its own on a unix socket, persisted by its append-only
// file unless `persistent` is false (then a restart starts it empty), with
// the eviction policy `policy`, wanting `password` when one is given, and
// with `tls`, serving TLS on 127.0.0.1 too (TlsUrl; client certificates
// required).
class RedisServer {
 public:
  explicit RedisServer(bool persistent = true, std::string policy = "noeviction",
                       std::string password = "", const Certificates* tls = nullptr)
      : socket_(TempPath("redis.sock")),
        dir_(TempPath("redis-data")),
        persistent_(persistent),
        policy_(std::move(policy)),
        password_(std::move(password)),
        tls_(tls),
        tls_port_(tls ? FreePort() : 0) {
    std::system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str());
    Start();
  }
  ~RedisServer() { Kill(); }

  void Start() {
    unlink(socket_.c_str());
    pid_ = fork();
    if (pid_ == 0) {
      const std::string log = TempPath("redis.log");
      // Persisted as docs/OPERATIONS.md asks (appendonly), each write
      // synced, so that a kill -9 of Redis loses nothing.
      std::vector<std::string> args = {"--port", "0", "--unixsocket", socket_, "--unixsocketperm", "700",
                                       "--dir", dir_, "--save", "", "--appendonly", persistent_ ? "yes" : "no",
                                       "--appendfsync", "always", "--maxmemory-policy", policy_, "--logfile", log};
      if (!password_.empty()) args.insert(args.end(), {"--requirepass", password_});
      if (tls_ != nullptr) {
        args.insert(
            args.end(),
            {"--bind", "127.0.0.1", "--tls-port", std::to_string(tls_port_),
             "--tls-cert-file", tls_->server_cert, "--tls-key-file", tls_->server_key,
             "--tls-ca-cert-file", tls_->ca, "--tls-auth-clients", "yes"});
      }
      ExecRedisServer(std::move(args));
    }
    WaitForPing(Address(), socket_);
  }
  void Kill() { KillRedisServer(&pid_); }
  // Sends the server a signal (SIGSTOP and SIGCONT: Redis stopped a while).
  void Signal(int signal) const { kill(pid_, signal); }
  RedisAddress Address() const {
    RedisAddress address = *ParseRedisUrl(Url());
    address.password = password_;
    return address;
  }
  std::string Url() const { return "unix://" + socket_; }
  const std::string& socket_path() const { return socket_; }
  std::string TlsUrl() const { return absl::StrCat("rediss://127.0.0.1:", tls_port_); }
  // One command, on a connection of its own.
  RedisValue Run(std::vector<std::string> command) const {
    RedisConnection connection(Address(), absl::Seconds(2));
    absl::StatusOr<RedisValue> reply = connection.Run(std::move(command));
    EXPECT_TRUE(reply.ok()) << reply.status();
    return reply.ok() ? *reply : RedisValue();
  }

 private:
  std::string socket_;
  std::string dir_;
  bool persistent_;
  std::string policy_;
  std::string password_;
  const Certificates* tls_;
  int tls_port_;
  pid_t pid_ = -1;
};

// A Redis Cluster of its own on loopback TCP ports (free ones): `masters`
// masters with `replicas` replicas each, made by redis-cli --cluster create,
// persisted like RedisServer, a node failed after 1 s without an answer
// (and its replica taking over whatever its replication lag).
class RedisClusterServers {
 public:
  explicit RedisClusterServers(int masters, int replicas = 0) {
    const int count = masters * (1 + replicas);
    for (int i = 0; i < count; ++i) {
      int port = FreeClusterPort();
      while (std::find(ports_.begin(), ports_.end(), port) != ports_.end()) port = FreeClusterPort();
      ports_.push_back(port);
      pids_.push_back(-1);
      const std::string dir = Dir(i);
      std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
      Start(i);
    }
    std::string create = "redis-cli --cluster create";
    for (int port : ports_) absl::StrAppend(&create, " 127.0.0.1:", port);
    absl::StrAppend(&create, " --cluster-replicas ", replicas, " --cluster-yes >/dev/null 2>&1");
    EXPECT_EQ(std::system(create.c_str()), 0) << create;
    EXPECT_TRUE(WaitUntilHealthy(absl::Seconds(20)));
    // Replicas in sync with their masters (or they could not take over).
    for (int node = masters; node < count; ++node) {
      bool synced = false;
      for (absl::Time until = absl::Now() + absl::Seconds(20); !synced && absl::Now() < until;
           absl::SleepFor(absl::Milliseconds(100))) {
        synced = absl::StrContains(Run(node, {"INFO", "replication"}).str, "master_link_status:up");
      }
      EXPECT_TRUE(synced) << "replica 127.0.0.1:" << ports_[node];
    }
  }
  ~RedisClusterServers() {
    for (pid_t& pid : pids_) KillRedisServer(&pid);
  }

  // Starts a node (again after Kill: from its files, a member of the
  // cluster as before).
  void Start(int node) {
    const std::string dir = Dir(node);
    pids_[node] = fork();
    if (pids_[node] == 0) {
      ExecRedisServer({"--port", std::to_string(ports_[node]), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                       "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                       "--cluster-replica-validity-factor", "0", "--dir", dir, "--save", "", "--appendonly", "yes",
                       "--appendfsync", "always", "--maxmemory-policy", "noeviction", "--logfile",
                       dir + "/redis.log"});
    }
    WaitForPing(Address(node), absl::StrCat("127.0.0.1:", ports_[node]));
  }
  void Kill(int node) { KillRedisServer(&pids_[node]); }
  int size() const { return static_cast<int>(ports_.size()); }
  int port(int node) const { return ports_[node]; }
  // One node, or all of them as seeds.
  std::string Url(int node = 0) const { return absl::StrCat("redis://127.0.0.1:", ports_[node]); }
  std::string SeedsUrl() const {
    std::string url = "redis://";
    for (size_t i = 0; i < ports_.size(); ++i) absl::StrAppend(&url, i == 0 ? "" : ",", "127.0.0.1:", ports_[i]);
    return url;
  }
  RedisAddress Address(int node) const { return *ParseRedisUrl(Url(node)); }
  // One command on one node (no redirection followed).
  RedisValue Run(int node, std::vector<std::string> command) const {
    RedisNodeConnection connection(Address(node), absl::Seconds(2));
    absl::StatusOr<RedisValue> reply = connection.Run(std::move(command));
    EXPECT_TRUE(reply.ok()) << reply.status();
    return reply.ok() ? *reply : RedisValue();
  }
  // The node serving `slot` as master now, as `asked` sees it (-1: none).
  int MasterOf(int slot, int asked) const {
    const RedisValue slots = Run(asked, {"CLUSTER", "SLOTS"});
    for (const RedisValue& range : slots.elements) {
      if (range.elements.size() < 3 || slot < range.elements[0].integer || slot > range.elements[1].integer) continue;
      for (int node = 0; node < size(); ++node) {
        if (range.elements[2].elements[1].integer == ports_[node]) return node;
      }
    }
    return -1;
  }
  std::string Id(int node) const { return Run(node, {"CLUSTER", "MYID"}).str; }
  // Until `slot` is served by a master other than `failed` (its replica,
  // promoted) and the cluster is healthy again, as `asked` sees it.
  bool WaitForFailover(int slot, int failed, int asked, absl::Duration limit) const {
    for (absl::Time until = absl::Now() + limit; absl::Now() < until; absl::SleepFor(absl::Milliseconds(100))) {
      const int master = MasterOf(slot, asked);
      if (master >= 0 && master != failed) return WaitUntilHealthy(until - absl::Now());
    }
    return false;
  }
  // Until every live node says the cluster is ok with every slot served.
  bool WaitUntilHealthy(absl::Duration limit) const {
    for (absl::Time until = absl::Now() + limit; absl::Now() < until; absl::SleepFor(absl::Milliseconds(100))) {
      bool healthy = true;
      for (int node = 0; node < size() && healthy; ++node) {
        if (pids_[node] <= 0) continue;
        RedisNodeConnection connection(Address(node), absl::Seconds(1));
        absl::StatusOr<RedisValue> info = connection.Run(std::vector<std::string>{"CLUSTER", "INFO"});
        healthy = info.ok() && absl::StrContains(info->str, "cluster_state:ok") &&
                  absl::StrContains(info->str, "cluster_slots_ok:16384");
      }
      if (healthy) return true;
    }
    return false;
  }

 private:
  std::string Dir(int node) const { return TempPath(absl::StrCat("cluster-", ports_[node])); }

  std::vector<int> ports_;
  std::vector<pid_t> pids_;
};

inline bool HaveRedis() { return access(kRedisServer, X_OK) == 0; }

inline SessionOptions Shape() {
  SessionOptions options;
  options.layers = kLayers;
  options.kv_heads = kKvHeads;
  options.q_heads = kQHeads;
  options.head_dim = kDim;
  options.key_codec = v1::CODEC_TURBO3;
  options.value_codec = v1::CODEC_TURBO4;
  options.rotation_seed = 77;
  return options;
}

// Token t of the test's sequence, every layer: [layers][n][kv_heads][head_dim].
// Tokens a layer of the daemon's 64-token pages holds exact before a chunk
// fits its key transform (LayerStorage::hold_tokens).
constexpr int64_t kHeldTokens = 63;

struct Sequence {
  static constexpr int64_t kTokens = 1024;
  explicit Sequence(uint64_t seed = 11)
      : k(testing::GaussianVectors(kTokens * kKvHeads, kDim, seed)),
        v(testing::GaussianVectors(kTokens * kKvHeads, kDim, seed + 1)) {}
  std::vector<float> k, v;
  std::vector<float> Chunk(const std::vector<float>& from, int64_t start,
                           int64_t n) const {
    std::vector<float> out;
    const size_t row = size_t{kKvHeads} * kDim;
    for (int l = 0; l < kLayers; ++l) {
      for (int64_t t = start; t < start + n; ++t) {
        const size_t at = static_cast<size_t>((t + 31 * l) % kTokens) * row;
        out.insert(out.end(), from.begin() + at, from.begin() + at + row);
      }
    }
    return out;
  }
  absl::StatusOr<int64_t> Append(const Session& session, int64_t start, int64_t n) const {
    return session.AppendAllLayers(start, TensorData::F32(Chunk(k, start, n)),
                                   TensorData::F32(Chunk(v, start, n)));
  }
};

// The length an append reached, or -1 (its error reported).
inline int64_t Appended(const absl::StatusOr<int64_t>& appended) {
  EXPECT_TRUE(appended.ok()) << appended.status();
  return appended.value_or(-1);
}

// One daemon's socket, by name.
inline std::string Socket(const std::string& name) {
  return "unix://" + TempPath(name + ".sock");
}

inline std::vector<std::string> Flags(const std::string& name, const std::string& redis_url,
                                      std::vector<std::string> more = {}) {
  std::vector<std::string> flags = {
      "--listen=" + Socket(name),   "--device=cpu",     "--threads=1",
      "--redis-url=" + redis_url, "--redis-lease=1s", "--redis-timeout=300ms"};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}
inline std::vector<std::string> Flags(const std::string& name, const RedisServer& redis,
                                      std::vector<std::string> more = {}) {
  return Flags(name, redis.Url(), std::move(more));
}

inline std::unique_ptr<Client> Connected(const std::string& name,
                                         const testing::Daemon& daemon,
                                         const ClientOptions& options = {}) {
  auto client = Client::Connect(Socket(name), options);
  EXPECT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  return client;
}

// What a session of this daemon gives for a query at layer 1, and its keys
// and values read back: equal to those of the same tokens appended to a
// session that never left memory.
struct Observed {
  std::vector<float> output, lse, keys, values;
  bool operator==(const Observed& o) const {
    return output == o.output && lse == o.lse && keys == o.keys && values == o.values;
  }
};
inline Observed Observe(const Session& session) {
  Observed seen;
  auto attended =
      session.Attend(1, TensorData::F32(testing::GaussianVectors(kQHeads, kDim, 13)));
  EXPECT_TRUE(attended.ok()) << attended.status();
  if (attended.ok()) {
    seen.output = attended->output;
    seen.lse = attended->lse;
  }
  auto kv = session.ReadKv(0);
  EXPECT_TRUE(kv.ok()) << kv.status();
  if (kv.ok()) {
    seen.keys = kv->keys;
    seen.values = kv->values;
  }
  return seen;
}

// The same tokens in a memory-only daemon.
class Reference {
 public:
  Reference()
      : daemon_({"--listen=" + Socket("reference"), "--device=cpu", "--threads=1"}) {
    client_ = Connected("reference", daemon_);
  }
  // The size of the chunk an observed session appended at a position.
  using Chunks = std::function<int64_t(int64_t)>;
  // The first chunks as the observed session's were (`first` tokens, then
  // next(position) each, by default `first` again), until one takes it past
  // the tokens a layer holds exact (63) and fits each layer's key
  // transform; then the rest.
  Observed Of(const Sequence& sequence, int64_t first, int64_t tokens, Chunks next = nullptr) {
    return Of({{&sequence, tokens}}, first, std::move(next));
  }
  // Tokens from each sequence in turn: the first `until` of one, then the
  // next up to its `until`, ...; the first sequence's tokens go first in
  // chunks as above until one fits the transform (cut back to its `until`
  // when that is shorter: a session truncated after them).
  Observed Of(const std::vector<std::pair<const Sequence*, int64_t>>& parts, int64_t first,
              Chunks next = nullptr) {
    auto session = client_->CreateSession(Shape());
    EXPECT_TRUE(session.ok()) << session.status();
    int64_t fitted = 0;
    for (int64_t size = first; fitted <= kHeldTokens; size = next ? next(fitted) : first) {
      EXPECT_TRUE(parts[0].first->Append(*session, fitted, size).ok());
      fitted += size;
    }
    int64_t at = std::min(fitted, parts[0].second);
    if (at < fitted) {
      EXPECT_TRUE(session->Truncate(at).ok());
    }
    for (const auto& [sequence, until] : parts) {
      if (until > at) {
        EXPECT_TRUE(sequence->Append(*session, at, until - at).ok());
      }
      at = std::max(at, until);
    }
    return Observe(*session);
  }

 private:
  testing::Daemon daemon_;
  std::unique_ptr<Client> client_;
};

// Until the daemon's writer has nothing queued (the metric, refreshed every second).
inline void WaitForWriteThrough(const testing::Daemon& daemon) {
  for (int i = 0; i < 100; ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    const std::string metrics = testing::Scrape(daemon.MetricsAddress());
    if (testing::Sample(metrics, "turbokv_tier_queued_bytes{tier=\"redis\"}") == 0 &&
        testing::Sample(metrics, "turbokv_tier_live_bytes{tier=\"redis\"}") > 0) {
      return;
    }
  }
  ADD_FAILURE() << "the Redis writer never caught up";
}

// The health of the Redis tier, as a Kubernetes probe would ask it.
inline grpc::health::v1::HealthCheckResponse::ServingStatus RemoteTierHealth(
    const std::string& name) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(Socket(name), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("turbokv.RemoteTier");
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.status();
}

// The health of daemon `name`'s Redis tier once it is `wanted`, or as it
// still is after `limit`.
inline grpc::health::v1::HealthCheckResponse::ServingStatus WaitForTierHealth(
    const std::string& name, grpc::health::v1::HealthCheckResponse::ServingStatus wanted,
    absl::Duration limit) {
  grpc::health::v1::HealthCheckResponse::ServingStatus now = RemoteTierHealth(name);
  for (absl::Time until = absl::Now() + limit; now != wanted && absl::Now() < until;
       now = RemoteTierHealth(name)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  return now;
}

// Session `id` opened through `client`, whose daemon claims it from Redis
// once the lease of the daemon that held it lapses (refused until then,
// naming the lease; at most 5 s).
inline absl::StatusOr<Session> OpenedOnceTheLeaseLapses(const Client& client,
                                                        const std::string& id) {
  absl::StatusOr<Session> session = client.OpenSession(id);
  for (absl::Time until = absl::Now() + absl::Seconds(5);
       !session.ok() && absl::Now() < until;) {
    EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition)
        << session.status();
    EXPECT_THAT(session.status().message(), ::testing::HasSubstr("lease"));
    absl::SleepFor(absl::Milliseconds(100));
    session = client.OpenSession(id);
  }
  return session;
}

// A session of `tokens` tokens written on daemon "a" (with `flags`), which
// then drains (SIGTERM) and exits 0: its id, or empty (the failure reported).
inline std::string HandedOver(const RedisServer& redis, const Sequence& sequence,
                              int64_t tokens, const std::vector<std::string>& flags = {},
                              const ClientOptions& options = {}) {
  testing::Daemon a(Flags("a", redis, flags));
  auto client = Connected("a", a, options);
  auto session = client->CreateSession(Shape());
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok() || Appended(sequence.Append(*session, 0, tokens)) != tokens)
    return "";
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  EXPECT_THAT(a.Log(), ::testing::HasSubstr("sessions handed over"));
  return session->id();
}

}  // namespace turbokv
