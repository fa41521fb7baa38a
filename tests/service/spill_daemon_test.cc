// The disk tier in the real turbokvd binary: 8x the memory budget across 64
// sessions comes back bit-exact; kill -9 under load and a restart on the same
// spill dir; a small tmpfs filling up.
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/daemon_testing.h"
#include "turbokv/v1/turbokv.grpc.pb.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::Daemon;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::Sample;
using ::turbokv::testing::Scrape;

constexpr int kLayers = 2, kKvHeads = 4, kQHeads = 8, kDim = 128;

std::string Socket() { return absl::StrCat("unix:///tmp/turbokvd-spill-", getpid(), ".sock"); }

std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "spill-daemon-", name, "-", getpid());
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

SessionOptions Shape(uint64_t seed) {
  SessionOptions options;
  options.layers = kLayers;
  options.kv_heads = kKvHeads;
  options.q_heads = kQHeads;
  options.head_dim = kDim;
  options.key_codec = v1::CODEC_TURBO3;
  options.value_codec = v1::CODEC_Q8_0;
  options.rotation_seed = seed;
  return options;
}

// A pool of token vectors; session s's tokens start at a different place in
// it, so that no two sessions hold the same data.
struct Pool {
  static constexpr int64_t kTokens = 4096;
  std::vector<float> k = GaussianVectors(kTokens * kKvHeads, kDim, 1), v = GaussianVectors(kTokens * kKvHeads, kDim, 2);
  // [layers][n][kv_heads][head_dim] for tokens [start, start + n) of session s.
  std::vector<float> Chunk(const std::vector<float>& from, int s, int64_t start, int64_t n) const {
    std::vector<float> out;
    const size_t row = size_t{kKvHeads} * kDim;
    for (int l = 0; l < kLayers; ++l) {
      for (int64_t t = start; t < start + n; ++t) {
        const size_t at = static_cast<size_t>((t + 97 * s + 13 * l) % kTokens) * row;
        out.insert(out.end(), from.begin() + at, from.begin() + at + row);
      }
    }
    return out;
  }
};

// A digest of what ReadKv gives back for the first tokens[l] tokens of every
// layer l of a session (one length: the same for every layer).
uint64_t Digest(const Session& session, const std::vector<int64_t>& tokens) {
  uint64_t hash = 1469598103934665603ull;
  for (int l = 0; l < kLayers; ++l) {
    absl::StatusOr<KvData> kv = session.ReadKv(l, 0, tokens[tokens.size() == 1 ? 0 : l]);
    EXPECT_TRUE(kv.ok()) << kv.status();
    if (!kv.ok()) return 0;
    for (const std::vector<float>* part : {&kv->keys, &kv->values}) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(part->data());
      for (size_t i = 0; i < part->size() * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    }
  }
  return hash;
}

