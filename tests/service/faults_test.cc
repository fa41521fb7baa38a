// Faults and load against the real turbokvd binary: a client that cancels,
// one that vanishes, SIGTERM under load, and a bounded load test whose
// memory must return to its baseline.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/daemon_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::Daemon;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::kAddressSanitizer;

std::string Socket() { return absl::StrCat("unix:///tmp/turbokvd-faults-", getpid(), ".sock"); }

SessionOptions Shape() {
  SessionOptions options;
  options.layers = 2;
  options.kv_heads = 8;
  options.q_heads = 32;
  options.head_dim = 128;
  return options;
}

constexpr int64_t kChunk = 32;

TEST(FaultsTest, ACancelledStreamKeepsWholeChunksAndTheSessionGoesOn) {
  Daemon daemon({"--listen=" + Socket(), "--device=cpu"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  auto session = client->CreateSession(Shape());
  ASSERT_TRUE(session.ok());
  const auto k = GaussianVectors(kChunk * 8, 128, 1);
  {
    auto stream = session->OpenAppendStream();
    for (int c = 0; c < 3; ++c) ASSERT_TRUE(stream->Write(0, c * kChunk, TensorData::F32(k), TensorData::F32(k)).ok());
    while (stream->acknowledged() < 3) absl::SleepFor(absl::Milliseconds(2));
    for (int c = 3; c < 40; ++c) {
      if (!stream->Write(0, c * kChunk, TensorData::F32(k), TensorData::F32(k)).ok()) break;
    }
    // Destroyed without Finish: the stream is cancelled mid-flight.
  }
  const int64_t tokens = session->Info()->layer_tokens(0);
  EXPECT_GE(tokens, 3 * kChunk);        // acknowledged chunks stay
  EXPECT_EQ(tokens % kChunk, 0);        // and no chunk is half-applied
  // The worker retries from its last acknowledgement: repeats are acknowledged.
  auto retried = session->Append(0, 3 * kChunk, TensorData::F32(k), TensorData::F32(k));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(*retried, std::max(tokens, 4 * kChunk));
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
}

TEST(FaultsTest, AClientThatVanishesLeavesTheDaemonServing) {
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--shutdown-deadline=5s"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  SessionOptions options = Shape();
  auto session = client->CreateSession(options);
  ASSERT_TRUE(session.ok());
  // The CLI streams a long prefill and is killed mid-way, without closing anything.
  const std::string target = "--target=" + Socket();
  const pid_t child = fork();
  if (child == 0) {
    execl(TURBOKV_CLI_PATH, TURBOKV_CLI_PATH, target.c_str(), "append-random", session->id().c_str(),
          "--tokens=200000", "--chunk=64", static_cast<char*>(nullptr));
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (session->Info()->layer_tokens(0) < 256 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(session->Info()->layer_tokens(0), 256);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  absl::SleepFor(absl::Milliseconds(200));
  const int64_t tokens = session->Info()->layer_tokens(0);
  EXPECT_EQ(tokens, session->Info()->layer_tokens(1));  // all-layer chunks: whole or not at all
  EXPECT_EQ(tokens % 64, 0);
  const auto q = GaussianVectors(32, 128, 2);
  EXPECT_TRUE(session->Attend(0, TensorData::F32(q)).ok());
  // Nothing is left in flight: SIGTERM drains at once.
  const absl::Time stop = absl::Now();
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  EXPECT_LT(absl::Now() - stop, absl::Seconds(4)) << daemon.Log();
}

TEST(FaultsTest, SigtermUnderLoadDrainsAndKeepsEveryAcknowledgedToken) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "turbokvd-drain-", getpid());
  std::system(("rm -rf " + dir).c_str());
  const std::vector<std::string> flags = {"--listen=" + Socket(), "--device=cpu", "--snapshot-dir=" + dir,
                                          "--shutdown-deadline=10s"};
  constexpr int kThreads = 4;
  std::vector<std::string> ids(kThreads);
  std::vector<int64_t> acknowledged(kThreads, 0);
  std::mutex mutex;
  std::vector<std::string> unexpected;
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    std::vector<Session> sessions;
    for (int t = 0; t < kThreads; ++t) {
      auto session = client->CreateSession(Shape());
      ASSERT_TRUE(session.ok()) << session.status();
      ids[t] = session->id();
      sessions.push_back(*std::move(session));
    }
    std::atomic<int> calls{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const auto k = GaussianVectors(8, 128, t), q = GaussianVectors(32, 128, t + 9);
        for (int64_t position = 0;; ++position) {
          auto step = sessions[t].Step(position % 2, position / 2, TensorData::F32(k), TensorData::F32(k),
                                       TensorData::F32(q));
          if (!step.ok()) {
            // Once draining, calls are refused; nothing else is expected.
            if (step.status().code() != absl::StatusCode::kUnavailable) {
              std::lock_guard<std::mutex> lock(mutex);
              unexpected.push_back(step.status().ToString());
            }
            return;
          }
          acknowledged[t] = position + 1;
          ++calls;
        }
      });
    }
    while (calls.load() < 200) absl::SleepFor(absl::Milliseconds(10));
    kill(daemon.pid(), SIGTERM);
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(daemon.Wait(), 0) << daemon.Log();
  }
  EXPECT_TRUE(unexpected.empty()) << unexpected.front();
  Daemon restarted(flags);
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << restarted.Log();
  for (int t = 0; t < kThreads; ++t) {
    auto info = client->GetSession(ids[t]);
    ASSERT_TRUE(info.ok()) << info.status();
    // Steps alternate layers: every acknowledged one is in the snapshot.
    EXPECT_GE(info->layer_tokens(0) + info->layer_tokens(1), acknowledged[t]) << t;
  }
  EXPECT_EQ(restarted.Stop(SIGTERM), 0);
  std::system(("rm -rf " + dir).c_str());
}

