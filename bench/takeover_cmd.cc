// turbokv-bench takeover: the Redis tier, on a redis-server (with --cluster
// N, a Redis Cluster of N masters on loopback ports) and turbokvd daemons
// this command starts itself, in a temp dir.
//  (1) A session appended on daemon A is handed over (A gets SIGTERM) and a
//      fresh daemon B takes it over: the time from B's first call naming it
//      (OpenSession) through the first Attend, which brings every layer into
//      memory, in MB/s of the session's pages (GetSession's bytes_used).
//  (2) The same page values read with plain GETs in the same run: pipelined
//      over one connection and over four in parallel, and over as many
//      connections as the daemon has threads (how its promotion reads: 32
//      pages of a layer per round trip, layers in parallel on its kernel
//      pool).
//  (3) Step latency on a session in memory while Redis answers, while it is
//      paused (CLIENT PAUSE ALL) and while it is stopped (SIGSTOP). With
//      --acknowledge written (the daemon's default) a Step answers once
//      Redis holds its token, so Steps are refused while Redis is paused or
//      stopped: how long a refusal takes; with queued, they go on.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "bench/cli.h"
#include "bench/prefill.h"
#include "client/cpp/client.h"
#include "service/store/tiers/redis_client.h"
#include "service/text_file.h"

namespace turbokv::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kRedisServer[] = "/usr/bin/redis-server";
constexpr int kPipelineDepth = 32;       // GETs per round trip in the pipelined reads
constexpr int kParallelConnections = 4;  // the pipelined read over several (the JSON's "4conn")

int Fail(const std::string& message) {
  std::fprintf(stderr, "turbokv-bench takeover: %s\n", message.c_str());
  return 1;
}

// A child process, its stdout and stderr in `log`; killed (SIGKILL) if it
// is still running when this goes.
class Child {
 public:
  Child(std::string name, std::vector<std::string> argv, std::string log) : name_(std::move(name)), log_(std::move(log)) {
    std::vector<char*> args;
    for (std::string& arg : argv) args.push_back(arg.data());
    args.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  void Signal(int signal) const { kill(pid_, signal); }
  // Its exit status once it has ended, or -1 when a signal ended it.
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  const std::string& name() const { return name_; }
  std::string Log() const { return ReadTextFile(log_).value_or(""); }
  // The end of its log, for an error message.
  std::string LogTail() const {
    const std::string log = Log();
    return log.size() <= 3000 ? log : log.substr(log.size() - 3000);
  }

 private:
  std::string name_;
  std::string log_;
  pid_t pid_ = -1;
};

// A redis-server on a unix socket (no persistence), or a Redis Cluster of
// `masters` on loopback ports, and the turbokvd daemons started on it, in a
// temp dir removed with it.
class Rig {
 public:
  // Daemons acknowledge appends as --redis-acknowledge=`acknowledge`.
  static absl::StatusOr<std::unique_ptr<Rig>> Start(long long threads, const std::string& acknowledge, int masters) {
    char dir[] = "/tmp/turbokv-bench-takeover-XXXXXX";
    if (mkdtemp(dir) == nullptr) return absl::InternalError("cannot make a temp dir");
    std::unique_ptr<Rig> rig(new Rig(dir, threads));
    rig->acknowledge_ = acknowledge;
    if (masters == 0) {
      rig->redis_.push_back(std::make_unique<Child>(
          "redis-server",
          std::vector<std::string>{kRedisServer, "--port", "0", "--unixsocket", rig->dir_ + "/redis.sock",
                                   "--unixsocketperm", "700", "--dir", rig->dir_, "--save", "", "--appendonly", "no"},
          rig->dir_ + "/redis.log"));
      rig->url_ = "unix://" + rig->dir_ + "/redis.sock";
    } else {
      std::vector<std::string> nodes;
      for (int i = 0; i < masters; ++i) {
        const int port = ClusterPort(nodes);
        const std::string node_dir = absl::StrCat(rig->dir_, "/", port);
        mkdir(node_dir.c_str(), 0700);
        rig->redis_.push_back(std::make_unique<Child>(
            absl::StrCat("redis-server ", port),
            std::vector<std::string>{kRedisServer, "--port", std::to_string(port), "--bind", "127.0.0.1",
                                     "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir",
                                     node_dir, "--save", "", "--appendonly", "no"},
            node_dir + "/redis.log"));
        nodes.push_back(absl::StrCat("127.0.0.1:", port));
      }
      rig->url_ = "redis://" + absl::StrJoin(nodes, ",");
      for (const std::string& node : nodes) {
        RedisNodeConnection one(*ParseRedisUrl("redis://" + node), absl::Seconds(1));
        for (int i = 0; i < 400 && !one.Run(std::vector<std::string>{"PING"}).ok(); ++i) {
          absl::SleepFor(absl::Milliseconds(25));
        }
      }
      const std::string create = absl::StrCat("redis-cli --cluster create ", absl::StrJoin(nodes, " "),
                                              " --cluster-yes >", rig->dir_, "/create.log 2>&1");
      if (std::system(create.c_str()) != 0) {
        return absl::UnavailableError("redis-cli --cluster create failed: " +
                                      ReadTextFile(rig->dir_ + "/create.log").value_or(""));
      }
    }
    rig->address_ = *ParseRedisUrl(rig->url_);
    rig->control_ = std::make_unique<RedisConnection>(rig->address_, absl::Seconds(10));
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<std::vector<RedisConnection::NodeReplies>> info =
          rig->control_->RunOnEveryNode({{"CLUSTER", "INFO"}});
      // Standalone: CLUSTER INFO is an error reply, and Redis answers.
      if (info.ok() && (masters == 0 || (static_cast<int>(info->size()) == masters &&
                                         std::all_of(info->begin(), info->end(), [](const auto& node) {
                                           return node.replies.ok() &&
                                                  absl::StrContains((*node.replies)[0].str, "cluster_state:ok");
                                         })))) {
        return rig;
      }
      absl::SleepFor(absl::Milliseconds(25));
    }
    return absl::UnavailableError("Redis did not start: " + rig->redis_[0]->LogTail());
  }
  ~Rig() {
    // Every process ends before the dir goes.
    daemons_.clear();
    for (const std::unique_ptr<Child>& redis : redis_) {
      redis->Signal(SIGKILL);
      redis->Wait();
    }
    std::system(("rm -rf " + dir_).c_str());
  }