TEST(SpillDaemonTest, EightTimesTheBudgetAcross64SessionsComesBackBitExact) {
  const std::string dir = FreshDir("8x");
  // 64 sessions x 2 layers x 2800 tokens x 4 heads x (52 + 136) bytes: 270 MB
  // against 32 MiB. Under AddressSanitizer (four times slower) half the
  // tokens against half the budget: the same eight times, in half the time.
  constexpr int kSessions = 64;
  constexpr int64_t kTokens = testing::kAddressSanitizer ? 1400 : 2800, kChunk = 700;
  constexpr int kBudgetMiB = testing::kAddressSanitizer ? 16 : 32;
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--threads=2",
                 "--memory-budget=" + std::to_string(kBudgetMiB) + "MiB", "--eviction=lru", "--spill-dir=" + dir});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  const Pool pool;
  const auto q = GaussianVectors(2 * kQHeads, kDim, 3);
  std::vector<Session> sessions;
  std::vector<uint64_t> digests;
  std::vector<std::vector<float>> attention;
  for (int s = 0; s < kSessions; ++s) {
    auto session = client->CreateSession(Shape(1000 + s));
    ASSERT_TRUE(session.ok()) << session.status();
    for (int64_t start = 0; start < kTokens; start += kChunk) {
      const auto k = pool.Chunk(pool.k, s, start, kChunk), v = pool.Chunk(pool.v, s, start, kChunk);
      auto appended = session->AppendAllLayers(start, TensorData::F32(k), TensorData::F32(v));
      ASSERT_TRUE(appended.ok()) << "session " << s << ": " << appended.status();
    }
    digests.push_back(Digest(*session, {kTokens}));
    auto attended = session->Attend(1, TensorData::F32(q));
    ASSERT_TRUE(attended.ok()) << attended.status();
    attention.push_back(attended->output);
    sessions.push_back(*std::move(session));
  }
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), kSessions);
  EXPECT_GT(stats->demoted_sessions(), kSessions / 2);
  EXPECT_EQ(stats->evictions(), 0);
  EXPECT_LE(stats->bytes_used(), kBudgetMiB << 20);
  // The compression ratio is that of the sessions in memory: at most what
  // the codecs give (16 bits over their bits per value), however many
  // sessions are on disk only.
  auto info = client->GetSession(sessions[0].id());
  ASSERT_TRUE(info.ok());
  const double codec_ratio = 16.0 / info->bits_per_value();
  EXPECT_LE(stats->compression_ratio(), codec_ratio);
  EXPECT_GT(stats->compression_ratio(), 0.8 * codec_ratio);
  EXPECT_LE(Sample(Scrape(daemon.MetricsAddress()), "turbokv_compression_ratio"), codec_ratio);
  // Every session, from wherever it is, reads back and attends exactly as
  // it did when it was all in memory.
  for (int s = 0; s < kSessions; ++s) {
    auto info = client->GetSession(sessions[s].id());
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layer_tokens(0), kTokens);
    EXPECT_EQ(Digest(sessions[s], {kTokens}), digests[s]) << "session " << s;
    auto attended = sessions[s].Attend(1, TensorData::F32(q));
    ASSERT_TRUE(attended.ok()) << attended.status();
    EXPECT_EQ(attended->output, attention[s]) << "session " << s;
  }
  stats = client->Stats();
  EXPECT_GT(stats->demotions(), kSessions);
  EXPECT_GT(stats->promotions(), kSessions / 2);
  const std::string metrics = Scrape(daemon.MetricsAddress());
  EXPECT_GT(Sample(metrics, "turbokv_demotions_total"), kSessions);
  EXPECT_GT(Sample(metrics, "turbokv_promotions_total"), kSessions / 2);
  EXPECT_GT(Sample(metrics, "turbokv_tier_live_bytes{tier=\"disk\"}"), 8.0 * (kBudgetMiB << 20) * 0.9);
  // The deprecated name says the same until it goes.
  EXPECT_EQ(Sample(metrics, "turbokv_spill_bytes"), Sample(metrics, "turbokv_tier_live_bytes{tier=\"disk\"}"));
  EXPECT_EQ(daemon.Stop(SIGTERM), 0) << daemon.Log();
}

