// The real turbokvd binary, started as a process and driven through the C++
// client: start-up log, calls, budget and eviction, bad flags, SIGTERM.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/backend_testing.h"
#include "tests/service/daemon_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::Daemon;
using ::turbokv::testing::GaussianVectors;

std::string Socket() { return absl::StrCat("unix:///tmp/turbokvd-test-", getpid(), ".sock"); }

// 2 layers, 2 kv heads, 4 q heads, d = 128, turbo3 (the budget tests count its bytes).
SessionOptions SmallSession() {
  SessionOptions options;
  options.layers = 2;
  options.kv_heads = 2;
  options.q_heads = 4;
  options.key_codec = options.value_codec = v1::CODEC_TURBO3;
  return options;
}

// The daemon on each device; the GPU skips, saying why, where it cannot serve.
class TurbokvdDeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cpu") return;
    absl::StatusOr<std::unique_ptr<Backend>> probe = testing::TestBackend(GetParam(), nullptr, size_t{1} << 20);
    if (!probe.ok()) GTEST_SKIP() << GetParam() << " cannot serve here: " << probe.status().message();
  }
};

TEST_P(TurbokvdDeviceTest, ServesThroughTheClientAndExitsCleanlyOnSigterm) {
  Daemon daemon({"--listen=" + Socket(), "--device", GetParam(), "--threads=2", "--memory-budget=64MiB"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  auto session = client->CreateSession(SmallSession());
  ASSERT_TRUE(session.ok()) << session.status();
  const auto k = GaussianVectors(2 * 100 * 2, 128, 1);
  ASSERT_EQ(*session->AppendAllLayers(0, TensorData::F32(k), TensorData::F32(k)), 100);
  const auto q = GaussianVectors(4, 128, 2);
  auto attention = session->Attend(1, TensorData::F32(q));
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_EQ(attention->output.size(), 4u * 128);
  EXPECT_EQ(client->Stats()->budget_bytes(), 64 << 20);

  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  const std::string log = daemon.Log();
  EXPECT_THAT(log, HasSubstr(GetParam() == "cpu" ? "device cpu (simd:" : "device " + GetParam() + " ("));
  EXPECT_THAT(log, HasSubstr("memory budget 64.00 MiB, eviction reject"));
  EXPECT_THAT(log, HasSubstr("listening on " + Socket()));
  EXPECT_THAT(log, HasSubstr("SIGTERM, draining"));
  EXPECT_THAT(log, HasSubstr("stopped"));
  // One event a line, each with its time (UTC, RFC 3339) and level.
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    EXPECT_THAT(std::string(line),
                ::testing::MatchesRegex("20[0-9][0-9]-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-6][0-9]\\.[0-9]{6}Z "
                                        "(INFO|WARNING|ERROR) .+"));
  }
}

// --threads=0 counts the CPUs the process may run on, not every core.
TEST(TurbokvdTest, ThreadsZeroFollowsTheAffinityMask) {
  cpu_set_t mask;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
  int first = 0;
  while (!CPU_ISSET(first, &mask)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  // The daemon inherits the test's mask, set to one CPU while it starts.
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--metrics-listen="});
  ASSERT_EQ(sched_setaffinity(0, sizeof(mask), &mask), 0);
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  EXPECT_THAT(daemon.Log(), HasSubstr(", 1 thread) "));
  EXPECT_THAT(daemon.Log(), HasSubstr("threads from --threads=0: 1 CPU in the affinity mask"));
}

// --pin-threads=on keeps each kernel thread to one CPU: the daemon says so,
// and exactly its two kernel threads (of its threads in /proc) may run on
// one CPU alone.
TEST(TurbokvdTest, PinnedThreadsEachKeepToOneCpu) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one CPU: every thread keeps to it";
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--metrics-listen=", "--threads=2", "--pin-threads=on"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  int pinned = 0;
  for (const auto& task : std::filesystem::directory_iterator(absl::StrCat("/proc/", daemon.pid(), "/task"))) {
    const pid_t tid = static_cast<pid_t>(std::stoi(task.path().filename().string()));
    cpu_set_t mask;
    if (sched_getaffinity(tid, sizeof(mask), &mask) == 0 && CPU_COUNT(&mask) == 1) ++pinned;
  }
  EXPECT_EQ(pinned, 2) << daemon.Log();
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  EXPECT_THAT(daemon.Log(), HasSubstr("each kept to one CPU (--pin-threads=on)"));
}

// A worker holds its Decode stream open for its whole life: SIGTERM ends it
// with UNAVAILABLE once the message in flight is answered, well within the
// shutdown deadline. The message sent as the signal arrives is either answered
// and stored or refused and not stored, never half-applied: a restart from the
// snapshots holds exactly what was answered.
TEST(TurbokvdTest, SigtermEndsAnOpenDecodeStreamWithUnavailableAfterItsMessage) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "turbokvd-decode-drain-", getpid());
  std::system(("rm -rf " + dir).c_str());
  const std::vector<std::string> flags = {"--listen=" + Socket(), "--device=cpu", "--threads=2",
                                          "--shutdown-deadline=30s", "--snapshot-dir=" + dir};
  DecodeBatch batch;
  bool last_answered = false;
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    for (int i = 0; i < 3; ++i) batch.session_ids.push_back(client->CreateSession(SmallSession())->id());
    batch.q_heads = 4;
    batch.kv_heads = 2;
    batch.head_dim = 128;
    const auto kv = GaussianVectors(3 * 2, 128, 1), q = GaussianVectors(3 * 4, 128, 2);
    batch.keys = batch.values = TensorData::F32(kv);
    batch.queries = TensorData::F32(q);
    auto stream = client->OpenDecodeStream();
    for (int64_t position = 0; position < 4; ++position) {
      batch.positions.assign(3, position);
      for (int layer = 0; layer < 2; ++layer) {
        batch.layer = layer;
        auto result = stream->Step(batch);
        ASSERT_TRUE(result.ok()) << result.status();
        ASSERT_EQ(result->failed, 0);
      }
    }
    // One more message (layer 0, position 4) as the signal arrives.
    batch.positions.assign(3, 4);
    batch.layer = 0;
    ASSERT_TRUE(stream->Write(batch).ok());
    const absl::Time signalled = absl::Now();
    kill(daemon.pid(), SIGTERM);
    auto last = stream->Read();
    last_answered = last.ok();
    if (last_answered) {
      EXPECT_EQ(last->failed, 0);
      EXPECT_EQ(last->tokens[0], 5);
    } else {
      EXPECT_EQ(last.status().code(), absl::StatusCode::kUnavailable) << last.status();
    }
    // Close only once the drain has begun (health says so after it reached
    // the open streams): a stream its client closes first ends OK.
    for (absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until; absl::SleepFor(absl::Milliseconds(2))) {
      auto health = client->Health();
      if (!health.ok() || *health != grpc::health::v1::HealthCheckResponse::SERVING) break;
    }
    const absl::Status ended = stream->Finish();
    EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
    EXPECT_THAT(std::string(ended.message()), HasSubstr("shutting down"));
    EXPECT_EQ(daemon.Wait(), 0);
    EXPECT_LT(absl::Now() - signalled, absl::Seconds(15)) << "the drain waited on the idle stream";
    EXPECT_THAT(daemon.Log(), HasSubstr("wrote 3 session(s)"));
  }
  Daemon restarted(flags);
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << restarted.Log();
  for (const std::string& id : batch.session_ids) {
    auto info = client->GetSession(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->layer_tokens(0), last_answered ? 5 : 4) << id;
    EXPECT_EQ(info->layer_tokens(1), 4) << id;
  }
  EXPECT_EQ(restarted.Stop(SIGTERM), 0);
}

