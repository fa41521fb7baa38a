// The Redis tier in the real turbokvd binary, on a real redis-server
// (Debian's, installed by make deps) started on a unix socket for each test:
// handover on SIGTERM, kill -9 and what it loses, two daemons racing for a
// session, a stale owner refused, tenants kept apart, and Redis paused and
// stopped under load.
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/un.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "service/store/tiers/redis_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/daemon_testing.h"
#include "tests/service/redis_testing.h"

namespace turbokv {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::turbokv::testing::Daemon;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::Sample;
using ::turbokv::testing::Scrape;


// A TCP proxy on 127.0.0.1 to a unix socket, which the test cuts and
// heals. Cut, nothing goes through either way (connections stay open, new
// ones are taken and held): a partition where packets vanish, so that the
// daemon's commands time out. Healed, what waited goes through, late, as
// after a real partition.
class Proxy {
 public:
  explicit Proxy(std::string target) : target_(std::move(target)) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address = {};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(listen(listener_, 64), 0);
    socklen_t size = sizeof(address);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { Loop(); });
  }
  ~Proxy() {
    stop_.store(true);
    thread_.join();
    for (const auto& [a, b] : pairs_) {
      close(a);
      close(b);
    }
    close(listener_);
  }
  std::string Url() const { return absl::StrCat("redis://127.0.0.1:", port_); }
  void Cut() { cut_.store(true); }
  void Heal() { cut_.store(false); }

 private:
  void Loop() {
    while (!stop_.load()) {
      const bool cut = cut_.load();
      std::vector<pollfd> fds = {{listener_, POLLIN, 0}};
      if (!cut) {
        for (const auto& [a, b] : pairs_) {
          fds.push_back({a, POLLIN, 0});
          fds.push_back({b, POLLIN, 0});
        }
      }
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if ((fds[0].revents & POLLIN) != 0) Accept();
      std::vector<bool> closed(pairs_.size(), false);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const size_t pair = (i - 1) / 2;
        if (closed[pair]) continue;
        const int from = fds[i].fd;
        const int to = from == pairs_[pair].first ? pairs_[pair].second : pairs_[pair].first;
        char buffer[65536];
        const ssize_t n = read(from, buffer, sizeof(buffer));
        if (n <= 0 || !WriteAll(to, buffer, static_cast<size_t>(n))) closed[pair] = true;
      }
      for (size_t i = closed.size(); i-- > 0;) {
        if (!closed[i]) continue;
        close(pairs_[i].first);
        close(pairs_[i].second);
        pairs_.erase(pairs_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  }
  void Accept() {
    const int client = accept(listener_, nullptr, nullptr);
    if (client < 0) return;
    const int upstream = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address = {};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, target_.c_str(), sizeof(address.sun_path) - 1);
    if (connect(upstream, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      close(client);
      close(upstream);
      return;
    }
    pairs_.emplace_back(client, upstream);
  }
  static bool WriteAll(int fd, const char* data, size_t n) {
    while (n > 0) {
      const ssize_t written = write(fd, data, n);
      if (written <= 0) return false;
      data += written;
      n -= static_cast<size_t>(written);
    }
    return true;
  }

  const std::string target_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::vector<std::pair<int, int>> pairs_;  // (from the daemon, to Redis); the proxy's thread's only
  std::thread thread_;
};

// SIGTERM hands every session over; kill -9 loses nothing acknowledged
// (by default, appends answer once Redis holds them), or, with
// --redis-acknowledge=queued, the tokens of the last pages not sealed yet.
void HandOverAndKill(const std::vector<std::string>& flags, int64_t kept_after_kill) {
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const std::string id = HandedOver(redis, sequence, 200, flags);  // 3 sealed pages and a tail of 8 in each layer
  ASSERT_FALSE(id.empty());
  {
    // B has never seen the session: the call takes it over, with its tail,
    // and the next position just works.
    Daemon b(Flags("b", redis, flags));
    auto client = Connected("b", b);
    auto session = client->OpenSession(id);
    ASSERT_TRUE(session.ok()) << session.status() << b.Log();
    // Counted before the call was answered, not at the next refresh.
    EXPECT_EQ(Sample(Scrape(b.MetricsAddress()), "turbokv_takeovers_total{result=\"ok\"}"), 1);
    auto info = session->Info();
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layer_tokens(0), 200);
    EXPECT_EQ(info->layer_tokens(1), 200);
    EXPECT_THAT(b.Log(), HasSubstr("taken over from the redis tier"));
    EXPECT_THAT(b.Log(), HasSubstr(absl::StrCat("Redis tier ", redis.Url())));
    EXPECT_THAT(b.Log(), HasSubstr(": answering"));
    ASSERT_EQ(Appended(sequence.Append(*session, 200, 150)), 350);  // sealed up to 320
    EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 200, 350));
    WaitForWriteThrough(b);
    EXPECT_EQ(Sample(Scrape(b.MetricsAddress()), "turbokv_tier_up{tier=\"redis\"}"), 1);
    ASSERT_EQ(kill(b.pid(), SIGKILL), 0);
    b.Wait();
  }
  // The lease of the killed daemon lapses (1 s); then the session is
  // claimed again.
  Daemon c(Flags("c", redis, flags));
  auto client = Connected("c", c);
  absl::StatusOr<Session> session = OpenedOnceTheLeaseLapses(*client, id);
  ASSERT_TRUE(session.ok()) << session.status() << c.Log();
  ASSERT_TRUE(session->Info().ok());
  EXPECT_EQ(session->Info()->layer_tokens(0), kept_after_kill);
  EXPECT_EQ(session->Info()->layer_tokens(1), kept_after_kill);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 200, kept_after_kill));
  ASSERT_EQ(Appended(sequence.Append(*session, kept_after_kill, 100)), kept_after_kill + 100);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 200, kept_after_kill + 100));
  // A deleted session goes from Redis, every key of it but its epoch.
  ASSERT_TRUE(session->Delete().ok());
  absl::SleepFor(absl::Milliseconds(500));
  const RedisValue keys = redis.Run({"KEYS", "*"});
  ASSERT_EQ(keys.elements.size(), 1u) << keys.elements.size() << " keys left";
  EXPECT_THAT(keys.elements[0].str, HasSubstr(":e"));
  EXPECT_EQ(client->OpenSession(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.Stop(SIGTERM), 0) << c.Log();
}

TEST(RedisTierTest, SigtermHandsOverAndKillNineLosesNothingAcknowledged) {
  SKIP_WITHOUT_REDIS();
  HandOverAndKill({}, 350);
}

TEST(RedisTierTest, AcknowledgedWhenQueuedKillNineLosesTheUnsealedTail) {
  SKIP_WITHOUT_REDIS();
  HandOverAndKill({"--redis-acknowledge=queued"}, 320);  // sealed up to 320 of 350
}