  // turbokvd NAME on the Redis, with the default --redis-timeout (1s) and
  // --redis-lease, serving; null (its log's end on stderr) if it is not.
  std::unique_ptr<Client> StartDaemon(const std::string& name, Child** daemon) {
    const std::string socket = "unix://" + dir_ + "/" + name + ".sock";
    daemons_.push_back(std::make_unique<Child>(
        name,
        std::vector<std::string>{TURBOKVD_PATH, "--listen=" + socket, "--device=cpu",
                                 absl::StrCat("--threads=", threads_), "--metrics-listen=", "--redis-url=" + url_,
                                 "--redis-timeout=1s", "--redis-acknowledge=" + acknowledge_},
        dir_ + "/" + name + ".log"));
    *daemon = daemons_.back().get();
    ClientOptions options;
    options.timeout = absl::Seconds(120);
    std::unique_ptr<Client> client = Client::Connect(socket, options);
    if (client->WaitUntilServing(absl::Seconds(20)).ok()) return client;
    Fail("turbokvd " + name + " did not start: " + (*daemon)->LogTail());
    return nullptr;
  }

  // A command on every master; false when one did not answer.
  bool OnEveryNode(std::vector<std::string> command) {
    absl::StatusOr<std::vector<RedisConnection::NodeReplies>> replies = control_->RunOnEveryNode({std::move(command)});
    return replies.ok() && std::all_of(replies->begin(), replies->end(), [](const auto& node) {
             return node.replies.ok() && (*node.replies)[0].type != RedisValue::kError;
           });
  }

  // A field of INFO SECTION (summed over the masters when a number), or "".
  std::string Info(const std::string& section, const std::string& field) {
    absl::StatusOr<std::vector<RedisConnection::NodeReplies>> replies = control_->RunOnEveryNode({{"INFO", section}});
    if (!replies.ok()) return "";
    std::string text;
    int64_t sum = 0;
    bool numbers = true, found = false;
    for (const auto& node : *replies) {
      if (!node.replies.ok()) continue;
      for (absl::string_view line : absl::StrSplit((*node.replies)[0].str, "\r\n")) {
        if (!absl::ConsumePrefix(&line, field + ":")) continue;
        int64_t value = 0;
        found = true;
        numbers = numbers && absl::SimpleAtoi(line, &value);
        sum += value;
        text = std::string(line);
      }
    }
    return found && numbers && replies->size() > 1 ? std::to_string(sum) : text;
  }
  int64_t UsedMemory() {
    int64_t bytes = 0;
    return absl::SimpleAtoi(Info("memory", "used_memory"), &bytes) ? bytes : 0;
  }