TEST(TurbokvdTest, BudgetIsEnforcedWithRejectAndWithLru) {
  // turbo3, 1 layer, 8 kv heads, d 128, pages of 64 tokens: 51,200 bytes a page;
  // each session's metadata (its sink page and key transform among it) about 30 KB.
  for (const char* eviction : {"reject", "lru"}) {
    Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--memory-budget=200KiB",
                   absl::StrCat("--eviction=", eviction)});
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    SessionOptions options;
    options.kv_heads = 8;
    options.q_heads = 8;
    options.key_codec = options.value_codec = v1::CODEC_TURBO3;
    auto first = client->CreateSession(options);
    auto second = client->CreateSession(options);
    ASSERT_TRUE(first.ok() && second.ok());
    const auto k = GaussianVectors(128 * 8, 128, 1);
    ASSERT_TRUE(first->Append(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());  // 2 pages
    auto over = second->Append(0, 0, TensorData::F32(k), TensorData::F32(k));
    if (std::string(eviction) == "reject") {
      EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_THAT(std::string(over.status().message()),
                  HasSubstr("bytes used, 102400 needed, budget 204800 bytes"));
      EXPECT_TRUE(first->Info().ok());
    } else {
      EXPECT_TRUE(over.ok()) << over.status();
      auto gone = first->Info();
      EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
      EXPECT_THAT(std::string(gone.status().message()), HasSubstr("evicted"));
      EXPECT_THAT(daemon.Log(), HasSubstr("session " + first->id() + " evicted (least recently used"));
    }
    EXPECT_EQ(daemon.Stop(SIGINT), 0);
  }
}