// Decode items and Steps are acknowledged once Redis holds their tokens
// too (the new slots of several sessions go in one round trip): after a
// kill -9 the sessions another daemon takes over are as the owner last
// answered, across a page sealed by Decode.
TEST(RedisTierTest, DecodeAndStepLoseNothingAcknowledgedToAKill) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  constexpr int kSessions = 4;
  constexpr int64_t kPrefill = 60, kSteps = 10;  // a page sealed at 64 by Decode
  std::vector<std::string> ids;
  std::vector<Observed> answered;
  {
    Daemon a(Flags("a", redis));
    auto client = Connected("a", a);
    std::vector<Session> sessions;
    for (int i = 0; i < kSessions; ++i) {
      auto session = client->CreateSession(Shape());
      ASSERT_TRUE(session.ok()) << session.status();
      ASSERT_EQ(Appended(sequence.Append(*session, 0, kPrefill)), kPrefill);
      ids.push_back(session->id());
      sessions.push_back(*std::move(session));
    }
    auto stream = client->OpenDecodeStream();
    const size_t row = size_t{kKvHeads} * kDim;
    for (int64_t t = kPrefill; t < kPrefill + kSteps; ++t) {
      for (int layer = 0; layer < kLayers; ++layer) {
        // The last session's tokens go by Step, the others' by Decode.
        DecodeBatch batch;
        batch.layer = layer;
        batch.session_ids.assign(ids.begin(), ids.end() - 1);
        batch.positions.assign(kSessions - 1, t);
        batch.q_heads = kQHeads;
        batch.kv_heads = kKvHeads;
        batch.head_dim = kDim;
        const size_t at = static_cast<size_t>((t + 31 * layer) % Sequence::kTokens) * row;
        std::vector<float> keys, values;
        for (int i = 0; i + 1 < kSessions; ++i) {
          keys.insert(keys.end(), sequence.k.begin() + at, sequence.k.begin() + at + row);
          values.insert(values.end(), sequence.v.begin() + at, sequence.v.begin() + at + row);
        }
        const std::vector<float> queries = GaussianVectors((kSessions - 1) * kQHeads, kDim, 5);
        batch.queries = TensorData::F32(queries);
        batch.keys = TensorData::F32(keys);
        batch.values = TensorData::F32(values);
        auto result = stream->Step(batch);
        ASSERT_TRUE(result.ok()) << result.status();
        ASSERT_EQ(result->failed, 0) << result->status[0];
        const std::vector<float> key(sequence.k.begin() + at, sequence.k.begin() + at + row);
        const std::vector<float> value(sequence.v.begin() + at, sequence.v.begin() + at + row);
        auto step = sessions.back().Step(layer, t, TensorData::F32(key), TensorData::F32(value),
                                         TensorData::F32(GaussianVectors(kQHeads, kDim, 5)));
        ASSERT_TRUE(step.ok()) << step.status();
      }
    }
    ASSERT_TRUE(stream->Finish().ok());
    for (const Session& session : sessions) answered.push_back(Observe(session));
    ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
    a.Wait();
  }
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  for (int i = 0; i < kSessions; ++i) {
    absl::StatusOr<Session> taken = OpenedOnceTheLeaseLapses(*client, ids[i]);
    ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
    auto info = taken->Info();
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layer_tokens(0), kPrefill + kSteps) << "session " << i;
    EXPECT_EQ(info->layer_tokens(1), kPrefill + kSteps) << "session " << i;
    EXPECT_TRUE(Observe(*taken) == answered[i]) << "session " << i;
  }
}

// A session that `write` appends to on daemon "a" (with `flags`), which
// is then killed (-9), as daemon "b" takes it over: what A answered for it
// last, what B has, and B's length of layer 0 (-1: not taken over, the
// failure reported).
struct AfterAKill {
  Observed answered, taken;
  int64_t tokens = -1;
};
AfterAKill KilledAfter(const RedisServer& redis, const std::vector<std::string>& flags,
                       const std::function<void(const Session&)>& write) {
  AfterAKill after;
  std::string id;
  {
    Daemon a(Flags("a", redis, flags));
    auto client = Connected("a", a);
    auto session = client->CreateSession(Shape());
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return after;
    id = session->id();
    write(*session);
    after.answered = Observe(*session);
    EXPECT_EQ(kill(a.pid(), SIGKILL), 0);
    a.Wait();
  }
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  absl::StatusOr<Session> taken = OpenedOnceTheLeaseLapses(*client, id);
  EXPECT_TRUE(taken.ok()) << taken.status() << b.Log();
  if (!taken.ok() || !taken->Info().ok()) return after;
  after.tokens = taken->Info()->layer_tokens(0);
  after.taken = Observe(*taken);
  return after;
}

// Tokens appended one at a time: the layers' sink tokens (4 by default)
// fill over several calls, and each call's manifest holds them as they are,
// so that a takeover after a kill -9 finds every acknowledged token usable.
TEST(RedisTierTest, SinkTokensFilledOneAtATimeSurviveAKill) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  const AfterAKill after = KilledAfter(redis, {}, [&](const Session& session) {
    for (int64_t t = 0; t < 10; ++t) ASSERT_EQ(Appended(sequence.Append(session, t, 1)), t + 1);
  });
  EXPECT_EQ(after.tokens, 10);
  EXPECT_TRUE(after.taken == after.answered);
}

// A session moves from a daemon that acknowledges once written (killed
// with new slots of its last page in Redis) to one that acknowledges once
// queued, which truncates it and is killed too: a third daemon never brings
// back the tokens the truncation cut (the second's manifest supersedes the
// first's new slots; what it had not sealed is lost, as queued promises).
TEST(RedisTierTest, ATruncationByAQueuedDaemonIsNotUndoneByAnEarlierOwnersNewSlots) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  std::string id;
  {
    Daemon w(Flags("w", redis));
    auto client = Connected("w", w);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok()) << session.status();
    id = session->id();
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 100)), 100);  // page 1 holds 36 slots as new slots
    ASSERT_EQ(kill(w.pid(), SIGKILL), 0);
    w.Wait();
  }
  {
    Daemon q(Flags("q", redis, {"--redis-acknowledge=queued"}));
    auto client = Connected("q", q);
    absl::StatusOr<Session> taken = OpenedOnceTheLeaseLapses(*client, id);
    ASSERT_TRUE(taken.ok()) << taken.status() << q.Log();
    ASSERT_TRUE(taken->Truncate(80).ok());
    absl::SleepFor(absl::Milliseconds(500));  // its manifest is sent
    ASSERT_EQ(kill(q.pid(), SIGKILL), 0);
    q.Wait();
  }
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  absl::StatusOr<Session> taken = OpenedOnceTheLeaseLapses(*client, id);
  ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
  ASSERT_TRUE(taken->Info().ok());
  const int64_t tokens = taken->Info()->layer_tokens(0);
  EXPECT_LE(tokens, 80);
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 100, tokens));
}

