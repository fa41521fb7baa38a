// The disk and Redis stacked (--spill-dir with --redis-url) in the real
// turbokvd binary, on a real redis-server: a demoted session comes back from
// the local disk (Redis stopped meanwhile), a restart claims what the disk
// holds only while nobody else claimed it since, a kill -9 restart gets
// every acknowledged token once the lease lapses, a disk-only daemon's
// sessions go to Redis when Redis is added, and a Redis restarted empty gets
// every session back, those on the disk alone too.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/daemon_testing.h"
#include "tests/service/redis_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::turbokv::testing::Daemon;
using ::turbokv::testing::Sample;
using ::turbokv::testing::Scrape;

std::string SpillDir(const std::string& name) {
  const std::string dir = TempPath("spill-" + name);
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

// A stacked daemon's flags.
std::vector<std::string> Stacked(const std::string& name, const RedisServer& redis,
                                 const std::string& dir,
                                 std::vector<std::string> more = {}) {
  more.push_back("--spill-dir=" + dir);
  return Flags(name, redis, more);
}

v1::Residency ResidencyOf(const Session& session) {
  auto info = session.Info();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->residency() : v1::RESIDENCY_UNSPECIFIED;
}

TEST(StackedTierTest, ADemotedSessionComesBackFromTheLocalDiskWhileRedisIsStopped) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence, other(29);
  // A budget that holds one session of 350 tokens, not two.
  Daemon a(
      Stacked("a", redis, SpillDir("a"), {"--memory-budget=160KiB", "--eviction=lru"}));
  auto client = Connected("a", a);
  auto first = client->CreateSession(Shape());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(Appended(sequence.Append(*first, 0, 350)), 350);
  auto second = client->CreateSession(Shape());
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(Appended(other.Append(*second, 0, 350)), 350);
  ASSERT_EQ(ResidencyOf(*first), v1::RESIDENCY_DISK) << a.Log();
  // Both tiers hold it, each in its own series.
  absl::SleepFor(absl::Milliseconds(1200));
  const std::string metrics = Scrape(a.MetricsAddress());
  EXPECT_EQ(Sample(metrics, "turbokv_tier_sessions{tier=\"disk\"}"), 1);
  EXPECT_EQ(Sample(metrics, "turbokv_tier_sessions{tier=\"redis\"}"), 1);
  EXPECT_GT(Sample(metrics, "turbokv_tier_live_bytes{tier=\"disk\"}"), 0);
  EXPECT_GT(Sample(metrics, "turbokv_tier_live_bytes{tier=\"redis\"}"), 0);
  EXPECT_GT(Sample(metrics, "turbokv_tier_budget_bytes{tier=\"disk\"}"), 0);
  // Room for it without demoting another (which would wait for Redis), and
  // then Redis stopped: the promotion reads the disk alone.
  ASSERT_TRUE(second->Delete().ok());
  redis.Signal(SIGSTOP);
  EXPECT_TRUE(Observe(*first) == reference.Of(sequence, 350, 350)) << a.Log();
  EXPECT_EQ(ResidencyOf(*first), v1::RESIDENCY_MEMORY_AND_DISK);
  redis.Signal(SIGCONT);
  // Appends go on, and answer once Redis holds them.
  ASSERT_EQ(Appended(sequence.Append(*first, 350, 50)), 400);
  EXPECT_TRUE(Observe(*first) == reference.Of(sequence, 350, 400));
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
}

// A session of each sequence's first `tokens` tokens, in order (fewer: a
// failure, reported).
std::vector<Session> SessionsOf(const Client& client, const std::vector<Sequence>& sequences, int64_t tokens) {
  std::vector<Session> sessions;
  for (const Sequence& sequence : sequences) {
    auto session = client.CreateSession(Shape());
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok() || Appended(sequence.Append(*session, 0, tokens)) != tokens) break;
    sessions.push_back(*std::move(session));
  }
  return sessions;
}