TEST(TurbokvdTest, AHealthOnlyListenerAnswersProbesAndNothingElse) {
  Daemon daemon({"--listen=" + Socket(), "--device=cpu", "--health-listen=127.0.0.1:0"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  const std::string log = daemon.Log();
  const std::string mark = "health-only listener (grpc.health.v1, nothing else) on ";
  const size_t at = log.find(mark + "127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string endpoint = log.substr(at + mark.size(), log.find('\n', at) - at - mark.size());
  auto probe = Client::Connect(endpoint);
  ASSERT_TRUE(probe->WaitUntilServing(absl::Seconds(10)).ok());
  EXPECT_EQ(probe->Stats().status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
}

// A target that is a bare absolute path is the unix socket there (issue
// 59 item 8: never a host name for the resolver), shared memory included.
TEST(TurbokvdTest, ABareSocketPathIsTheUnixSocket) {
  Daemon daemon({"--listen=" + Socket(), "--device=cpu"});
  const std::string path = Socket().substr(std::string("unix://").size());
  ASSERT_EQ(path.front(), '/');
  auto client = Client::Connect(path);
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
  auto session = client->CreateSession(SmallSession());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(daemon.Stop(SIGTERM), 0);
}

// Every decoded key and value of layer 0.
std::vector<float> Contents(const Session& session) {
  auto kv = session.ReadKv(0);
  EXPECT_TRUE(kv.ok()) << kv.status();
  if (!kv.ok()) return {};
  std::vector<float> all = kv->keys;
  all.insert(all.end(), kv->values.begin(), kv->values.end());
  return all;
}

TEST_P(TurbokvdDeviceTest, SnapshotsSurviveRestartsAndDamageFailsOnlyItsSession) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "turbokvd-snapshots-", getpid());
  std::system(("rm -rf " + dir).c_str());
  const std::vector<std::string> flags = {"--listen=" + Socket(), "--device=" + GetParam(), "--memory-budget=256MiB",
                                          "--snapshot-dir=" + dir};
  const SessionOptions options = SmallSession();
  std::vector<std::string> ids;
  std::vector<std::vector<float>> before;
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    for (int s = 0; s < 4; ++s) {
      auto session = client->CreateSession(options);
      ASSERT_TRUE(session.ok());
      const auto k = GaussianVectors(2 * (70 + s) * 2, 128, s);
      ASSERT_TRUE(session->AppendAllLayers(0, TensorData::F32(k), TensorData::F32(k)).ok());
      ids.push_back(session->id());
      before.push_back(Contents(*session));
    }
    ASSERT_TRUE(client->DeleteSession(ids[3]).ok());  // deleted: must not come back
    EXPECT_EQ(daemon.Stop(SIGTERM), 0);
    EXPECT_THAT(daemon.Log(), HasSubstr("wrote 3 session(s)"));
  }
  // Damage two of the three files: one byte flipped, one cut short.
  {
    std::fstream flip(dir + "/" + ids[1] + ".tkvs", std::ios::in | std::ios::out | std::ios::binary);
    flip.seekp(5000);
    flip.put('\x5a');
  }
  ASSERT_EQ(truncate((dir + "/" + ids[2] + ".tkvs").c_str(), 3000), 0);
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    auto restored = client->OpenSession(ids[0]);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(Contents(*restored), before[0]);  // byte-identical
    EXPECT_EQ(restored->Info()->layer_tokens(1), 70);
    for (int s : {1, 2}) {
      auto damaged = client->GetSession(ids[s]);
      EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(std::string(damaged.status().message()), HasSubstr("could not be restored from its snapshot"));
    }
    EXPECT_EQ(client->GetSession(ids[3]).status().code(), absl::StatusCode::kNotFound);
    const std::string log = daemon.Log();
    EXPECT_THAT(log, HasSubstr("loaded 1 session(s)"));
    EXPECT_THAT(log, HasSubstr("session " + ids[1] + " not restored (DATA_LOSS): checksum mismatch"));

    // A checkpoint on demand, more appends, then SIGKILL: a restart has the checkpoint.
    auto snapshot = client->Snapshot();
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_EQ(snapshot->sessions(), 1);
    const auto k = GaussianVectors(2 * 5 * 2, 128, 9);
    ASSERT_TRUE(restored->AppendAllLayers(70, TensorData::F32(k), TensorData::F32(k)).ok());
    EXPECT_EQ(daemon.Stop(SIGKILL), -1);
  }
  {
    Daemon daemon(flags);
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    auto restored = client->OpenSession(ids[0]);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->Info()->layer_tokens(0), 70);  // the 5 tokens after the checkpoint are gone
    EXPECT_EQ(Contents(*restored), before[0]);
    EXPECT_EQ(daemon.Stop(SIGTERM), 0);
  }
  std::system(("rm -rf " + dir).c_str());
}