// A chunk whose pages are more than the writer's queue takes
// (--redis-queue) waits for room instead of being refused, and all of it
// is in Redis once acknowledged.
TEST(RedisTierTest, AChunkLargerThanTheQueueWaitsForRoom) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const AfterAKill after = KilledAfter(redis, {"--redis-queue=64KiB"}, [&](const Session& session) {
    ASSERT_EQ(Appended(sequence.Append(session, 0, 1000)), 1000);  // 30 pages of about 7.5 KB, and the tails
  });
  EXPECT_EQ(after.tokens, 1000);
  EXPECT_TRUE(after.taken == reference.Of(sequence, 1000, 1000));
}

TEST(RedisTierTest, ForksAndTruncatedSessionsCarryOverAndAForkOutlivesItsSource) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence first(11), second(21);
  std::string source_id, fork_id;
  {
    Daemon a(Flags("a", redis));
    auto client = Connected("a", a);
    auto source = client->CreateSession(Shape());
    ASSERT_TRUE(source.ok());
    source_id = source->id();
    ASSERT_EQ(Appended(first.Append(*source, 0, 200)), 200);
    // The fork shares the source's first pages; then each goes its own way,
    // the source through a truncate into a page it had sealed.
    auto fork = source->Fork(150);
    ASSERT_TRUE(fork.ok()) << fork.status();
    fork_id = fork->id();
    ASSERT_EQ(Appended(second.Append(*fork, 150, 110)), 260);
    ASSERT_TRUE(source->Truncate(100).ok());
    ASSERT_EQ(Appended(second.Append(*source, 100, 130)), 230);
    EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  }
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  auto source = client->OpenSession(source_id);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_TRUE(Observe(*source) == reference.Of({{&first, 100}, {&second, 230}}, 200));
  ASSERT_TRUE(source->Delete().ok());
  absl::SleepFor(absl::Milliseconds(300));
  // The fork stands alone in Redis: its source's pages were copied into its own.
  auto fork = client->OpenSession(fork_id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_TRUE(Observe(*fork) == reference.Of({{&first, 150}, {&second, 260}}, 200));
}

TEST(RedisTierTest, NamedBlocksComeBackWithASessionTakenOverAndStayNamed) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence first(11);
  std::vector<int32_t> ids(256);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::string id;
  std::vector<std::string> hashes;
  {
    Daemon a(Flags("a", redis));
    auto client = Connected("a", a);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok());
    id = session->id();
    hashes = BlockHashes(ids, session->block_tokens());
    ASSERT_EQ(Appended(first.Append(*session, 0, 64)), 64);  // the transform's chunk: one block
    ASSERT_EQ(Appended(first.Append(*session, 64, 200)), 264);
    auto named = session->NameBlocks(0, hashes);
    ASSERT_TRUE(named.ok()) << named.status();
    ASSERT_EQ(named->named_blocks(), 4);
    EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  }
  // Two more daemons in turn: each takes the session over (a call names
  // it), finds its names, and hands it over with them.
  for (const char* name : {"b", "c"}) {
    Daemon d(Flags(name, redis));
    auto client = Connected(name, d);
    auto info = client->GetSession(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->named_blocks(), 4) << name;
    SessionOptions options = Shape();
    options.prefix_blocks = hashes;
    auto attached = client->CreateSession(options);
    ASSERT_TRUE(attached.ok()) << attached.status();
    EXPECT_EQ(attached->prefix_tokens(), 256) << name;
    ASSERT_TRUE(attached->Delete().ok());
    options.prefix_blocks = {"not stored"};
    ASSERT_TRUE(client->CreateSession(options).ok());
    const std::string metrics = Scrape(d.MetricsAddress());
    EXPECT_EQ(Sample(metrics, "turbokv_prefix_lookups_total{result=\"hit\"}"), 1) << name;
    EXPECT_EQ(Sample(metrics, "turbokv_prefix_lookups_total{result=\"miss\"}"), 1) << name;
    EXPECT_EQ(Sample(metrics, "turbokv_prefix_reused_tokens_total"), 256) << name;
    EXPECT_EQ(d.Stop(SIGTERM), 0) << d.Log();
  }
}

TEST(RedisTierTest, TwoDaemonsRacingForASessionOneWinsTheOtherIsRefused) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  const std::string id = HandedOver(redis, sequence, 100);
  ASSERT_FALSE(id.empty());
  Daemon b(Flags("b", redis)), c(Flags("c", redis));
  auto client_b = Connected("b", b), client_c = Connected("c", c);
  absl::StatusOr<Session> on_b = absl::UnknownError(""), on_c = absl::UnknownError("");
  std::atomic<int> ready{0};
  std::thread tb([&] {
    ready.fetch_add(1);
    while (ready.load() < 2) {}
    on_b = client_b->OpenSession(id);
  });
  std::thread tc([&] {
    ready.fetch_add(1);
    while (ready.load() < 2) {}
    on_c = client_c->OpenSession(id);
  });
  tb.join();
  tc.join();
  ASSERT_NE(on_b.ok(), on_c.ok()) << on_b.status() << " / " << on_c.status();
  const absl::Status& lost = on_b.ok() ? on_c.status() : on_b.status();
  EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
  EXPECT_THAT(lost.message(), HasSubstr("is held by turbokvd"));
  // The winner goes on; the loser keeps being refused while the winner
  // holds the lease (renewed every third of it).
  const Session& won = on_b.ok() ? *on_b : *on_c;
  const Client& loser = on_b.ok() ? *client_c : *client_b;
  for (int64_t at = 100; at < 400; at += 50) {
    ASSERT_EQ(Appended(sequence.Append(won, at, 50)), at + 50);
    EXPECT_EQ(loser.OpenSession(id).status().code(), absl::StatusCode::kFailedPrecondition);
    absl::SleepFor(absl::Milliseconds(250));
  }
}

