// The Redis tier on a real Redis Cluster (Debian's redis-server, nodes on
// loopback ports made into a cluster by redis-cli --cluster create) and the
// real turbokvd binary: sessions and forks in different slots handed over
// between daemons that know one node or several, a slot moved between masters
// under a session a daemon holds (ASK, TRYAGAIN, then MOVED), a master failing
// over to its replica, and a master down and back.
#include <signal.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/daemon_testing.h"
#include "tests/service/redis_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::Daemon;
using ::turbokv::testing::Sample;
using ::turbokv::testing::Scrape;

// The slot of a session's keys, and its manifest's key (no tenant).
int SlotOf(const std::string& id) { return RedisClusterSlot(absl::StrCat("{", id, "}")); }
std::string ManifestKey(const std::string& id) { return absl::StrCat("turbokv:{", id, "}::m"); }

// Appends `n` tokens from `start`, again while they are refused for the
// tier (a master failing over, or down: UNAVAILABLE), for up to `limit`.
int64_t AppendedOnceRedisTakesIt(const Sequence& sequence, const Session& session, int64_t start, int64_t n,
                                 absl::Duration limit) {
  absl::StatusOr<int64_t> appended = sequence.Append(session, start, n);
  for (absl::Time until = absl::Now() + limit; !appended.ok() && absl::Now() < until;) {
    EXPECT_EQ(appended.status().code(), absl::StatusCode::kUnavailable) << appended.status();
    absl::SleepFor(absl::Milliseconds(200));
    appended = sequence.Append(session, start, n);
  }
  return Appended(appended);
}

// Daemon `a` drains, and another takes session `id` over whole: the first
// 200 tokens of `sequence` as one chunk, then the rest up to `tokens`.
void TakenOverWhole(Daemon& a, const RedisClusterServers& cluster, const std::string& id, Reference& reference,
                    const Sequence& sequence, int64_t tokens) {
  ASSERT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  Daemon b(Flags("b", cluster.SeedsUrl()));
  auto taken = Connected("b", b)->OpenSession(id);
  ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
  EXPECT_EQ(taken->Info()->layer_tokens(0), tokens);
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 200, tokens));
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
}

TEST(RedisClusterTest, ASessionAndItsForkMoveBetweenDaemonsThroughTheCluster) {
  SKIP_WITHOUT_REDIS();
  RedisClusterServers cluster(3);
  Reference reference;
  const Sequence sequence, other(23);
  std::string id, fork_id;
  {
    // One node as its seed: the others are found.
    Daemon a(Flags("a", cluster.Url(0)));
    auto client = Connected("a", a);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 350)), 350);
    auto fork = session->Fork(200);
    ASSERT_TRUE(fork.ok()) << fork.status();
    ASSERT_EQ(Appended(other.Append(*fork, 200, 100)), 300);
    id = session->id();
    fork_id = fork->id();
    ASSERT_EQ(a.Stop(SIGTERM), 0) << a.Log();
    EXPECT_THAT(a.Log(), HasSubstr("sessions handed over"));
  }
  // Each session's keys are on the master of its own slot.
  for (const std::string& session : {id, fork_id}) {
    const int master = cluster.MasterOf(SlotOf(session), 1);
    ASSERT_GE(master, 0);
    EXPECT_EQ(cluster.Run(master, {"EXISTS", ManifestKey(session)}).integer, 1) << session;
  }
  // Another daemon, with a first seed that does not answer (a closed port)
  // and the others: both come back whole, the fork with its source's pages
  // copied into its own slot.
  Daemon b(Flags("b", absl::StrCat("redis://127.0.0.1:", FreePort(), ",127.0.0.1:", cluster.port(1), ",127.0.0.1:",
                                    cluster.port(2))));
  auto client = Connected("b", b);
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status() << b.Log();
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350));
  auto fork = client->OpenSession(fork_id);
  ASSERT_TRUE(fork.ok()) << fork.status() << b.Log();
  EXPECT_TRUE(Observe(*fork) == reference.Of({{&sequence, 200}, {&other, 300}}, 350));
  // Mistakes that stop the start: a database other than 0, and among the
  // seeds a Redis that is not a node of the cluster.
  {
    Daemon wrong(Flags("wrong", cluster.Url(0) + "/2"));
    EXPECT_NE(wrong.Wait(), 0);
    EXPECT_THAT(wrong.Log(), HasSubstr("a Redis Cluster has database 0 only"));
  }
  const int plain_port = FreeClusterPort();
  pid_t plain = ::fork();
  if (plain == 0) ExecRedisServer({"--port", std::to_string(plain_port), "--bind", "127.0.0.1", "--save", ""});
  WaitForPing(*ParseRedisUrl(absl::StrCat("redis://127.0.0.1:", plain_port)), "the standalone Redis");
  {
    Daemon mixed(Flags("mixed", absl::StrCat("redis://127.0.0.1:", plain_port, ",127.0.0.1:", cluster.port(1))));
    EXPECT_NE(mixed.Wait(), 0);
    EXPECT_THAT(mixed.Log(), HasSubstr("is not a cluster node"));
  }
  KillRedisServer(&plain);
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
}