TEST(TurbokvdTest, BadFlagsExitWithAMessage) {
  struct Case {
    std::vector<std::string> flags;
    const char* message;
  };
  const Case cases[] = {
      {{"--memory-budget=lots"}, "--memory-budget: 'lots' is not a size"},
      {{"--memory-budget=0"}, "--memory-budget must be more than 0 (leave it out for the device's default)"},
      {{"--eviction=random"}, "--eviction=random: expected reject or lru"},
      {{"--pin-threads=yes"}, "--pin-threads=yes: expected on or off"},
      {{"--device=tpu"}, "--device=tpu: expected auto, cpu or cuda:N"},
      {{"--cuda-attention=mma"}, "--cuda-attention=mma: expected split or tensor-cores"},
      {{"--no-such-flag=1"}, "unknown flag --no-such-flag"},
      {{"--listen=nowhere"}, "--listen=nowhere: expected unix:///path or host:port"},
      {{"--session-ttl=soon"}, "--session-ttl=soon"},
      {{"--max-message-bytes=2GiB"}, "expected a size below 2GiB"},
      {{"--tenant-max-calls=0"}, "--tenant-max-calls=0: expected a count >= 1"},
      {{"--admin-tenant=ops"}, "--admin-tenant needs --auth-tokens-file"},
      {{"--spill-dir=/proc/turbokv-spill"}, "cannot create --spill-dir /proc/turbokv-spill"},
      {{"--spill-budget=much"}, "--spill-budget: 'much' is not a size"},
      {{"--memory-watermarks=0.8,0.9"}, "--memory-watermarks=0.8,0.9: expected HIGH,LOW with 0 < LOW < HIGH <= 1"},
  };
  for (const Case& c : cases) {
    Daemon daemon(c.flags);
    EXPECT_EQ(daemon.Wait(), 2) << c.message;
    EXPECT_THAT(daemon.Log(), HasSubstr(c.message));
  }
}

// --device=cuda:0 serves on the GPU, or exits naming why it cannot; auto
// then falls back to the CPU, saying why.
TEST(TurbokvdTest, TheGpuServesOrTheDaemonSaysWhyNot) {
  absl::StatusOr<std::unique_ptr<Backend>> gpu = testing::TestBackend("cuda:0", nullptr, size_t{1} << 20);
  if (gpu.ok()) {
    gpu->reset();
    Daemon daemon({"--listen=" + Socket(), "--device=auto", "--memory-budget=64MiB"});
    auto client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << daemon.Log();
    EXPECT_THAT(client->Stats()->device(), HasSubstr("cuda:0 ("));
    EXPECT_EQ(daemon.Stop(SIGTERM), 0);
    EXPECT_THAT(daemon.Log(), HasSubstr("--device=auto: CUDA device 0 can serve"));
    Daemon tensor_cores(
        {"--listen=" + Socket(), "--device=cuda:0", "--cuda-attention=tensor-cores", "--memory-budget=64MiB"});
    client = Client::Connect(Socket());
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << tensor_cores.Log();
    EXPECT_THAT(client->Stats()->device(), HasSubstr("tensor-core attention"));
    EXPECT_EQ(tensor_cores.Stop(SIGTERM), 0);
    return;
  }
  const std::string why(gpu.status().message());
  Daemon refused({"--listen=" + Socket(), "--device=cuda:0"});
  EXPECT_EQ(refused.Wait(), 2);
  EXPECT_THAT(refused.Log(), HasSubstr("--device=cuda:0: " + why + "; use --device=cpu, or auto to fall back to it"));
  Daemon fallback({"--listen=" + Socket(), "--device=auto", "--metrics-listen="});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << fallback.Log();
  EXPECT_THAT(client->Stats()->device(), HasSubstr("cpu (simd:"));
  EXPECT_EQ(fallback.Stop(SIGTERM), 0);
  EXPECT_THAT(fallback.Log(), HasSubstr("--device=auto: no GPU (" + why + "); sessions in host memory, kernels on the CPU"));
  EXPECT_THAT(fallback.Log(), HasSubstr("memory budget 4.00 GiB"));
}