TEST(RedisTierTest, AStaleOwnerIsRefusedAndDropsItsCopy) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", redis)), b(Flags("b", redis));
  auto client_a = Connected("a", a), client_b = Connected("b", b);
  auto on_a = client_a->CreateSession(Shape());
  ASSERT_TRUE(on_a.ok());
  const std::string id = on_a->id();
  ASSERT_TRUE(sequence.Append(*on_a, 0, 128).ok());
  WaitForWriteThrough(a);
  // A freezes (a long GC pause, a partition): its lease lapses and B takes
  // the session over with the sealed pages.
  ASSERT_EQ(kill(a.pid(), SIGSTOP), 0);
  absl::SleepFor(absl::Milliseconds(1500));
  auto on_b = client_b->OpenSession(id);
  ASSERT_TRUE(on_b.ok()) << on_b.status() << b.Log();
  ASSERT_EQ(Appended(sequence.Append(*on_b, 128, 72)), 200);
  ASSERT_EQ(kill(a.pid(), SIGCONT), 0);
  // A comes back: its next renewal or write is refused, and it drops its
  // copy; calls on it name the new owner's epoch.
  absl::Status refused;
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    refused = client_a->GetSession(id).status();
    if (!refused.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), AnyOf(HasSubstr("epoch"), HasSubstr("is held by turbokvd")));
  EXPECT_EQ(on_a->Append(0, 128, TensorData::F32(sequence.Chunk(sequence.k, 128, 1)),
                         TensorData::F32(sequence.Chunk(sequence.v, 128, 1)))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.Log(), HasSubstr("was claimed by another turbokvd"));
  // B's session is as B left it.
  EXPECT_TRUE(Observe(*on_b) == reference.Of(sequence, 128, 200));
}

TEST(RedisTierTest, ATenantCannotTakeOverAnotherTenantsSession) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const std::string tokens = TempPath("tokens");
  {
    FILE* f = std::fopen(tokens.c_str(), "w");
    std::fputs("token-a tenant-a\ntoken-b tenant-b\n", f);
    std::fclose(f);
    chmod(tokens.c_str(), 0600);
  }
  ClientOptions as_a, as_b;
  as_a.auth_token = "token-a";
  as_b.auth_token = "token-b";
  const Sequence sequence;
  const std::string id = HandedOver(redis, sequence, 100, {"--auth-tokens-file=" + tokens}, as_a);
  ASSERT_FALSE(id.empty());
  Daemon b(Flags("b", redis, {"--auth-tokens-file=" + tokens}));
  auto client_b = Connected("b", b, as_b);
  const absl::Status other = client_b->GetSession(id).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound) << other;
  auto client_a = Connected("b", b, as_a);
  auto own = client_a->GetSession(id);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->layer_tokens(0), 100);
  // Nor delete it; its tenant can, and then it is in no tier.
  EXPECT_EQ(client_b->DeleteSession(id).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(client_a->DeleteSession(id).ok());
  EXPECT_EQ(client_a->GetSession(id).status().code(), absl::StatusCode::kNotFound);
}

TEST(RedisTierTest, DeletingASessionHeldOnlyInRedisRemovesIt) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  const std::string id = HandedOver(redis, sequence, 300);
  ASSERT_FALSE(id.empty());
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  ASSERT_TRUE(client->DeleteSession(id).ok());
  EXPECT_EQ(client->GetSession(id).status().code(), absl::StatusCode::kNotFound);
  absl::SleepFor(absl::Milliseconds(500));
  const RedisValue keys = redis.Run({"KEYS", "*"});
  ASSERT_EQ(keys.elements.size(), 1u) << keys.elements.size() << " keys left";
  EXPECT_THAT(keys.elements[0].str, HasSubstr(":e"));
}

TEST(RedisTierTest, DamagedRecordsInRedisAreDataLossNamingThem) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  const std::string damaged_manifest = HandedOver(redis, sequence, 100);
  ASSERT_FALSE(damaged_manifest.empty());
  RedisValue manifests = redis.Run({"KEYS", "*:m"});
  ASSERT_EQ(manifests.elements.size(), 1u);
  redis.Run({"SET", manifests.elements[0].str, "not a manifest"});
  const std::string damaged_page = HandedOver(redis, sequence, 100);
  ASSERT_FALSE(damaged_page.empty());
  RedisValue pages = redis.Run({"KEYS", absl::StrCat("turbokv:{", damaged_page, "}:*:p:*")});
  ASSERT_FALSE(pages.elements.empty());
  redis.Run({"SETRANGE", pages.elements[0].str, "100", "x"});  // in the payload: its CRC no longer matches
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  // A manifest that is not one: DATA_LOSS, and the claim lets go of its lease.
  const absl::Status manifest = client->GetSession(damaged_manifest).status();
  EXPECT_EQ(manifest.code(), absl::StatusCode::kDataLoss) << manifest;
  EXPECT_THAT(manifest.message(), HasSubstr("is not a turbokv manifest"));
  EXPECT_TRUE(redis.Run({"KEYS", absl::StrCat("turbokv:{", damaged_manifest, "}:*:l")}).elements.empty());
  // A page that fails its CRC: the session is claimed, and reading it back
  // is DATA_LOSS naming the page.
  auto session = client->OpenSession(damaged_page);
  ASSERT_TRUE(session.ok()) << session.status();
  const absl::Status page = session->Attend(1, TensorData::F32(GaussianVectors(kQHeads, kDim, 13))).status();
  EXPECT_EQ(page.code(), absl::StatusCode::kDataLoss) << page;
  EXPECT_THAT(page.message(), HasSubstr("could not be read back from the redis tier"));
  EXPECT_THAT(page.message(), HasSubstr("fails its CRC"));
}