// Sessions appended to by several clients while the budget forces
// demotions; kill -9; the restart on the same spill dir has every session,
// each a prefix of what was acknowledged (its sealed pages, and its tail as
// of its last demotion), bit-exact.
// A ReadKv stream read slowly, 16 tokens a message, while another client
// prefetches the other sessions through a budget that holds two: the
// stream's session is in a call for the whole stream, so the prefetches
// demote the others and the stream gets every token, as appended.
TEST(SpillDaemonTest, AReadKvStreamKeepsItsSessionInMemoryWhileOthersArePrefetched) {
  const std::string dir = FreshDir("readkv");
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--threads=2", "--memory-budget=3MiB", "--eviction=lru",
                 "--spill-dir=" + dir});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  constexpr int kSessions = 6, kTokens = 1500, kHead = 64;  // 770 KB a session: the budget holds three
  SessionOptions options;
  options.layers = 2;
  options.kv_heads = 1;
  options.q_heads = 1;
  options.head_dim = kHead;
  options.key_codec = v1::CODEC_F16;
  options.value_codec = v1::CODEC_F16;
  std::vector<std::string> ids;
  std::vector<std::vector<float>> keys;
  for (int s = 0; s < kSessions; ++s) {
    auto session = client->CreateSession(options);
    ASSERT_TRUE(session.ok()) << session.status();
    keys.push_back(GaussianVectors(2 * kTokens, kHead, 50 + s));  // compared as the daemon got them: fp16-rounded
    ASSERT_TRUE(session->AppendAllLayers(0, TensorData::F32(keys.back()), TensorData::F32(keys.back())).ok());
    ids.push_back(session->id());
  }
  auto stub = v1::KvCacheService::NewStub(grpc::CreateChannel(Socket(), grpc::InsecureChannelCredentials()));
  for (int round = 0; round < 3; ++round) {
    const int read = round % kSessions;
    std::vector<std::string> others;
    for (int s = 0; s < kSessions; ++s) {
      if (s != read) others.push_back(ids[s]);
    }
    std::atomic<bool> reading{true};
    std::thread prefetching([&] {
      for (size_t next = 0; reading.load(); ++next) {
        auto results = client->Prefetch({others[next % others.size()]});
        ASSERT_TRUE(results.ok()) << results.status();
        EXPECT_TRUE((*results)[0].ok()) << (*results)[0];
      }
    });
    v1::ReadKvRequest request;
    request.set_session_id(ids[read]);
    request.set_dtype(v1::DTYPE_F16);
    request.set_max_tokens_per_message(16);
    grpc::ClientContext context;
    auto stream = stub->ReadKv(&context, request);
    v1::ReadKvResponse response;
    int64_t tokens = 0;
    std::vector<int64_t> mismatches(2, 0);
    while (stream->Read(&response)) {
      const int64_t n = response.keys().shape(0);
      const auto* half = reinterpret_cast<const uint16_t*>(response.keys().data().data());
      for (int64_t i = 0; i < n * kHead; ++i) {
        const float sent = keys[read][static_cast<size_t>((response.layer() * kTokens + response.start()) * kHead + i)];
        if (HalfBitsToFloat(half[i]) != HalfBitsToFloat(FloatToHalfBits(sent))) ++mismatches[response.layer()];
      }
      tokens += n;
      absl::SleepFor(absl::Milliseconds(1));
    }
    const grpc::Status status = stream->Finish();
    reading.store(false);
    prefetching.join();
    EXPECT_TRUE(status.ok()) << "round " << round << " after " << tokens << " tokens: " << status.error_message();
    EXPECT_EQ(tokens, 2 * kTokens) << "round " << round;
    EXPECT_EQ(mismatches, std::vector<int64_t>(2, 0)) << "round " << round;
  }
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->demotions(), 3);  // the prefetches did move sessions
  EXPECT_EQ(daemon.Stop(SIGTERM), 0) << daemon.Log();
}