TEST(TurbokvdTest, VersionPrintsItAndExits) {
  Daemon daemon({"--version"});
  EXPECT_EQ(daemon.Wait(), 0);
  Daemon help({"--help"});
  EXPECT_EQ(help.Wait(), 0);
}

// A second daemon on the address of a running one refuses to start, and the
// first goes on serving on both its unix socket and its TCP port.
TEST(TurbokvdTest, ASecondDaemonOnTheSameAddressesRefusesToStart) {
  Daemon first({"--listen=" + Socket(), "--listen=127.0.0.1:0", "--device=cpu", "--health-listen=127.0.0.1:0"});
  auto client = Client::Connect(Socket());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(20)).ok()) << first.Log();
  const std::string log = first.Log();
  const std::string mark = "listening on " + Socket() + ", ";
  const size_t at = log.find(mark);
  ASSERT_NE(at, std::string::npos) << log;
  const std::string tcp = log.substr(at + mark.size(), log.find('\n', at) - at - mark.size());
  const std::string metrics = first.MetricsAddress();
  const std::string health_mark = "health-only listener (grpc.health.v1, nothing else) on ";
  const size_t health_at = log.find(health_mark);
  const std::string health = log.substr(health_at + health_mark.size(),
                                        log.find('\n', health_at) - health_at - health_mark.size());
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  const Case cases[] = {
      {{"--listen=" + Socket(), "--metrics-listen=127.0.0.1:0"},
       "cannot listen on " + Socket() + ": another process (a turbokvd?) is serving on it"},
      {{"--listen=" + tcp, "--metrics-listen=127.0.0.1:0"}, "cannot listen on " + tcp + ": Address already in use"},
      {{"--listen=unix:///tmp/turbokvd-second-" + std::to_string(getpid()) + ".sock", "--metrics-listen=" + metrics},
       "cannot serve metrics on " + metrics + " (--metrics-listen): the port is in use"},
      {{"--listen=unix:///tmp/turbokvd-second-" + std::to_string(getpid()) + ".sock", "--metrics-listen=127.0.0.1:0",
        "--health-listen=" + health},
       "cannot listen on " + health + " (--health-listen): Address already in use"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> flags = c.flags;
    flags.push_back("--device=cpu");
    Daemon second(flags);
    EXPECT_EQ(second.Wait(), 2) << c.message;
    EXPECT_THAT(second.Log(), HasSubstr(c.message));
    EXPECT_THAT(second.Log(), ::testing::Not(HasSubstr("CivetServer")));
    EXPECT_THAT(second.Log(), ::testing::Not(HasSubstr("chttp2"))) << "gRPC's own error text, raw";
  }
  EXPECT_TRUE(client->Stats().ok()) << "the first daemon's socket is still there";
  auto over_tcp = Client::Connect(tcp);
  EXPECT_TRUE(over_tcp->Stats().ok());
  // Health answers for the service by name too.
  auto channel = grpc::CreateChannel(Socket(), grpc::InsecureChannelCredentials());
  auto health_stub = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "turbokv.v1.KvCacheService"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health_stub->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  EXPECT_EQ(first.Stop(SIGTERM), 0);
}

TEST(TurbokvdTest, AListenerThatCannotBeBoundFailsTheStart) {
  Daemon daemon({"--listen=unix:///nonexistent-dir/x.sock", "--device=cpu"});
  EXPECT_EQ(daemon.Wait(), 2);
  EXPECT_THAT(daemon.Log(), HasSubstr("cannot listen on unix:///nonexistent-dir/x.sock"));
}

INSTANTIATE_TEST_SUITE_P(Devices, TurbokvdDeviceTest, ::testing::ValuesIn(testing::TestDevices()),
                         testing::DeviceTestName);

}  // namespace
}  // namespace turbokv