// Redis paused, then stopped, then back, under appends and attention on a
// session in memory: attention goes on; appends answer at once, OK when
// acknowledged once queued, UNAVAILABLE naming Redis by default (Redis
// does not hold them); every acknowledged token reaches another daemon.
void PauseAndStopRedis(const std::vector<std::string>& flags, bool acknowledged_when_queued) {
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", redis, flags));
  ClientOptions bounded;
  bounded.timeout = absl::Seconds(3);
  auto client = Connected("a", a, bounded);
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  const std::string id = session->id();
  int64_t tokens = 0;
  int refused = 0;
  auto step = [&] {
    auto appended = sequence.Append(*session, tokens, 16);
    if (appended.ok()) {
      tokens = *appended;
    } else {
      ASSERT_FALSE(acknowledged_when_queued) << appended.status();
      ASSERT_EQ(appended.status().code(), absl::StatusCode::kUnavailable) << appended.status();
      EXPECT_THAT(appended.status().message(), HasSubstr("Redis at unix://"));
      EXPECT_THAT(appended.status().message(), HasSubstr("sending them again is safe"));
      ++refused;
    }
    auto attended = session->Attend(1, TensorData::F32(GaussianVectors(kQHeads, kDim, 13)));
    ASSERT_TRUE(attended.ok()) << attended.status();
  };
  for (int i = 0; i < 8; ++i) step();
  EXPECT_EQ(RemoteTierHealth("a"), grpc::health::v1::HealthCheckResponse::SERVING);
  // Paused: every command waits; calls on sessions in memory go on.
  RedisValue paused = redis.Run({"CLIENT", "PAUSE", "2500", "ALL"});
  EXPECT_EQ(paused.str, "OK");
  for (int i = 0; i < 8; ++i) step();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(RemoteTierHealth("a"), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(client->Health().value_or(grpc::health::v1::HealthCheckResponse::UNKNOWN),
            grpc::health::v1::HealthCheckResponse::SERVING);
  // Stopped: the same, and a session that only Redis could have is
  // UNAVAILABLE naming it.
  redis.Kill();
  for (int i = 0; i < 8; ++i) step();
  const absl::Status unknown = client->GetSession("abcdefghijklmnopqrstuvwxyz").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  EXPECT_THAT(unknown.message(), HasSubstr("Redis at unix://"));
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(Sample(Scrape(a.MetricsAddress()), "turbokv_tier_up{tier=\"redis\"}"), 0);
  // Back, from its append-only file: what was queued is sent, and a
  // handover carries every token to another daemon.
  redis.Start();
  EXPECT_EQ(WaitForTierHealth("a", grpc::health::v1::HealthCheckResponse::SERVING, absl::Seconds(10)),
            grpc::health::v1::HealthCheckResponse::SERVING);
  const int refused_while_down = refused;
  for (int i = 0; i < 8; ++i) step();
  EXPECT_EQ(refused, refused_while_down) << "appends refused with Redis back";
  if (!acknowledged_when_queued) {
    EXPECT_GE(refused, 8) << "appends acknowledged while Redis was stopped";
  }
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  Daemon b(Flags("b", redis));
  auto client_b = Connected("b", b);
  auto taken = client_b->OpenSession(id);
  ASSERT_TRUE(taken.ok()) << taken.status() << "\n" << a.Log();
  ASSERT_TRUE(taken->Info().ok());
  EXPECT_EQ(taken->Info()->layer_tokens(1), tokens);
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 16, tokens));
}

TEST(RedisTierTest, RedisPausedOrStoppedNeverHoldsACallAndAppendsAreRefused) {
  SKIP_WITHOUT_REDIS();
  PauseAndStopRedis({}, false);
}

TEST(RedisTierTest, AcknowledgedWhenQueuedRedisPausedOrStoppedNeverHoldsACallAndTheTierCatchesUp) {
  SKIP_WITHOUT_REDIS();
  PauseAndStopRedis({"--redis-acknowledge=queued"}, true);
}