TEST(SpillDaemonTest, AfterKillNineTheRestartHasTheSealedPagesOfEverySession) {
  const std::string dir = FreshDir("kill");
  const std::vector<std::string> flags = {"--listen=" + Socket(), "--device=cpu", "--threads=2",
                                          "--memory-budget=8MiB", "--eviction=lru", "--spill-dir=" + dir};
  constexpr int kSessions = 16, kThreads = 4;
  constexpr int64_t kChunk = 96;  // not a whole page: every layer has an unsealed tail
  const Pool pool;
  std::vector<std::string> ids(kSessions);
  std::vector<std::atomic<int64_t>> acked(kSessions);
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    for (int s = 0; s < kSessions; ++s) ids[s] = client->CreateSession(Shape(2000 + s))->id();
    std::atomic<bool> stop{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        auto own = Client::Connect(Socket());
        for (int round = 0; !stop.load(); ++round) {
          const int s = (t + round * kThreads) % kSessions;
          auto session = own->OpenSession(ids[s]);
          if (!session.ok()) continue;
          // One thread per session at a time: sessions s = t mod kThreads.
          const int64_t start = acked[s].load();
          if (start + kChunk > Pool::kTokens) continue;
          const auto k = pool.Chunk(pool.k, s, start, kChunk), v = pool.Chunk(pool.v, s, start, kChunk);
          auto appended = session->AppendAllLayers(start, TensorData::F32(k), TensorData::F32(v));
          if (appended.ok()) acked[s].store(*appended);
        }
      });
    }
    absl::SleepFor(absl::Seconds(4));
    ASSERT_EQ(kill(daemon.pid(), SIGKILL), 0);
    stop.store(true);
    for (auto& thread : threads) thread.join();
    daemon.Wait();
  }
  Daemon daemon(flags);
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  EXPECT_THAT(daemon.Log(), HasSubstr(absl::StrCat("spill tier ", dir)));
  EXPECT_THAT(daemon.Log(), HasSubstr(absl::StrCat(kSessions, " session(s) restored")));
  int64_t recovered = 0, sent = 0;
  for (int s = 0; s < kSessions; ++s) {
    auto session = client->OpenSession(ids[s]);
    ASSERT_TRUE(session.ok()) << session.status();
    auto info = session->Info();
    ASSERT_TRUE(info.ok());
    // Sealed pages, and the tail written when the session was last demoted,
    // in each layer: the layers' pages are written in turn, so the kill can
    // leave one layer a page ahead of another. At most the chunk in flight
    // at the kill (stored, its answer lost) past what was acknowledged.
    std::vector<int64_t> tokens;
    for (int l = 0; l < kLayers; ++l) tokens.push_back(info->layer_tokens(l));
    const int64_t most = *std::max_element(tokens.begin(), tokens.end());
    EXPECT_LE(most, acked[s].load() + kChunk);
    recovered += std::min(tokens[0], acked[s].load());
    sent += acked[s].load();
    // What came back is what was sent: the daemon encodes the same tokens,
    // in the same chunks (the first fits each layer's key transform), into a
    // fresh session with the same seed, and both read alike.
    if (most == 0) continue;
    auto fresh = client->CreateSession(Shape(2000 + s));
    ASSERT_TRUE(fresh.ok());
    for (int64_t start = 0; start < most; start += kChunk) {
      const int64_t n = std::min(kChunk, most - start);
      const auto k = pool.Chunk(pool.k, s, start, n), v = pool.Chunk(pool.v, s, start, n);
      ASSERT_TRUE(fresh->AppendAllLayers(start, TensorData::F32(k), TensorData::F32(v)).ok());
    }
    EXPECT_EQ(Digest(*session, tokens), Digest(*fresh, tokens)) << "session " << s;
    ASSERT_TRUE(fresh->Delete().ok());
  }
  // All but the unsealed tails and what the writer had queued came back.
  EXPECT_GT(recovered, sent / 2) << recovered << " of " << sent << " tokens";
  std::printf("kill -9: %lld of %lld acknowledged tokens came back\n", static_cast<long long>(recovered),
              static_cast<long long>(sent));
  EXPECT_EQ(daemon.Stop(SIGTERM), 0) << daemon.Log();
}