// Redis restarted empty under a stacked daemon holding sessions demoted to
// its disk: an append to one (promoted from the disk) is acknowledged only
// once Redis holds the whole session again. Killed right after that append,
// the daemon leaves it whole in Redis: another daemon without the disk
// takes it over, every acknowledged token in.
TEST(StackedTierTest, AnAppendAfterRedisRestartedEmptyWaitsForTheWholeSession) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis(/*persistent=*/false);
  Reference reference;
  const std::vector<Sequence> sequences = {Sequence(51), Sequence(52), Sequence(53)};
  // A budget that holds one session of 350 tokens, not two.
  Daemon a(Stacked("a", redis, SpillDir("lost"), {"--memory-budget=160KiB", "--eviction=lru"}));
  auto client = Connected("a", a);
  const std::vector<Session> sessions = SessionsOf(*client, sequences, 350);
  ASSERT_EQ(sessions.size(), sequences.size());
  ASSERT_EQ(ResidencyOf(sessions[0]), v1::RESIDENCY_DISK) << a.Log();
  ASSERT_EQ(ResidencyOf(sessions[1]), v1::RESIDENCY_DISK) << a.Log();
  redis.Kill();
  redis.Start();
  // At once: an append to the first (promoted from the disk, and answered
  // once the session is in Redis again), retried while A finds out.
  absl::StatusOr<int64_t> appended = sequences[0].Append(sessions[0], 350, 50);
  for (absl::Time until = absl::Now() + absl::Seconds(10); !appended.ok() && absl::Now() < until;) {
    ASSERT_EQ(appended.status().code(), absl::StatusCode::kUnavailable) << appended.status();
    absl::SleepFor(absl::Milliseconds(50));
    appended = sequences[0].Append(sessions[0], 350, 50);
  }
  ASSERT_EQ(Appended(appended), 400) << a.Log();
  ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
  a.Wait();
  Daemon b(Flags("b", redis));
  auto client_b = Connected("b", b);
  absl::StatusOr<Session> first = OpenedOnceTheLeaseLapses(*client_b, sessions[0].id());
  ASSERT_TRUE(first.ok()) << first.status() << "\n" << a.Log();
  EXPECT_TRUE(Observe(*first) == reference.Of(sequences[0], 350, 400));
  EXPECT_THAT(a.Log(), HasSubstr("writes the session again"));
  EXPECT_THAT(a.Log(), Not(HasSubstr("could not be read back to write it again")));
  EXPECT_THAT(b.Log(), Not(HasSubstr("DATA_LOSS")));
}

// Redis restarted empty under a stacked daemon, then a drain: the sessions
// on its disk alone are written back to Redis from the disk (not only those
// in memory) before the drain ends, and another daemon finds them whole.
TEST(StackedTierTest, RedisRestartedEmptyLosesNoDemotedSessionAtADrain) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis(/*persistent=*/false);
  Reference reference;
  const std::vector<Sequence> sequences = {Sequence(61), Sequence(62), Sequence(63)};
  Daemon a(Stacked("a", redis, SpillDir("lost-drain"), {"--memory-budget=160KiB", "--eviction=lru"}));
  auto client = Connected("a", a);
  std::vector<std::string> ids;
  for (const Session& session : SessionsOf(*client, sequences, 350)) ids.push_back(session.id());
  ASSERT_EQ(ids.size(), sequences.size());
  redis.Kill();
  redis.Start();
  // A notices at its next renewal (a quarter of the 1 s lease) and writes
  // them again in its background pass.
  for (absl::Time until = absl::Now() + absl::Seconds(10);
       Sample(Scrape(a.MetricsAddress()), "turbokv_tier_rewrites_total{tier=\"redis\"}") < 3 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  Daemon b(Flags("b", redis));
  auto client_b = Connected("b", b);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto session = client_b->OpenSession(ids[i]);
    ASSERT_TRUE(session.ok()) << "session " << i << ": " << session.status() << "\n" << a.Log();
    EXPECT_TRUE(Observe(*session) == reference.Of(sequences[i], 350, 350)) << i;
  }
  EXPECT_THAT(b.Log(), Not(HasSubstr("DATA_LOSS")));
}

TEST(StackedTierTest, ARestartAfterADrainClaimsTheDisksCopyAndReadsIt) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const std::string dir = SpillDir("drain");
  const std::string id = HandedOver(redis, sequence, 350, {"--spill-dir=" + dir});
  ASSERT_FALSE(id.empty());
  Daemon again(Stacked("a", redis, dir));
  auto client = Connected("a", again);
  EXPECT_THAT(
      again.Log(),
      HasSubstr("1 session(s) on the local disk tier: 1 claimed from the redis tier"));
  auto listed = client->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(ResidencyOf(*session), v1::RESIDENCY_DISK);
  redis.Signal(SIGSTOP);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350)) << again.Log();
  redis.Signal(SIGCONT);
  // This daemon owns it again: its appends are fenced by the new epoch.
  ASSERT_EQ(Appended(sequence.Append(*session, 350, 100)), 450);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 450));
  EXPECT_EQ(again.Stop(SIGTERM), 0) << again.Log();
}

TEST(StackedTierTest, ACopyAnotherDaemonClaimedSinceIsDroppedNeverServed) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const std::string dir = SpillDir("taken");
  const std::string id = HandedOver(redis, sequence, 200, {"--spill-dir=" + dir});
  ASSERT_FALSE(id.empty());
  // Another daemon takes it over, writes more, and holds it while this one
  // restarts: the copy is dropped at once, not kept waiting for the lease.
  Daemon b(Flags("b", redis));
  auto b_client = Connected("b", b);
  {
    auto session = b_client->OpenSession(id);
    ASSERT_TRUE(session.ok()) << session.status() << b.Log();
    ASSERT_EQ(Appended(sequence.Append(*session, 200, 150)), 350);
  }
  Daemon again(Stacked("a", redis, dir));
  auto client = Connected("a", again);
  EXPECT_THAT(again.Log(), HasSubstr("its copy on the local disk tier is dropped, never served"));
  EXPECT_THAT(again.Log(), HasSubstr("was claimed by another turbokvd since"));
  EXPECT_THAT(again.Log(), HasSubstr("0 waiting for their claim"));
  auto listed = client->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(client->OpenSession(id).status().code(), absl::StatusCode::kFailedPrecondition);
  // Handed over, it is claimed from Redis as the other daemon left it.
  ASSERT_EQ(b.Stop(SIGTERM), 0) << b.Log();
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status() << again.Log();
  EXPECT_EQ(session->Info()->layer_tokens(0), 350);
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 200, 350));
  EXPECT_EQ(again.Stop(SIGTERM), 0) << again.Log();
}