TEST(RedisTierTest, RedisRestartedEmptyUnderLoadLosesNothingTheOwnerAcknowledged) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis(/*persistent=*/false);
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", redis));
  auto client = Connected("a", a);
  EXPECT_THAT(a.Log(), HasSubstr("without its append-only file"));
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  const std::string id = session->id();
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 300)), 300);
  WaitForWriteThrough(a);
  // Appends go on while Redis restarts with nothing in it; every one
  // acknowledged counts.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> acknowledged{300};
  std::thread load([&] {
    while (!stop.load()) {
      absl::StatusOr<int64_t> appended = sequence.Append(*session, acknowledged.load(), 16);
      if (appended.ok()) {
        acknowledged.store(*appended);
      } else {
        // Redis down: not acknowledged, sent again.
        ASSERT_EQ(appended.status().code(), absl::StatusCode::kUnavailable) << appended.status();
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  redis.Kill();
  absl::SleepFor(absl::Milliseconds(500));
  redis.Start();
  absl::SleepFor(absl::Milliseconds(2000));
  stop.store(true);
  load.join();
  const int64_t tokens = acknowledged.load();
  // The owner noticed, restored its epoch and wrote the session again.
  for (absl::Time until = absl::Now() + absl::Seconds(10);
       Sample(Scrape(a.MetricsAddress()), "turbokv_tier_rewrites_total{tier=\"redis\"}") < 1 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_GE(Sample(Scrape(a.MetricsAddress()), "turbokv_tier_rewrites_total{tier=\"redis\"}"), 1);
  EXPECT_THAT(a.Log(), HasSubstr("writes the session again"));
  EXPECT_THAT(a.Log(), Not(HasSubstr("was claimed by another turbokvd")));
  ASSERT_TRUE(client->GetSession(id).ok());
  // Killed, not drained: every acknowledged token is in Redis already, and
  // another daemon takes them all over once the lease lapses.
  ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
  a.Wait();
  Daemon b(Flags("b", redis));
  auto client_b = Connected("b", b);
  absl::StatusOr<Session> taken = OpenedOnceTheLeaseLapses(*client_b, id);
  ASSERT_TRUE(taken.ok()) << taken.status() << "\n" << a.Log();
  ASSERT_TRUE(taken->Info().ok());
  EXPECT_EQ(taken->Info()->layer_tokens(0), tokens);
  EXPECT_EQ(taken->Info()->layer_tokens(1), tokens);
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 300, tokens));
}

// The owner of a session under appends is cut off from Redis (or stopped,
// SIGSTOP, as by a long pause), another daemon claims the session once the
// lease lapses, and the owner comes back: every token the owner
// acknowledged is in the new owner's copy, in 20 cycles.
TEST(RedisTierTest, AnOwnerCutOffFromRedisLosesNoAcknowledgedAppend) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Proxy proxy(redis.socket_path());
  Reference reference;
  const Sequence sequence;
  std::vector<std::string> flags_a = Flags("a", redis);
  for (std::string& flag : flags_a) {
    if (absl::StartsWith(flag, "--redis-url=")) flag = "--redis-url=" + proxy.Url();
  }
  Daemon a(flags_a), b(Flags("b", redis));
  ClientOptions bounded;
  bounded.timeout = absl::Seconds(3);
  auto client_a = Connected("a", a, bounded), client_b = Connected("b", b);
  constexpr int64_t kFirst = 24;
  int64_t lost = 0, acknowledged_total = 0, refused_total = 0;
  absl::Duration longest_refusal;
  for (int cycle = 0; cycle < 20; ++cycle) {
    SCOPED_TRACE(absl::StrCat("cycle ", cycle));
    const bool stopped = cycle % 5 == 4;  // 4 cycles of 20: SIGSTOP instead of a cut
    auto session = client_a->CreateSession(Shape());
    ASSERT_TRUE(session.ok()) << session.status();
    absl::StatusOr<int64_t> first = sequence.Append(*session, 0, kFirst);
    for (absl::Time until = absl::Now() + absl::Seconds(5); !first.ok() && absl::Now() < until;) {
      // A's tier may still be finding out that Redis is back.
      ASSERT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
      absl::SleepFor(absl::Milliseconds(50));
      first = sequence.Append(*session, 0, kFirst);
    }
    ASSERT_EQ(Appended(first), kFirst);
    std::atomic<int64_t> acknowledged{kFirst};
    std::atomic<bool> stop{false}, disowned{false};
    std::atomic<int64_t> refusals{0};
    std::atomic<int64_t> longest_ms{0};
    std::thread load([&] {
      int64_t at = kFirst;
      while (!stop.load()) {
        const absl::Time sent = absl::Now();
        absl::StatusOr<int64_t> appended = sequence.Append(*session, at, 3 + at % 5);
        if (appended.ok()) {
          at = *appended;
          acknowledged.store(at);
        } else if (appended.status().code() == absl::StatusCode::kFailedPrecondition ||
                   appended.status().code() == absl::StatusCode::kNotFound) {
          disowned.store(true);  // claimed by B: A dropped its copy
          return;
        } else {
          // Not acknowledged (A cannot reach Redis, or was stopped past
          // the client's deadline): sent again.
          EXPECT_THAT(appended.status().code(),
                      AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
              << appended.status();
          refusals.fetch_add(1);
          longest_ms.store(std::max(longest_ms.load(), absl::ToInt64Milliseconds(absl::Now() - sent)));
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
    absl::SleepFor(absl::Milliseconds(300));
    if (stopped) {
      ASSERT_EQ(kill(a.pid(), SIGSTOP), 0);
    } else {
      proxy.Cut();
    }
    absl::SleepFor(absl::Milliseconds(1200));  // past the lease (1 s)
    absl::StatusOr<Session> on_b = OpenedOnceTheLeaseLapses(*client_b, session->id());
    if (stopped) {
      ASSERT_EQ(kill(a.pid(), SIGCONT), 0);
    } else {
      proxy.Heal();
    }
    ASSERT_TRUE(on_b.ok()) << on_b.status() << b.Log();
    // A finds out that B holds the session, and refuses what it is sent.
    for (absl::Time until = absl::Now() + absl::Seconds(10); !disowned.load() && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    stop.store(true);
    load.join();
    EXPECT_TRUE(disowned.load()) << "A kept the session B claimed";
    const int64_t acked = acknowledged.load();
    auto info = on_b->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    // An append A did not acknowledge may have reached Redis in some
    // layers and not in others.
    const int64_t kept = std::min(info->layer_tokens(0), info->layer_tokens(1));
    EXPECT_GE(kept, acked) << "B's copy lacks tokens A acknowledged";
    lost += std::max<int64_t>(0, acked - kept);
    acknowledged_total += acked;
    refused_total += refusals.load();
    longest_refusal = std::max(longest_refusal, absl::Milliseconds(longest_ms.load()));
    // What B has is what was appended, token for token.
    ASSERT_TRUE(on_b->Truncate(kept).ok());
    EXPECT_TRUE(Observe(*on_b) == reference.Of(sequence, kFirst, kept, [](int64_t at) { return 3 + at % 5; }));
    ASSERT_TRUE(on_b->Delete().ok());
  }
  EXPECT_EQ(lost, 0);
  EXPECT_THAT(a.Log(), HasSubstr("was claimed by another turbokvd"));
  std::printf("partition: %lld tokens acknowledged in 20 cycles, %lld lost; %lld appends refused, the longest "
              "answered in %s\n",
              static_cast<long long>(acknowledged_total), static_cast<long long>(lost),
              static_cast<long long>(refused_total), absl::FormatDuration(longest_refusal).c_str());
}

TEST(RedisTierTest, ARedisThatEvictsKeysIsRefusedAtStartAndWhileItDoes) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis(/*persistent=*/true, "allkeys-lru");
  {
    Daemon refused(Flags("refused", redis));
    EXPECT_NE(refused.Wait(), 0);
    EXPECT_THAT(refused.Log(), HasSubstr("maxmemory-policy allkeys-lru"));
    EXPECT_THAT(refused.Log(), HasSubstr("noeviction"));
  }
  EXPECT_EQ(redis.Run({"CONFIG", "SET", "maxmemory-policy", "noeviction"}).str, "OK");
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", redis));
  auto client = Connected("a", a);
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 100)), 100);
  EXPECT_EQ(RemoteTierHealth("a"), grpc::health::v1::HealthCheckResponse::SERVING);
  // Turned to evicting while the daemon runs: the tier is down (appends
  // are refused, naming the policy), calls on sessions in memory go on;
  // turned back, appends are taken again.
  EXPECT_EQ(redis.Run({"CONFIG", "SET", "maxmemory-policy", "volatile-lru"}).str, "OK");
  EXPECT_EQ(WaitForTierHealth("a", grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(5)),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_THAT(a.Log(), HasSubstr("maxmemory-policy volatile-lru"));
  const absl::Status refused = sequence.Append(*session, 100, 100).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("maxmemory-policy volatile-lru"));
  EXPECT_TRUE(session->Attend(1, TensorData::F32(GaussianVectors(kQHeads, kDim, 13))).ok());
  EXPECT_EQ(redis.Run({"CONFIG", "SET", "maxmemory-policy", "noeviction"}).str, "OK");
  EXPECT_EQ(WaitForTierHealth("a", grpc::health::v1::HealthCheckResponse::SERVING, absl::Seconds(5)),
            grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_EQ(Appended(sequence.Append(*session, 100, 100)), 200);
  const std::string id = session->id();
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  Daemon b(Flags("b", redis));
  auto taken = Connected("b", b)->OpenSession(id);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 100, 200));
}

TEST(RedisTierTest, ATakeoverThatFindsPagesMissingIsDataLossNeverFewerTokens) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  // A page its manifest lists, deleted by hand.
  const std::string listed = HandedOver(redis, sequence, 300);
  ASSERT_FALSE(listed.empty());
  RedisValue pages = redis.Run({"KEYS", absl::StrCat("turbokv:{", listed, "}:*:p:*")});
  ASSERT_FALSE(pages.elements.empty());
  EXPECT_EQ(redis.Run({"DEL", pages.elements[0].str}).integer, 1);
  // A sealed page written since the manifest, whose entry is deleted by
  // hand from an owner that was then killed: the pages after it are there.
  std::string gap;
  {
    Daemon a(Flags("a", redis));
    auto client = Connected("a", a);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok());
    gap = session->id();
    // The first chunk's pages go with the manifest that holds the layers'
    // transforms; the second's are entered as sealed since.
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 100)), 100);
    ASSERT_EQ(Appended(sequence.Append(*session, 100, 200)), 300);
    WaitForWriteThrough(a);
    RedisValue sealed = redis.Run({"KEYS", absl::StrCat("turbokv:{", gap, "}:*:h")});
    ASSERT_EQ(sealed.elements.size(), 1u);
    EXPECT_EQ(redis.Run({"HDEL", sealed.elements[0].str, "1:1"}).integer, 1);
    ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
    a.Wait();
  }
  // A session whose epoch was deleted by hand: who holds it cannot be told.
  const std::string unfenced = HandedOver(redis, sequence, 100);
  ASSERT_FALSE(unfenced.empty());
  const RedisValue epochs = redis.Run({"KEYS", absl::StrCat("turbokv:{", unfenced, "}:*:e")});
  ASSERT_EQ(epochs.elements.size(), 1u);
  EXPECT_EQ(redis.Run({"DEL", epochs.elements[0].str}).integer, 1);
  absl::SleepFor(absl::Milliseconds(1200));  // the lease lapses
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  const absl::Status no_epoch = client->GetSession(unfenced).status();
  EXPECT_EQ(no_epoch.code(), absl::StatusCode::kDataLoss) << no_epoch;
  EXPECT_THAT(no_epoch.message(), HasSubstr("has a manifest but no epoch"));
  const absl::Status missing = client->GetSession(listed).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("1 of its 10 pages are missing"));
  const absl::Status cut = client->GetSession(gap).status();
  EXPECT_EQ(cut.code(), absl::StatusCode::kDataLoss) << cut;
  EXPECT_THAT(cut.message(), HasSubstr("page 2 of layer 1 is there but page 1 before it is not"));
}