  // The page keys of one session (every key of a session is in its slot:
  // one master's).
  absl::StatusOr<std::vector<std::string>> PageKeys(const std::string& id) {
    std::vector<std::string> keys;
    absl::StatusOr<std::vector<RedisConnection::NodeReplies>> nodes =
        control_->RunOnEveryNode({{"KEYS", absl::StrCat("turbokv:{", id, "}:*:p:*")}});
    if (!nodes.ok()) return nodes.status();
    for (const auto& node : *nodes) {
      if (!node.replies.ok()) return node.replies.status();
      for (const RedisValue& key : (*node.replies)[0].elements) keys.push_back(key.str);
    }
    return keys;
  }

  // Until Redis answers again, and a daemon's writer has had a moment to
  // send what waited.
  void Settle() {
    for (int i = 0; i < 400 && !OnEveryNode({"PING"}); ++i) absl::SleepFor(absl::Milliseconds(25));
    absl::SleepFor(absl::Milliseconds(500));
  }

  // The warnings and errors the daemons logged, on stderr.
  void ShowLogs() const {
    for (const std::unique_ptr<Child>& daemon : daemons_) {
      for (absl::string_view line : absl::StrSplit(daemon->Log(), '\n')) {
        if (absl::StrContains(line, " WARNING ") || absl::StrContains(line, " ERROR ")) {
          std::fprintf(stderr, "turbokvd %s: %s\n", daemon->name().c_str(), std::string(line).c_str());
        }
      }
    }
  }

  const RedisAddress& address() const { return address_; }
  // Every redis-server process.
  void SignalRedis(int signal) const {
    for (const std::unique_ptr<Child>& redis : redis_) redis->Signal(signal);
  }

 private:
  Rig(std::string dir, long long threads) : dir_(std::move(dir)), threads_(threads) {}

  // A loopback port for a cluster node, its bus port (10000 above) free
  // too, not among `taken`.
  static int ClusterPort(const std::vector<std::string>& taken) {
    std::mt19937 rng(static_cast<unsigned>(getpid()));
    for (;;) {
      const int port = 20000 + static_cast<int>(rng() % 30000);
      if (std::find(taken.begin(), taken.end(), absl::StrCat("127.0.0.1:", port)) != taken.end()) continue;
      bool free = true;
      for (int p : {port, port + 10000}) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in address = {};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        address.sin_port = htons(static_cast<uint16_t>(p));
        free = free && bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
        close(fd);
      }
      if (free) return port;
    }
  }

  const std::string dir_;
  std::string url_;
  const long long threads_;
  std::vector<std::unique_ptr<Child>> redis_;
  std::string acknowledge_;
  RedisAddress address_;
  std::unique_ptr<RedisConnection> control_;
  std::vector<std::unique_ptr<Child>> daemons_;
};

std::string CpuModel() {
  for (absl::string_view line : absl::StrSplit(ReadTextFile("/proc/cpuinfo").value_or(""), '\n')) {
    if (absl::ConsumePrefix(&line, "model name")) {
      return std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
    }
  }
  return "unknown CPU";
}

struct Fetched {
  int64_t bytes = 0;
  int64_t largest = 0;  // the largest value
  double seconds = 0;
};

// GETs of every key on `connections` connections at once, each its share
// (every n-th key), `depth` GETs per round trip; each connection answers a
// PING before the clock starts.
absl::StatusOr<Fetched> FetchAll(const RedisAddress& address, const std::vector<std::string>& keys, int connections,
                                 int depth) {
  std::vector<std::unique_ptr<RedisConnection>> pool;
  for (int c = 0; c < connections; ++c) {
    pool.push_back(std::make_unique<RedisConnection>(address, absl::Seconds(10)));
    absl::StatusOr<RedisValue> pong = pool.back()->Run({"PING"});
    if (!pong.ok()) return pong.status();
  }
  std::vector<Fetched> fetched(connections);
  std::vector<absl::Status> status(connections);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back([&, c] {
      while (!go.load()) {
      }
      std::vector<std::vector<std::string>> batch;
      for (size_t i = c; i < keys.size() && status[c].ok(); i += connections) {
        batch.push_back({"GET", keys[i]});
        if (batch.size() < static_cast<size_t>(depth) && i + connections < keys.size()) continue;
        absl::StatusOr<std::vector<RedisValue>> replies = pool[c]->Run(batch);
        batch.clear();
        if (!replies.ok()) {
          status[c] = replies.status();
          break;
        }
        for (const RedisValue& value : *replies) {
          if (value.type != RedisValue::kString) status[c] = absl::DataLossError("a page key without its value");
          fetched[c].bytes += static_cast<int64_t>(value.str.size());
          fetched[c].largest = std::max<int64_t>(fetched[c].largest, static_cast<int64_t>(value.str.size()));
        }
      }
    });
  }
  const auto start = Clock::now();
  go.store(true);
  for (std::thread& t : threads) t.join();
  Fetched total;
  total.seconds = Seconds(start);
  for (int c = 0; c < connections; ++c) {
    if (!status[c].ok()) return status[c];
    total.bytes += fetched[c].bytes;
    total.largest = std::max(total.largest, fetched[c].largest);
  }
  return total;
}