// A drain writes the unsealed tails too: the next start has everything.
TEST(SpillDaemonTest, ADrainKeepsTheTailsAndTheRestartHasEverything) {
  const std::string dir = FreshDir("drain");
  const std::vector<std::string> flags = {"--listen=" + Socket(), "--device=cpu", "--threads=2",
                                          "--memory-budget=64MiB", "--spill-dir=" + dir};
  const Pool pool;
  std::string id;
  uint64_t digest = 0;
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    auto session = client->CreateSession(Shape(7));
    ASSERT_TRUE(session.ok());
    const auto k = pool.Chunk(pool.k, 0, 0, 1000), v = pool.Chunk(pool.v, 0, 0, 1000);
    ASSERT_TRUE(session->AppendAllLayers(0, TensorData::F32(k), TensorData::F32(v)).ok());
    id = session->id();
    digest = Digest(*session, {1000});
    auto info = session->Info();
    EXPECT_EQ(info->residency(), v1::RESIDENCY_MEMORY_AND_DISK);
    EXPECT_EQ(daemon.Stop(SIGTERM), 0) << daemon.Log();
  }
  Daemon daemon(flags);
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  auto info = client->GetSession(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->residency(), v1::RESIDENCY_DISK);
  EXPECT_EQ(info->layer_tokens(1), 1000);
  EXPECT_GT(info->disk_bytes(), 0);
  auto prefetched = client->Prefetch({id, "nosuchsession"});
  ASSERT_TRUE(prefetched.ok());
  EXPECT_TRUE((*prefetched)[0].ok()) << (*prefetched)[0];
  EXPECT_EQ((*prefetched)[1].code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->GetSession(id)->residency(), v1::RESIDENCY_MEMORY_AND_DISK);
  auto session = client->OpenSession(id);
  EXPECT_EQ(Digest(*session, {1000}), digest);
  // Deleted sessions do not come back.
  ASSERT_TRUE(session->Delete().ok());
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  Daemon again(flags);
  auto third = Client::Connect(Socket());
  ASSERT_TRUE(third->WaitUntilServing(absl::Seconds(20)).ok()) << again.Log();
  EXPECT_EQ(third->GetSession(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.Stop(SIGTERM), 0);
}

// A spill dir on a small tmpfs: the disk fills, writes fail with ENOSPC,
// sessions stay in memory and the call that needed room is refused naming
// both tiers; nothing is half-written.
TEST(SpillDaemonTest, AFullDiskRefusesWithBothTiersNamedAndLosesNothing) {
  const std::string dir = FreshDir("tmpfs");
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=4m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << "): needs root with CAP_SYS_ADMIN";
  }
  {
    Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--threads=2", "--memory-budget=4MiB", "--eviction=lru",
                   "--spill-dir=" + dir, "--spill-budget=64MiB"});
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    const Pool pool;
    absl::Status refused;
    std::vector<std::pair<Session, int64_t>> stored;
    for (int s = 0; s < 32 && refused.ok(); ++s) {
      auto session = client->CreateSession(Shape(3000 + s));
      if (!session.ok()) {
        refused = session.status();
        break;
      }
      const auto k = pool.Chunk(pool.k, s, 0, 500), v = pool.Chunk(pool.v, s, 0, 500);
      auto appended = session->AppendAllLayers(0, TensorData::F32(k), TensorData::F32(v));
      if (!appended.ok()) {
        refused = appended.status();
        EXPECT_EQ(session->Info()->layer_tokens(0), 0) << "a refused chunk is not half-stored";
        break;
      }
      stored.emplace_back(*session, *appended);
    }
    ASSERT_FALSE(refused.ok()) << "8x a 4 MiB disk was written";
    EXPECT_TRUE(refused.code() == absl::StatusCode::kResourceExhausted || refused.code() == absl::StatusCode::kUnavailable)
        << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("memory budget")) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("spill")) << refused;
    // Every session that was acknowledged is still whole, in memory or on
    // disk (those on disk cannot come back while both tiers are full).
    for (auto& [session, tokens] : stored) {
      auto info = session.Info();
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->layer_tokens(0), tokens);
      if (info->residency() != v1::RESIDENCY_DISK) {
        EXPECT_TRUE(session.ReadKv(0).ok());
      }
    }
    // The gauges and counters are refreshed every second.
    double write_errors = 0;
    for (absl::Time until = absl::Now() + absl::Seconds(5); write_errors <= 0 && absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(200))) {
      write_errors = Sample(Scrape(daemon.MetricsAddress()), "turbokv_tier_write_errors_total{tier=\"disk\"}");
    }
    EXPECT_GT(write_errors, 0);
    EXPECT_THAT(daemon.Log(), HasSubstr("No space left on device"));
    daemon.Stop(SIGKILL);
  }
  umount2(dir.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace turbokv