// Starts moving `slot` from master `from` to `to` and moves every key of
// it: the old master answers ASK for them until FinishMove.
void StartMove(const RedisClusterServers& cluster, int slot, int from, int to) {
  const std::string slot_name = std::to_string(slot);
  ASSERT_EQ(cluster.Run(to, {"CLUSTER", "SETSLOT", slot_name, "IMPORTING", cluster.Id(from)}).str, "OK");
  ASSERT_EQ(cluster.Run(from, {"CLUSTER", "SETSLOT", slot_name, "MIGRATING", cluster.Id(to)}).str, "OK");
  const RedisValue keys = cluster.Run(from, {"CLUSTER", "GETKEYSINSLOT", slot_name, "10000"});
  ASSERT_GT(keys.elements.size(), 3u);
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(cluster.port(to)), "", "0", "5000", "KEYS"};
  for (const RedisValue& key : keys.elements) migrate.push_back(key.str);
  ASSERT_EQ(cluster.Run(from, migrate).str, "OK");
}
// Every master learns that `slot` is `to`'s.
void FinishMove(const RedisClusterServers& cluster, int slot, int to) {
  for (int node = 0; node < cluster.size(); ++node) {
    EXPECT_EQ(cluster.Run(node, {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", cluster.Id(to)}).str, "OK");
  }
}

// A session of 350 tokens written on daemon "a", which drains: its id.
std::string HandedOverThroughTheCluster(const RedisClusterServers& cluster, const Sequence& sequence) {
  Daemon a(Flags("a", cluster.Url(0)));
  auto client = Connected("a", a);
  auto session = client->CreateSession(Shape());
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return "";
  EXPECT_EQ(Appended(sequence.Append(*session, 0, 350)), 350);
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  return session->id();
}

TEST(RedisClusterTest, ASessionFollowsItsSlotMovingBetweenMasters) {
  SKIP_WITHOUT_REDIS();
  RedisClusterServers cluster(3);
  Reference reference;
  const Sequence sequence;
  const std::string id = HandedOverThroughTheCluster(cluster, sequence);
  ASSERT_FALSE(id.empty());
  // Claimed (on Redis only here until a call reads it), then its slot is
  // moved: every key of it on the new master already, the old one
  // answering ASK for them.
  const int slot = SlotOf(id);
  const int from = cluster.MasterOf(slot, 0), to = (from + 1) % cluster.size();
  Daemon b(Flags("b", cluster.Url(from)));
  auto client = Connected("b", b);
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status() << b.Log();
  StartMove(cluster, slot, from, to);
  // Its pages are read through ASK.
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350)) << b.Log();
  // Writes (scripts over keys not all there yet) are refused while the slot
  // moves (TRYAGAIN), and go once it has moved (MOVED).
  std::thread done([&] {
    absl::SleepFor(absl::Seconds(1));
    FinishMove(cluster, slot, to);
  });
  EXPECT_EQ(AppendedOnceRedisTakesIt(sequence, *session, 350, 100, absl::Seconds(20)), 450) << b.Log();
  done.join();
  ASSERT_EQ(Appended(sequence.Append(*session, 450, 100)), 550);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 550));
  EXPECT_EQ(cluster.Run(to, {"EXISTS", ManifestKey(id)}).integer, 1);
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
  // Another daemon, told of the old master only, takes it over from the new.
  Daemon c(Flags("c", cluster.Url(from)));
  auto taken = Connected("c", c)->OpenSession(id);
  ASSERT_TRUE(taken.ok()) << taken.status() << c.Log();
  EXPECT_TRUE(Observe(*taken) == reference.Of(sequence, 350, 550));
  EXPECT_EQ(c.Stop(SIGTERM), 0) << c.Log();
}