// One repeat of (1) and (2).
struct Run {
  double prefill_s, handover_s, claim_s, promote_s, takeover_s, takeover_mb_s;
  double get_one_mb_s, get_parallel_mb_s, get_as_promotion_mb_s;
  int64_t used_memory_delta;  // Redis's used_memory after the handover less before A started
};

template <typename T>
double Median(const std::vector<Run>& runs, T Run::*field) {
  std::vector<double> values;
  for (const Run& run : runs) values.push_back(static_cast<double>(run.*field));
  return Percentile(values, 0.5);
}

// Step calls, one token of `token_values` keys and values each on layer 0,
// for `seconds`.
struct Window {
  std::vector<double> us;  // the Steps that succeeded
  std::vector<double> refused_us;  // those that did not
  int errors = 0;
  std::string first_error;
};
Window Steps(const Session& session, long long seconds, size_t token_values, const std::vector<float>& query,
             int64_t* position, std::mt19937* rng) {
  std::normal_distribution<float> normal;
  std::vector<float> key(token_values), value(token_values);
  Window window;
  for (const auto end = Clock::now() + std::chrono::seconds(seconds); Clock::now() < end;) {
    for (float& x : key) x = normal(*rng);
    for (float& x : value) x = normal(*rng);
    const auto start = Clock::now();
    absl::StatusOr<StepResult> step =
        session.Step(0, *position, TensorData::F32(key), TensorData::F32(value), TensorData::F32(query));
    if (step.ok()) {
      window.us.push_back(Micros(start));
      *position = step->tokens;
    } else {
      window.refused_us.push_back(Micros(start));
      if (window.errors++ == 0) window.first_error = std::string(step.status().message());
    }
  }
  return window;
}

}  // namespace