TEST(StackedTierTest, ASessionTheStoreCannotTakeAtARestartStaysWholeInRedis) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const std::string dir = SpillDir("full");
  const std::string first = HandedOver(redis, sequence, 350, {"--spill-dir=" + dir});
  const std::string second = HandedOver(redis, sequence, 350, {"--spill-dir=" + dir});
  ASSERT_FALSE(first.empty());
  ASSERT_FALSE(second.empty());
  {
    // Room for one of the two: the other is let go in Redis, whole.
    Daemon again(Stacked("a", redis, dir, {"--max-sessions=1"}));
    auto client = Connected("a", again);
    auto listed = client->ListSessions();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->size(), 1u) << again.Log();
    ASSERT_EQ(again.Stop(SIGTERM), 0) << again.Log();
  }
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  for (const std::string& id : {first, second}) {
    auto session = client->OpenSession(id);
    ASSERT_TRUE(session.ok()) << session.status() << b.Log();
    EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350));
  }
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
}

TEST(StackedTierTest,
     AKillNineRestartClaimsItsCopyOnceTheLeaseLapsesWithEveryAcknowledgedToken) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence, rewritten(41);
  const std::string dir = SpillDir("kill");
  std::string id;
  {
    // Pages rewritten at the same indexes after a truncation, and the
    // disk's copies of the new ones lost to the kill (its segment cut back
    // to where it was at the truncation): the disk's older pages at those
    // indexes must not be taken for Redis's.
    Daemon a(Stacked("a", redis, dir));
    auto client = Connected("a", a);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 200)), 200);
    ASSERT_TRUE(session->Truncate(100).ok());
    absl::SleepFor(
        absl::Milliseconds(300));  // the disk's writer has the truncation's manifest
    const std::string segment = dir + "/seg-00000001.tkvl";
    struct stat at_truncation;
    ASSERT_EQ(stat(segment.c_str(), &at_truncation), 0);
    ASSERT_EQ(Appended(rewritten.Append(*session, 100, 200)), 300);
    id = session->id();
    ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
    a.Wait();
    ASSERT_EQ(truncate(segment.c_str(), at_truncation.st_size), 0);
  }
  Daemon again(Stacked("a", redis, dir));
  auto client = Connected("a", again);
  EXPECT_THAT(again.Log(), HasSubstr("1 waiting for their claim"));
  // The background pass claims it once the killed run's lease (1 s) lapses.
  absl::StatusOr<std::vector<v1::SessionInfo>> listed = client->ListSessions();
  for (absl::Time until = absl::Now() + absl::Seconds(5);
       listed.ok() && listed->empty() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
    listed = client->ListSessions();
  }
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u) << again.Log();
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->Info()->layer_tokens(1), 300);
  EXPECT_TRUE(Observe(*session) ==
              reference.Of({{&sequence, 100}, {&rewritten, 300}}, 200))
      << again.Log();
  EXPECT_EQ(again.Stop(SIGTERM), 0) << again.Log();
}

TEST(StackedTierTest, ADiskOnlyDaemonsSessionsGoToRedisWhenRedisIsAdded) {
  SKIP_WITHOUT_REDIS();
  RedisServer redis;
  Reference reference;
  const Sequence sequence;
  const std::string dir = SpillDir("added");
  std::string id;
  {
    Daemon alone({"--listen=" + Socket("alone"), "--device=cpu", "--threads=1",
                  "--spill-dir=" + dir});
    auto client = Connected("alone", alone);
    auto session = client->CreateSession(Shape());
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_EQ(Appended(sequence.Append(*session, 0, 350)), 350);
    id = session->id();
    ASSERT_EQ(alone.Stop(SIGTERM), 0) << alone.Log();
  }
  {
    Daemon a(Stacked("a", redis, dir));
    auto client = Connected("a", a);
    EXPECT_THAT(a.Log(), HasSubstr("written without the redis tier, is now in it too"));
    auto session = client->OpenSession(id);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350)) << a.Log();
    ASSERT_EQ(a.Stop(SIGTERM), 0) << a.Log();
  }
  // In Redis whole: a daemon without the disk takes it over.
  Daemon b(Flags("b", redis));
  auto client = Connected("b", b);
  auto session = client->OpenSession(id);
  ASSERT_TRUE(session.ok()) << session.status() << b.Log();
  EXPECT_TRUE(Observe(*session) == reference.Of(sequence, 350, 350));
  EXPECT_THAT(b.Log(), Not(HasSubstr("DATA_LOSS")));
  EXPECT_EQ(b.Stop(SIGTERM), 0) << b.Log();
}

}  // namespace
}  // namespace turbokv