TEST(RedisTierTest, ASessionNobodyHoldsExpiresAndOneHeldNeverDoes) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  const Sequence sequence;
  const std::vector<std::string> ttl = {"--redis-orphan-ttl=3s"};
  auto keys_of = [&](const std::string& id) { return redis.Run({"KEYS", absl::StrCat("turbokv:{", id, "}:*")}).elements; };
  std::string orphan;
  {
    // Its owner is killed: nobody holds the session any more.
    Daemon a(Flags("a", redis, ttl));
    auto session = Connected("a", a)->CreateSession(Shape());
    ASSERT_TRUE(session.ok());
    orphan = session->id();
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 100)), 100);
    WaitForWriteThrough(a);
    const std::vector<RedisValue> keys = keys_of(orphan);
    ASSERT_GE(keys.size(), 5u);  // epoch, lease, manifest, sealed pages, 2 pages
    for (const RedisValue& key : keys) {
      const long long left = redis.Run({"PTTL", key.str}).integer;
      EXPECT_GT(left, 0) << key.str;
      EXPECT_LE(left, 3000) << key.str;
    }
    ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
    a.Wait();
  }
  // Another daemon holds its session past the TTL: its keys are refreshed.
  Daemon b(Flags("b", redis, ttl));
  auto client_b = Connected("b", b);
  auto held = client_b->CreateSession(Shape());
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(Appended(sequence.Append(*held, 0, 200)), 200);
  WaitForWriteThrough(b);
  absl::SleepFor(absl::Milliseconds(4500));
  EXPECT_TRUE(keys_of(orphan).empty());
  EXPECT_FALSE(keys_of(held->id()).empty());
  EXPECT_EQ(client_b->GetSession(orphan).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
  Daemon c(Flags("c", redis, ttl));
  auto taken = Connected("c", c)->OpenSession(held->id());
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->Info()->layer_tokens(1), 200);
}

// A file of the test's own with `text`, readable by its owner only.
std::string SecretFile(const std::string& name, const std::string& text) {
  const std::string path = TempPath(name);
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs(text.c_str(), f);
  std::fclose(f);
  chmod(path.c_str(), 0600);
  return path;
}

TEST(RedisTierTest, APasswordComesFromAFileOrTheEnvironmentAndNeverShows) {
  SKIP_WITHOUT_REDIS();
  const std::string password = "s3cret-redis-pass", wrong = "not-the-password";
  RedisServer redis(/*persistent=*/true, "noeviction", password);
  {
    Daemon none(Flags("none", redis));
    EXPECT_NE(none.Wait(), 0);
    EXPECT_THAT(none.Log(), HasSubstr("needs a password (--redis-password-file or $TURBOKV_REDIS_PASSWORD)"));
    Daemon refused(Flags("refused", redis, {"--redis-password-file=" + SecretFile("wrong", wrong + "\n")}));
    EXPECT_NE(refused.Wait(), 0);
    EXPECT_THAT(refused.Log(), HasSubstr("refused the credentials of user 'default': WRONGPASS"));
    EXPECT_THAT(refused.Log(), Not(HasSubstr(wrong)));
  }
  const Sequence sequence;
  Daemon a(Flags("a", redis, {"--redis-password-file=" + SecretFile("right", password + "\n")}));
  auto client = Connected("a", a);
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 100)), 100);
  WaitForWriteThrough(a);
  EXPECT_THAT(Scrape(a.MetricsAddress()), Not(HasSubstr(password)));
  EXPECT_THAT(a.Log(), HasSubstr("as user 'default'"));
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  EXPECT_THAT(a.Log(), Not(HasSubstr(password)));
  // An ACL user that may not run scripts: refused at start, naming what it
  // needs (before, it started and every write failed).
  EXPECT_EQ(redis.Run({"ACL", "SETUSER", "reader", "on", ">" + password + "-r", "~turbokv:*", "+info", "+get"}).str, "OK");
  {
    setenv("TURBOKV_REDIS_PASSWORD", (password + "-r").c_str(), 1);
    Daemon reader(Flags("reader", redis, {"--redis-user=reader"}));
    unsetenv("TURBOKV_REDIS_PASSWORD");
    EXPECT_NE(reader.Wait(), 0);
    EXPECT_THAT(reader.Log(), HasSubstr("refused EVAL (user 'reader' needs INFO, EVAL"));
    EXPECT_THAT(reader.Log(), HasSubstr("NOPERM"));
  }
  // One that may run scripts, but not every command they run: refused too,
  // naming those (before, it started and every append failed INTERNAL).
  EXPECT_EQ(redis.Run({"ACL", "SETUSER", "scripter", "on", ">" + password + "-s", "~turbokv:*", "+@all", "-append",
                       "-incr"})
                .str,
            "OK");
  {
    setenv("TURBOKV_REDIS_PASSWORD", (password + "-s").c_str(), 1);
    Daemon scripter(Flags("scripter", redis, {"--redis-user=scripter"}));
    unsetenv("TURBOKV_REDIS_PASSWORD");
    EXPECT_NE(scripter.Wait(), 0);
    EXPECT_THAT(scripter.Log(), HasSubstr("user 'scripter' may not run APPEND, INCR"));
  }
  // From the environment, as an ACL user of its own: another daemon takes
  // the session over.
  EXPECT_EQ(redis.Run({"ACL", "SETUSER", "turbokv", "on", ">" + password + "-2", "~turbokv:*", "+@all"}).str, "OK");
  setenv("TURBOKV_REDIS_PASSWORD", (password + "-2").c_str(), 1);
  Daemon b(Flags("b", redis, {"--redis-user=turbokv"}));
  unsetenv("TURBOKV_REDIS_PASSWORD");
  auto taken = Connected("b", b)->OpenSession(session->id());
  ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
  EXPECT_EQ(taken->Info()->layer_tokens(1), 100);
  EXPECT_THAT(b.Log(), HasSubstr("as user 'turbokv'"));
  EXPECT_THAT(b.Log(), Not(HasSubstr(password)));
}