TEST(LoadTest, TwoHundredSessionsOfMixedCallsThenMemoryReturnsToBaseline) {
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--memory-budget=2GiB", "--threads=2"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  // Warm up the daemon's threads and allocator once, then take the baseline.
  {
    auto warm = client->CreateSession(Shape());
    ASSERT_TRUE(warm.ok());
    const auto k = GaussianVectors(kChunk * 8, 128, 1);
    ASSERT_TRUE(warm->Append(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());
    ASSERT_TRUE(warm->Delete().ok());
  }
  const size_t baseline_rss = static_cast<size_t>(daemon.MemoryBytes());
  constexpr int kThreads = 8, kSessions = 200;
  const absl::Duration run_for = absl::Seconds(8);
  std::mutex mutex;
  std::vector<double> latencies_us;
  std::atomic<int64_t> calls{0};
  std::set<std::string> errors;
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto own = Client::Connect(Socket());
      std::mt19937 rng(t);
      std::vector<Session> sessions;
      std::vector<int64_t> lengths;
      auto fail = [&](const absl::Status& status, const char* what) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.insert(absl::StrCat(what, ": ", status.ToString()));
      };
      SessionOptions shape = Shape();
      shape.layers = 1;
      for (int s = 0; s < kSessions / kThreads; ++s) {
        auto session = own->CreateSession(shape);
        if (!session.ok()) return fail(session.status(), "create");
        sessions.push_back(*std::move(session));
        lengths.push_back(0);
      }
      const auto k = GaussianVectors(kChunk * 8, 128, t), one = GaussianVectors(8, 128, t + 1),
                 q = GaussianVectors(32, 128, t + 2);
      std::vector<double> mine;
      while (absl::Now() - start < run_for) {
        const size_t i = rng() % sessions.size();
        Session& session = sessions[i];
        const int op = static_cast<int>(rng() % 10);
        const absl::Time begin = absl::Now();
        absl::Status status;
        if (op < 4 || lengths[i] == 0) {
          absl::StatusOr<int64_t> n = session.Append(0, lengths[i], TensorData::F32(k), TensorData::F32(k));
          status = n.status();
          if (n.ok()) lengths[i] = *n;
        } else if (op < 7) {
          status = session.Attend(0, TensorData::F32(q)).status();
        } else if (op < 9) {
          absl::StatusOr<StepResult> step =
              session.Step(0, lengths[i], TensorData::F32(one), TensorData::F32(one), TensorData::F32(q));
          status = step.status();
          if (step.ok()) lengths[i] = step->tokens;
        } else {
          absl::StatusOr<Session> fork = session.Fork(lengths[i] / 2);
          status = fork.ok() ? fork->Delete() : fork.status();
        }
        mine.push_back(absl::ToDoubleMicroseconds(absl::Now() - begin));
        ++calls;
        if (!status.ok()) fail(status, "call");
        if (lengths[i] > 2048) {  // long enough: delete it and start a new one
          status = session.Delete();
          if (!status.ok()) fail(status, "delete");
          auto fresh = own->CreateSession(shape);
          if (!fresh.ok()) return fail(fresh.status(), "create");
          sessions[i] = *std::move(fresh);
          lengths[i] = 0;
        }
      }
      for (Session& session : sessions) {
        if (absl::Status status = session.Delete(); !status.ok()) fail(status, "delete");
      }
      std::lock_guard<std::mutex> lock(mutex);
      latencies_us.insert(latencies_us.end(), mine.begin(), mine.end());
    });
  }
  size_t peak_rss = baseline_rss;
  while (absl::Now() - start < run_for) {
    peak_rss = std::max(peak_rss, static_cast<size_t>(daemon.MemoryBytes()));
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (auto& thread : threads) thread.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_TRUE(errors.empty()) << *errors.begin();
  std::sort(latencies_us.begin(), latencies_us.end());
  const double p99 = latencies_us.empty() ? 0 : latencies_us[latencies_us.size() * 99 / 100];
  std::printf("load: %d sessions, %d client threads, %.1f s: %lld calls, %.0f calls/s, p50 %.0f us, p99 %.0f us; "
              "RSS baseline %.1f MiB, peak %.1f MiB\n",
              kSessions, kThreads, seconds, static_cast<long long>(calls.load()), calls.load() / seconds,
              latencies_us.empty() ? 0 : latencies_us[latencies_us.size() / 2], p99, baseline_rss / 1048576.0,
              peak_rss / 1048576.0);
  ::testing::Test::RecordProperty("calls_per_second", static_cast<int>(calls.load() / seconds));
  ::testing::Test::RecordProperty("p99_us", static_cast<int>(p99));
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), 0);
  EXPECT_EQ(stats->bytes_used(), 0);
  EXPECT_GT(peak_rss, baseline_rss + (size_t{32} << 20));  // the load did take memory
  // Pages go back to the kernel: RSS returns to within 16 MiB of the
  // baseline once the heap is trimmed (within a second of the pool
  // shrinking). (Not under AddressSanitizer, whose quarantine keeps freed
  // heap memory on purpose.)
  if (!kAddressSanitizer) {
    size_t rss = static_cast<size_t>(daemon.MemoryBytes());
    for (absl::Time until = absl::Now() + absl::Seconds(3); rss >= baseline_rss + (size_t{16} << 20) && absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(100))) {
      rss = static_cast<size_t>(daemon.MemoryBytes());
    }
    EXPECT_LT(rss, baseline_rss + (size_t{16} << 20)) << "baseline " << baseline_rss << ", peak " << peak_rss;
  }
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace turbokv