int RunTakeover(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv,
                     {"layers", "tokens", "kv-heads", "q-heads", "head-dim", "threads", "repeats", "seconds",
                      "acknowledge", "cluster"},
                     {"json"}, &error)) {
    return UsageError(error);
  }
  const std::string acknowledge = options.Get("acknowledge", "written");
  if (acknowledge != "written" && acknowledge != "queued") {
    return UsageError("--acknowledge must be written or queued, got \"" + acknowledge + "\"");
  }
  const bool refused_while_down = acknowledge == "written";
  long long layers, tokens, kv_heads, q_heads, head_dim, threads, repeats, seconds, masters = 0;
  if (options.Has("cluster") && (!options.GetInt("cluster", 3, &masters, &error) || masters < 3 || masters > 16)) {
    return UsageError(error.empty() ? "--cluster: the masters of a Redis Cluster, 3 to 16" : error);
  }
  if (!options.GetInt("layers", 32, &layers, &error) || !options.GetInt("tokens", 8192, &tokens, &error) ||
      !options.GetInt("kv-heads", 8, &kv_heads, &error) || !options.GetInt("q-heads", 32, &q_heads, &error) ||
      !options.GetInt("head-dim", 128, &head_dim, &error) || !options.GetInt("threads", 2, &threads, &error) ||
      !options.GetInt("repeats", 3, &repeats, &error) || !options.GetInt("seconds", 3, &seconds, &error)) {
    return UsageError(error);
  }
  if (access(kRedisServer, X_OK) != 0) return Fail(absl::StrCat(kRedisServer, " is not installed (make deps installs it)"));
  if (access(TURBOKVD_PATH, X_OK) != 0) return Fail(absl::StrCat(TURBOKVD_PATH, " is not built (make turbokvd)"));
  absl::StatusOr<std::unique_ptr<Rig>> started = Rig::Start(threads, acknowledge, static_cast<int>(masters));
  if (!started.ok()) return Fail(std::string(started.status().message()));
  Rig& cluster = **started;
  const std::string redis_version = cluster.Info("server", "redis_version");
  const std::string redis_kind =
      masters == 0 ? absl::StrCat("redis-server ", redis_version, " on a unix socket")
                   : absl::StrCat("a Redis Cluster of ", masters, " masters (redis-server ", redis_version,
                                  ") on loopback TCP");

  SessionOptions session_options;
  session_options.layers = static_cast<int>(layers);
  session_options.kv_heads = static_cast<int>(kv_heads);
  session_options.q_heads = static_cast<int>(q_heads);
  session_options.head_dim = static_cast<int>(head_dim);
  session_options.key_codec = session_options.value_codec = v1::CODEC_TURBO3;
  const Shape shape{tokens, kv_heads, q_heads, head_dim, layers, threads, DefaultChunk(layers, kv_heads, head_dim)};
  constexpr size_t kSlack = size_t{1} << 20;
  std::mt19937 rng(1);
  const std::vector<uint16_t> pool = Fp16Pool(shape, kSlack, &rng);
  std::vector<float> query(static_cast<size_t>(q_heads) * head_dim);
  std::normal_distribution<float> normal;
  for (float& x : query) x = normal(rng);

  // (1) and (2), each repeat on a fresh A, session and B.
  std::vector<Run> runs;
  int64_t session_bytes = 0, page_keys = 0, page_value_bytes = 0, redis_page_bytes = 0;
  std::string device;
  Child* b = nullptr;            // the last repeat's B
  std::optional<Session> taken;  // its session, in memory
  for (long long r = 1; r <= repeats; ++r) {
    Run run;
    const int64_t used_before = cluster.UsedMemory();
    Child* a = nullptr;
    std::unique_ptr<Client> client_a = cluster.StartDaemon(absl::StrCat("A", r), &a);
    if (client_a == nullptr) return 1;
    absl::StatusOr<Session> session = client_a->CreateSession(session_options);
    if (!session.ok()) return Fail(absl::StrCat("CreateSession: ", session.status().message()));
    const std::string id = session->id();
    run.prefill_s = Prefill(*session, shape, pool, kSlack, static_cast<uint64_t>(r));
    if (run.prefill_s < 0) return Fail("the prefill failed: " + a->LogTail());
    std::fprintf(stderr, "takeover %lld/%lld: %lld tokens x %lld layers appended on %s in %.1f s\n", r, repeats, tokens,
                 layers, a->name().c_str(), run.prefill_s);
    // The handover: SIGTERM until A has exited.
    auto clock = Clock::now();
    a->Signal(SIGTERM);
    const int drained = a->Wait();
    run.handover_s = Seconds(clock);
    if (drained != 0) return Fail(absl::StrCat(a->name(), "'s drain exited ", drained, ": ", a->LogTail()));
    run.used_memory_delta = cluster.UsedMemory() - used_before;

    // The same values read with GETs, while nothing else uses Redis.
    absl::StatusOr<std::vector<std::string>> keys = cluster.PageKeys(id);
    if (!keys.ok() || keys->empty()) return Fail("no page keys of the session in Redis");
    absl::StatusOr<Fetched> one = FetchAll(cluster.address(), *keys, 1, kPipelineDepth);
    absl::StatusOr<Fetched> parallel = FetchAll(cluster.address(), *keys, kParallelConnections, kPipelineDepth);
    absl::StatusOr<Fetched> as_promotion = FetchAll(cluster.address(), *keys, static_cast<int>(threads), kPipelineDepth);
    for (const auto* fetched : {&one, &parallel, &as_promotion}) {
      if (!fetched->ok()) return Fail(absl::StrCat("GET: ", fetched->status().message()));
    }
    run.get_one_mb_s = one->bytes / one->seconds / 1e6;
    run.get_parallel_mb_s = parallel->bytes / parallel->seconds / 1e6;
    run.get_as_promotion_mb_s = as_promotion->bytes / as_promotion->seconds / 1e6;
    page_keys = static_cast<int64_t>(keys->size());
    page_value_bytes = one->largest;
    redis_page_bytes = one->bytes;

    // The takeover: OpenSession claims it, the first Attend promotes it.
    Child* fresh = nullptr;
    std::unique_ptr<Client> client = cluster.StartDaemon(absl::StrCat("B", r), &fresh);
    if (client == nullptr) return 1;
    clock = Clock::now();
    absl::StatusOr<Session> opened = client->OpenSession(id);
    run.claim_s = Seconds(clock);
    if (!opened.ok()) return Fail(absl::StrCat("OpenSession on ", fresh->name(), ": ", opened.status().message()));
    absl::StatusOr<Attention> attended = opened->Attend(0, TensorData::F32(query));
    run.takeover_s = Seconds(clock);
    run.promote_s = run.takeover_s - run.claim_s;
    if (!attended.ok()) return Fail(absl::StrCat("Attend on ", fresh->name(), ": ", attended.status().message()));
    absl::StatusOr<v1::SessionInfo> held = opened->Info();
    if (!held.ok() || held->residency() != v1::RESIDENCY_MEMORY_AND_DISK || held->layer_tokens(layers - 1) != tokens) {
      return Fail(absl::StrCat("the session on ", fresh->name(), " is not in memory with its ", tokens, " tokens"));
    }
    session_bytes = held->bytes_used();
    run.takeover_mb_s = session_bytes / run.takeover_s / 1e6;
    std::fprintf(stderr,
                 "takeover %lld/%lld: %.1f MB handed over in %.2f s, taken over by %s in %.3f s (claim %.3f s, "
                 "promotion %.3f s)\n",
                 r, repeats, session_bytes / 1e6, run.handover_s, fresh->name().c_str(), run.takeover_s, run.claim_s,
                 run.promote_s);
    runs.push_back(run);
    if (r < repeats) {
      // B hands it over in turn; Redis is emptied for the next repeat.
      fresh->Signal(SIGTERM);
      if (const int rc = fresh->Wait(); rc != 0) return Fail(absl::StrCat(fresh->name(), "'s drain exited ", rc));
      if (!cluster.OnEveryNode({"FLUSHALL"})) return Fail("FLUSHALL was not answered");
    } else {
      absl::StatusOr<v1::StatsResponse> stats = client->Stats();
      device = stats.ok() ? stats->device() : "";
      b = fresh;
      taken = *std::move(opened);
    }
  }

  // (3) Steps on the session B holds in memory: Redis answering, paused
  // for the window, stopped for the window. Each window starts from the
  // session's length (Truncate), so that none attends over more tokens.
  const size_t token_values = static_cast<size_t>(kv_heads) * head_dim;
  int64_t position = 0;
  auto rewind = [&] {
    // Once Redis answers again: a daemon that acknowledges once written
    // takes the cut only then (and may find out that Redis is back a
    // moment later).
    cluster.Settle();
    position = tokens;
    bool truncated = taken->Truncate(tokens).ok();
    for (int i = 0; i < 50 && !truncated; ++i) {
      absl::SleepFor(absl::Milliseconds(100));
      truncated = taken->Truncate(tokens).ok();
    }
    return truncated;
  };
  if (!rewind()) return Fail("Truncate failed");
  const Window answering = Steps(*taken, seconds, token_values, query, &position, &rng);
  if (!rewind()) return Fail("Truncate failed");
  // Paused past the window by a call's timeout (1s) and more: a write sent
  // in its last moment is not answered once the pause ends.
  if (!cluster.OnEveryNode({"CLIENT", "PAUSE", std::to_string(seconds * 1000 + 2500), "ALL"})) {
    return Fail("CLIENT PAUSE was refused");
  }
  const Window paused = Steps(*taken, seconds, token_values, query, &position, &rng);
  if (!rewind()) return Fail("Truncate failed");
  cluster.SignalRedis(SIGSTOP);
  const Window stopped = Steps(*taken, seconds, token_values, query, &position, &rng);
  cluster.SignalRedis(SIGCONT);
  if (!rewind()) return Fail("Truncate failed");  // the daemon's tier is up again: the drain finds it so
  b->Signal(SIGTERM);
  const int b_drained = b->Wait();
  cluster.ShowLogs();
  if (answering.us.empty()) return Fail("no Step succeeded with Redis answering: " + answering.first_error);
  for (const Window* window : {&paused, &stopped}) {
    // Acknowledged once written, every Step is refused; once queued, none.
    if (refused_while_down ? !window->us.empty() : window->us.empty()) {
      return Fail(absl::StrCat("with --acknowledge ", acknowledge, ", ", window->us.size(), " Steps succeeded and ",
                               window->errors, " failed while Redis was paused or stopped: ", window->first_error));
    }
  }

  const double takeover_mb_s = Median(runs, &Run::takeover_mb_s), get_one = Median(runs, &Run::get_one_mb_s),
               get_parallel = Median(runs, &Run::get_parallel_mb_s),
               get_as_promotion = Median(runs, &Run::get_as_promotion_mb_s);
  // While Redis is paused or stopped: the Steps' p99 when they go on
  // (queued), the refusals' when they do not (written).
  auto p99_down = [&](const Window& w) { return Percentile(refused_while_down ? w.refused_us : w.us, 0.99); };
  const double p99_answering = Percentile(answering.us, 0.99), p99_paused = p99_down(paused),
               p99_stopped = p99_down(stopped);
  const std::string machine = absl::StrCat(CpuModel(), ", ", std::thread::hardware_concurrency(), " cores");
  if (options.Has("json")) {
    auto window_json = [](const char* name, const Window& w) {
      auto at = [](const std::vector<double>& v, double p) { return v.empty() ? 0.0 : Percentile(v, p); };
      return absl::StrFormat(
          "\"step_%s_calls\": %d, \"step_%s_errors\": %d, \"step_%s_p50_us\": %.1f, \"step_%s_p99_us\": %.1f, "
          "\"step_%s_max_us\": %.1f, \"step_%s_refused_p50_us\": %.1f, \"step_%s_refused_p99_us\": %.1f",
          name, w.us.size(), name, w.errors, name, at(w.us, 0.5), name, at(w.us, 0.99), name, at(w.us, 1.0), name,
          at(w.refused_us, 0.5), name, at(w.refused_us, 0.99));
    };
    auto list = [&](double Run::*field) {
      std::vector<std::string> values;
      for (const Run& run : runs) values.push_back(absl::StrFormat("%.4g", run.*field));
      return "[" + absl::StrJoin(values, ", ") + "]";
    };
    absl::PrintF(
        "{\"machine\": \"%s\", \"daemon_device\": \"%s\", \"redis_version\": \"%s\", \"cluster_masters\": %d, "
        "\"acknowledge\": \"%s\", "
        "\"layers\": %d, \"tokens\": %d, "
        "\"kv_heads\": %d, \"q_heads\": %d, \"head_dim\": %d, \"codec\": \"turbo3\", \"threads\": %d, "
        "\"repeats\": %d, \"session_bytes\": %d, \"redis_page_keys\": %d, \"redis_page_value_bytes\": %d, "
        "\"redis_page_bytes\": %d, \"redis_used_memory_delta_bytes\": %.0f, \"prefill_s\": %s, \"handover_s\": %s, "
        "\"claim_s\": %s, \"promote_s\": %s, \"takeover_s\": %s, \"takeover_s_median\": %.4f, "
        "\"takeover_mb_per_s\": %.1f, \"get_pipelined_1conn_mb_per_s\": %.1f, \"get_pipelined_4conn_mb_per_s\": %.1f, "
        "\"get_as_promotion_mb_per_s\": %.1f, \"get_as_promotion_connections\": %d, \"pipeline_depth\": %d, "
        "\"takeover_mb_per_s_each\": %s, \"get_pipelined_1conn_mb_per_s_each\": %s, "
        "\"get_pipelined_4conn_mb_per_s_each\": %s, \"get_as_promotion_mb_per_s_each\": %s, "
        "\"takeover_over_get_1conn\": %.3f, \"takeover_over_get_4conn\": %.3f, \"takeover_over_get_as_promotion\": %.3f, "
        "\"step_seconds\": %d, %s, %s, %s, \"step_p99_paused_over_answering\": %.3f, "
        "\"step_p99_stopped_over_answering\": %.3f, \"last_drain_exit\": %d}\n",
        machine, device, redis_version, masters, acknowledge, layers, tokens, kv_heads, q_heads, head_dim, threads, repeats, session_bytes,
        page_keys, page_value_bytes, redis_page_bytes, Median(runs, &Run::used_memory_delta), list(&Run::prefill_s),
        list(&Run::handover_s), list(&Run::claim_s), list(&Run::promote_s), list(&Run::takeover_s),
        Median(runs, &Run::takeover_s), takeover_mb_s, get_one, get_parallel, get_as_promotion, threads, kPipelineDepth,
        list(&Run::takeover_mb_s), list(&Run::get_one_mb_s), list(&Run::get_parallel_mb_s),
        list(&Run::get_as_promotion_mb_s),
        takeover_mb_s / get_one, takeover_mb_s / get_parallel, takeover_mb_s / get_as_promotion, seconds,
        window_json("answering", answering), window_json("paused", paused), window_json("stopped", stopped),
        p99_paused / p99_answering, p99_stopped / p99_answering, b_drained);
  } else {
    absl::PrintF("Redis tier takeover: %s; turbokvd %s, --redis-acknowledge=%s; %s\n", machine, device, acknowledge,
                 redis_kind);
    absl::PrintF("a %d-layer, %d-token session (turbo3 keys and values, %d kv heads, %d q heads, d %d): %.1f MB of "
                 "pages (GetSession bytes_used), %d keys of %d bytes in Redis (%.1f MB; used_memory grew %.1f MB); "
                 "median of %d\n\n",
                 layers, tokens, kv_heads, q_heads, head_dim, session_bytes / 1e6, page_keys, page_value_bytes,
                 redis_page_bytes / 1e6, Median(runs, &Run::used_memory_delta) / 1e6, repeats);
    absl::PrintF("| measure | value |\n|---|---:|\n");
    absl::PrintF("| append on A (fp16 in) | %.2f s |\n", Median(runs, &Run::prefill_s));
    absl::PrintF("| handover: A's drain, SIGTERM to exit | %.2f s |\n", Median(runs, &Run::handover_s));
    absl::PrintF("| takeover on B: OpenSession (claim) | %.3f s |\n", Median(runs, &Run::claim_s));
    absl::PrintF("| takeover on B: first Attend (promotion of every layer) | %.3f s |\n", Median(runs, &Run::promote_s));
    absl::PrintF("| takeover on B: OpenSession through the first Attend | %.3f s, %.0f MB/s |\n",
                 Median(runs, &Run::takeover_s), takeover_mb_s);
    absl::PrintF("| GET of the same keys, pipelined (%d per round trip), 1 connection | %.0f MB/s |\n", kPipelineDepth,
                 get_one);
    absl::PrintF("| GET of the same keys, pipelined, %d connections | %.0f MB/s |\n", kParallelConnections,
                 get_parallel);
    absl::PrintF("| GET of the same keys, pipelined, %d connections (as promotion reads) | %.0f MB/s |\n",
                 threads, get_as_promotion);
    auto window_row = [&](const char* what, const Window& w) {
      if (w.us.empty()) {
        absl::PrintF("| Step refused p50 / p99 / max, %s (%d calls: %s) | %.0f / %.0f / %.0f us |\n", what,
                     w.refused_us.size(), w.first_error, Percentile(w.refused_us, 0.5),
                     Percentile(w.refused_us, 0.99), Percentile(w.refused_us, 1.0));
        return;
      }
      const std::string failed = w.errors == 0 ? "" : absl::StrCat(", ", w.errors, " failed: ", w.first_error);
      absl::PrintF("| Step p50 / p99 / max, %s (%d calls%s) | %.0f / %.0f / %.0f us |\n", what, w.us.size(), failed,
                   Percentile(w.us, 0.5), Percentile(w.us, 0.99), Percentile(w.us, 1.0));
    };
    window_row("Redis answering", answering);
    window_row("Redis paused (CLIENT PAUSE ALL)", paused);
    window_row("redis-server stopped (SIGSTOP)", stopped);
    absl::PrintF("\ntakeover / GET: %.2f of 1 connection pipelined, %.2f of %d connections pipelined, %.2f of "
                 "%d connections pipelined as promotion reads\n",
                 takeover_mb_s / get_one, takeover_mb_s / get_parallel, kParallelConnections,
                 takeover_mb_s / get_as_promotion, threads);
    if (refused_while_down) {
      absl::PrintF("Steps refused while Redis is paused / stopped: p99 %.0f / %.0f ms (--redis-timeout 1s)\n",
                   p99_paused / 1e3, p99_stopped / 1e3);
    } else {
      absl::PrintF("Step p99 paused / answering = %.2f, stopped / answering = %.2f (target <= 1.5 for both: %s)\n",
                   p99_paused / p99_answering, p99_stopped / p99_answering,
                   std::max(p99_paused, p99_stopped) <= 1.5 * p99_answering ? "met" : "NOT met");
    }
  }
  if (b_drained != 0) return Fail(absl::StrCat(b->name(), "'s last drain exited ", b_drained));
  return 0;
}

}  // namespace turbokv::bench