TEST(RedisTierTest, TlsChecksRedisCertificateAndPresentsTheDaemons) {
  SKIP_WITHOUT_REDIS();
  const Certificates certs;
  RedisServer redis(/*persistent=*/true, "noeviction", "", &certs);
  auto tls = [&](const std::string& name, std::vector<std::string> more) {
    std::vector<std::string> flags = Flags(name, redis, std::move(more));
    flags[3] = "--redis-url=" + redis.TlsUrl();
    return flags;
  };
  const std::vector<std::string> client = {"--redis-tls-cert=" + certs.client_cert,
                                           "--redis-tls-key=" + certs.client_key};
  {
    // Redis's certificate signed by another CA: refused at start.
    std::vector<std::string> other = client;
    other.push_back("--redis-tls-ca=" + certs.other_ca);
    Daemon wrong(tls("wrong", other));
    EXPECT_NE(wrong.Wait(), 0);
    EXPECT_THAT(wrong.Log(), HasSubstr("the TLS handshake failed: the server's certificate: "));
    // TLS files without rediss://, or a certificate without its key: refused.
    Daemon plain(Flags("plain", redis, {"--redis-tls-ca=" + certs.ca}));
    EXPECT_NE(plain.Wait(), 0);
    EXPECT_THAT(plain.Log(), HasSubstr("need a rediss:// URL"));
    Daemon half(tls("half", {"--redis-tls-ca=" + certs.ca, "--redis-tls-cert=" + certs.client_cert}));
    EXPECT_NE(half.Wait(), 0);
    EXPECT_THAT(half.Log(), HasSubstr("go together"));
  }
  // The right CA and a client certificate: a session written through TLS
  // and taken over by another daemon through TLS.
  std::vector<std::string> right = client;
  right.push_back("--redis-tls-ca=" + certs.ca);
  const Sequence sequence;
  Daemon a(tls("a", right));
  auto session = Connected("a", a)->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 150)), 150);
  WaitForWriteThrough(a);
  EXPECT_EQ(RemoteTierHealth("a"), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  Daemon b(tls("b", right));
  auto taken = Connected("b", b)->OpenSession(session->id());
  ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
  EXPECT_EQ(taken->Info()->layer_tokens(0), 150);
  // Without a client certificate, Redis (--tls-auth-clients yes) refuses
  // it. Its alert stops the start ("certificate required"); when Redis
  // resets the connection before the alert is read, the daemon starts with
  // the tier down. Either way nothing reaches Redis.
  Daemon c(tls("c", {"--redis-tls-ca=" + certs.ca}));
  absl::SleepFor(absl::Seconds(3));
  EXPECT_THAT(c.Log(), AnyOf(HasSubstr("certificate required"), HasSubstr("reset by peer"))) << c.Log();
  EXPECT_THAT(c.Log(), Not(HasSubstr(": answering")));
  c.Stop(SIGKILL);
}

TEST(RedisUrlTest, FormsAndMistakes) {
  absl::StatusOr<RedisAddress> tcp = ParseRedisUrl("redis://cache.example:6380/2");
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  EXPECT_EQ(tcp->host, "cache.example");
  EXPECT_EQ(tcp->port, 6380);
  EXPECT_EQ(tcp->db, 2);
  EXPECT_EQ(ParseRedisUrl("redis://localhost")->port, 6379);
  EXPECT_FALSE(tcp->tls);
  absl::StatusOr<RedisAddress> tls = ParseRedisUrl("rediss://cache.example:6380");
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_TRUE(tls->tls);
  EXPECT_EQ(tls->host, "cache.example");
  absl::StatusOr<RedisAddress> unix_socket = ParseRedisUrl("unix:///run/redis.sock?db=3");
  ASSERT_TRUE(unix_socket.ok()) << unix_socket.status();
  EXPECT_EQ(unix_socket->path, "/run/redis.sock");
  EXPECT_EQ(unix_socket->db, 3);
  const std::pair<const char*, const char*> bad[] = {
      {"http://x:1", "scheme"},         {"redis://:6379", "no host"},        {"redis://x:0", "port"},
      {"redis://x:99999", "port"},      {"redis://x/zero", "database"},      {"redis://u:p@x", "credentials"},
      {"unix://relative.sock", "absolute"}, {"unix:///r.sock?timeout=1", "db=N"}};
  for (const auto& [url, why] : bad) {
    absl::StatusOr<RedisAddress> parsed = ParseRedisUrl(url);
    ASSERT_FALSE(parsed.ok()) << url;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(why)) << url;
    EXPECT_THAT(parsed.status().message(), HasSubstr("--redis-url")) << url;
  }
}

TEST(RedisTierTest, TheDaemonRefusesRedisWithSnapshotsOrABadUrl) {
  const std::pair<std::vector<std::string>, const char*> refused[] = {
      {{"--redis-url=redis://127.0.0.1:1", "--snapshot-dir=/tmp"}, "--redis-url and --snapshot-dir"},
      {{"--redis-url=redis//127.0.0.1"}, "the scheme must be"},
      {{"--redis-url=redis://127.0.0.1:1", "--redis-lease=10ms"}, "--redis-lease"},
      {{"--redis-url=redis://127.0.0.1:1", "--redis-lease=1s", "--redis-timeout=100ms", "--redis-orphan-ttl=2s"},
       "--redis-orphan-ttl 2s is shorter than 3 x --redis-lease (3s)"},
      {{"--redis-url=redis://127.0.0.1:1", "--redis-lease=2s"},
       "--redis-timeout 1s is not under a third of --redis-lease (2s)"},
      // Credentials in the URL: refused, and never shown.
      {{"--redis-url=redis://user:hunter2-secret@127.0.0.1:1"}, "--redis-url redis://...@127.0.0.1:1: credentials"}};
  for (const auto& [flags, why] : refused) {
    std::vector<std::string> all = {"--listen=" + Socket("refused"), "--device=cpu"};
    all.insert(all.end(), flags.begin(), flags.end());
    Daemon daemon(all);
    EXPECT_NE(daemon.Wait(), 0);
    EXPECT_THAT(daemon.Log(), HasSubstr(why));
    EXPECT_THAT(daemon.Log(), Not(HasSubstr("hunter2")));
  }
}

}  // namespace
}  // namespace turbokv