TEST(RedisClusterTest, AClaimWhileItsSlotMovesIsRefusedForNowThenFindsTheSessionWhole) {
  SKIP_WITHOUT_REDIS();
  RedisClusterServers cluster(3);
  Reference reference;
  const Sequence sequence;
  const std::string id = HandedOverThroughTheCluster(cluster, sequence);
  ASSERT_FALSE(id.empty());
  const int slot = SlotOf(id);
  const int from = cluster.MasterOf(slot, 0), to = (from + 1) % cluster.size();
  StartMove(cluster, slot, from, to);
  // The claim's script needs the lease, which is on neither side: refused
  // for now (UNAVAILABLE, try again), never a session half there.
  Daemon b(Flags("b", cluster.Url(from)));
  auto client = Connected("b", b);
  const absl::StatusOr<Session> refused = client->OpenSession(id);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("TRYAGAIN"));
  FinishMove(cluster, slot, to);
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status() << b.Log();
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350));
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
}

TEST(RedisClusterTest, AMasterFailingOverToItsReplicaIsSurvived) {
  SKIP_WITHOUT_REDIS();
  RedisClusterServers cluster(3, 1);
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", cluster.SeedsUrl()));
  auto client = Connected("a", a);
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 200)), 200);
  const int master = cluster.MasterOf(SlotOf(session->id()), 0);
  ASSERT_GE(master, 0);
  // Replicated (Redis Cluster copies to replicas after it answers), then
  // the master goes: its replica takes its slots within a few seconds.
  absl::SleepFor(absl::Milliseconds(500));
  cluster.Kill(master);
  ASSERT_TRUE(cluster.WaitForFailover(SlotOf(session->id()), master, (master + 1) % 3, absl::Seconds(30)));
  EXPECT_EQ(AppendedOnceRedisTakesIt(sequence, *session, 200, 100, absl::Seconds(20)), 300) << a.Log();
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 200, 300));
  TakenOverWhole(a, cluster, session->id(), reference, sequence, 300);
}

TEST(RedisClusterTest, AMasterDownRefusesItsSessionsAppendsUntilItIsBack) {
  SKIP_WITHOUT_REDIS();
  RedisClusterServers cluster(3);
  Reference reference;
  const Sequence sequence;
  Daemon a(Flags("a", cluster.SeedsUrl()));
  auto client = Connected("a", a);
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_EQ(Appended(sequence.Append(*session, 0, 200)), 200);
  const int master = cluster.MasterOf(SlotOf(session->id()), 0);
  ASSERT_GE(master, 0);
  // A session on another master, written to while this one is down.
  absl::StatusOr<Session> other = client->CreateSession(Shape());
  for (int i = 0; i < 32 && other.ok() && cluster.MasterOf(SlotOf(other->id()), 0) == master; ++i) {
    other = client->CreateSession(Shape());
  }
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_NE(cluster.MasterOf(SlotOf(other->id()), 0), master);
  ASSERT_EQ(Appended(sequence.Append(*other, 0, 200)), 200);
  cluster.Kill(master);
  // Without a replica the cluster cannot serve that slot: the append is
  // refused (never held past the timeouts), attention goes on.
  const absl::Time sent = absl::Now();
  absl::StatusOr<int64_t> refused = sequence.Append(*session, 200, 10);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(10));
  EXPECT_TRUE(session->Attend(1, TensorData::F32(testing::GaussianVectors(kQHeads, kDim, 13))).ok());
  // The tier reads down (the gauge is refreshed every second), and then
  // the whole time the master is, although writes to the other masters go
  // through (it read up between two renewals before).
  const std::string tier_up = "turbokv_tier_up{tier=\"redis\"}";
  for (absl::Time until = absl::Now() + absl::Seconds(5);
       Sample(Scrape(a.MetricsAddress()), tier_up) != 0 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  int64_t other_tokens = 200;
  for (absl::Time until = absl::Now() + absl::Seconds(4); absl::Now() < until;) {
    absl::StatusOr<int64_t> appended = sequence.Append(*other, other_tokens, 10);
    if (appended.ok()) other_tokens = *appended;
    EXPECT_EQ(Sample(Scrape(a.MetricsAddress()), tier_up), 0) << a.Log();
    absl::SleepFor(absl::Milliseconds(200));
  }
  cluster.Start(master);
  ASSERT_TRUE(cluster.WaitUntilHealthy(absl::Seconds(20)));
  EXPECT_EQ(AppendedOnceRedisTakesIt(sequence, *session, 200, 100, absl::Seconds(20)), 300) << a.Log();
  // The tier up again (the gauge is refreshed every second).
  double up = 0;
  for (absl::Time until = absl::Now() + absl::Seconds(5); up != 1 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(200));
    up = Sample(Scrape(a.MetricsAddress()), tier_up);
  }
  EXPECT_EQ(up, 1);
  TakenOverWhole(a, cluster, session->id(), reference, sequence, 300);
}

}  // namespace
}  // namespace turbokv
