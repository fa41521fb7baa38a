// The real gRPC server in-process, on a unix socket and on an OS-picked TCP
// port, driven through the C++ client.
#include "service/server.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/backend_testing.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "service/device.h"
#include "service/metrics.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/metrics_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::turbokv::testing::GaussianVectors;

constexpr int kLayers = 2, kKv = 2, kQ = 4, kDim = 128;

std::string SocketPath() { return absl::StrCat("/tmp/turbokv-server-test-", getpid(), ".sock"); }

// On each device (the GPU skips where it cannot serve), through the unix
// socket and TCP.
class ServerTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override {
    const std::string device = std::get<0>(GetParam());
    if (device != "cpu") {
      absl::StatusOr<std::unique_ptr<Backend>> probe = testing::TestBackend(device, nullptr, size_t{1} << 20);
      if (!probe.ok()) GTEST_SKIP() << device << " cannot serve here: " << probe.status().message();
    }
    ServerOptions options;
    options.listen = {"unix://" + SocketPath(), "127.0.0.1:0"};
    options.device = device;
    options.threads = 2;
    options.memory_budget = size_t{256} << 20;
    options.expiry_interval = absl::Milliseconds(20);
    options.metrics_listen = "127.0.0.1:0";
    auto server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_EQ(server_->endpoints().size(), 2u);
    EXPECT_THAT(server_->endpoints()[1], ::testing::StartsWith("127.0.0.1:"));
    EXPECT_NE(server_->endpoints()[1], "127.0.0.1:0");
    client_ = Client::Connect(Endpoint());
    ASSERT_TRUE(client_->WaitUntilServing(absl::Seconds(10)).ok());
  }
  void TearDown() override {
    if (server_) {
      EXPECT_TRUE(server_->Shutdown(absl::Seconds(1)).ok());
    }
  }

  // The TCP listener or the unix socket, as the test's parameter says.
  std::string Endpoint() const { return std::get<1>(GetParam()) ? server_->endpoints()[1] : server_->endpoints()[0]; }
  // The device label of the metrics: "cpu", "cuda:0".
  static std::string Label() { return std::get<0>(GetParam()); }

  Session NewSession(v1::Codec codec = v1::CODEC_TURBO3) {
    SessionOptions options;
    options.layers = kLayers;
    options.kv_heads = kKv;
    options.q_heads = kQ;
    options.head_dim = kDim;
    options.key_codec = options.value_codec = codec;
    auto session = client_->CreateSession(options);
    EXPECT_TRUE(session.ok()) << session.status();
    return *std::move(session);
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_P(ServerTest, EndToEndThroughTheClient) {
  Session session = NewSession();
  EXPECT_EQ(*client_->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  // A pipelined prefill of 10 chunks of 50 tokens into layer 1.
  const int64_t n = 500;
  const auto k = GaussianVectors(n * kKv, kDim, 1), v = GaussianVectors(n * kKv, kDim, 2);
  auto stream = session.OpenAppendStream();
  const size_t chunk = 50 * kKv * kDim;
  for (int c = 0; c < 10; ++c) {
    ASSERT_TRUE(stream->Write(1, c * 50, TensorData::F32({k.data() + c * chunk, chunk}),
                              TensorData::F32({v.data() + c * chunk, chunk}))
                    .ok());
  }
  auto last = stream->Finish();
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->tokens(), n);
  EXPECT_EQ(stream->acknowledged(), 10);

  // Attention against a float reference over what the service stores.
  auto kv = session.ReadKv(1);
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_EQ(kv->tokens, n);
  EXPECT_LT(testing::RelativeL2(kv->keys, k), 0.2);
  const auto q = GaussianVectors(2 * kQ, kDim, 3);
  const std::vector<int64_t> positions = {99, 499};
  auto attention = session.Attend(1, TensorData::F32(q), positions);
  ASSERT_TRUE(attention.ok()) << attention.status();
  AttentionParams params;
  params.q_heads = kQ;
  const auto reference = testing::ReferenceAttention(kv->keys, kv->values, kKv, kDim, q, positions, params);
  EXPECT_LT(testing::RelativeL2(attention->output, reference.out), 1e-3);
  EXPECT_LT(testing::RelativeL2(attention->lse, reference.lse), 1e-4);

  // Step, fork, truncate, list, stats, delete.
  const auto k1 = GaussianVectors(kKv, kDim, 4), v1_ = GaussianVectors(kKv, kDim, 5), q1 = GaussianVectors(kQ, kDim, 6);
  auto step = session.Step(1, n, TensorData::F32(k1), TensorData::F32(v1_), TensorData::F32(q1));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->tokens, n + 1);
  ASSERT_TRUE(session.Append(0, 0, TensorData::F32(k), TensorData::F32(v)).ok());
  auto fork = session.Fork(300);
  ASSERT_TRUE(fork.ok()) << fork.status();
  auto truncated = fork->Truncate(100);
  ASSERT_TRUE(truncated.ok());
  EXPECT_EQ(truncated->layer_tokens(1), 100);
  EXPECT_EQ(session.Info()->layer_tokens(1), n + 1);
  auto sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok());
  EXPECT_EQ(sessions->size(), 2u);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), 2);
  EXPECT_GT(stats->compression_ratio(), 4.5);
  EXPECT_THAT(stats->device(), StartsWith(Label() + " ("));
  EXPECT_TRUE(fork->Delete().ok());
  EXPECT_TRUE(session.Delete().ok());
  EXPECT_EQ(client_->Stats()->bytes_used(), 0);
}

TEST_P(ServerTest, ErrorsKeepTheirCodesAndMessagesOverTheWire) {
  auto missing = client_->GetSession("no-such-session");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  SessionOptions bad;
  bad.head_dim = 100;
  auto invalid = client_->CreateSession(bad);
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(invalid.status().message()), HasSubstr("config.shape.head_dim"));

  // In a stream, the first bad chunk ends it; the acknowledged ones stay.
  Session session = NewSession();
  const auto k = GaussianVectors(20 * kKv, kDim, 1);
  auto stream = session.OpenAppendStream();
  ASSERT_TRUE(stream->Write(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());
  stream->Write(0, 30, TensorData::F32(k), TensorData::F32(k)).IgnoreError();  // gap
  stream->Write(0, 20, TensorData::F32(k), TensorData::F32(k)).IgnoreError();  // not applied
  auto finished = stream->Finish();
  EXPECT_EQ(finished.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(finished.status().message()), HasSubstr("positions 20 to 29 are missing"));
  EXPECT_EQ(session.Info()->layer_tokens(0), 20);
}

TEST_P(ServerTest, AMessageOverTheSizeLimitIsRefused) {
  Session session = NewSession();
  // 70 MB of keys and values: over the 64 MiB limit in both directions.
  const std::vector<float> k(35'000 * kKv * kDim / 2 * 2, 0.25f);
  auto over = session.Append(0, 0, TensorData::F32(k), TensorData::F32(k));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(session.Info()->layer_tokens(0), 0);
}

TEST_P(ServerTest, HalfPrecisionInputRoundTrips) {
  Session session = NewSession(v1::CODEC_F16);
  const auto x = GaussianVectors(30 * kKv, kDim, 9);
  std::vector<uint16_t> f16(x.size()), bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    f16[i] = FloatToHalfBits(x[i]);
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    bf16[i] = static_cast<uint16_t>(bits >> 16);
  }
  ASSERT_TRUE(session.Append(0, 0, TensorData::F16(f16), TensorData::BF16(bf16)).ok());
  auto kv = session.ReadKv(0);
  ASSERT_TRUE(kv.ok());
  EXPECT_LT(testing::RelativeL2(kv->keys, x), 1e-3);
  EXPECT_LT(testing::RelativeL2(kv->values, x), 1e-2);  // bf16 truncation, then f16
}

TEST_P(ServerTest, IdleSessionsExpire) {
  SessionOptions options;
  options.head_dim = 64;
  options.idle_ttl = absl::Milliseconds(100);
  auto session = client_->CreateSession(options);
  ASSERT_TRUE(session.ok());
  absl::SleepFor(absl::Milliseconds(400));
  auto info = session->Info();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("expired"));
}

TEST_P(ServerTest, ManyClientsAtOnce) {
  constexpr int kThreads = 4;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Client> client =
          Client::Connect(Endpoint());
      SessionOptions options;
      options.layers = kLayers;
      options.kv_heads = kKv;
      options.q_heads = kQ;
      auto session = client->CreateSession(options);
      if (!session.ok()) {
        ++failures;
        return;
      }
      const auto k = GaussianVectors(64 * kKv, kDim, t);
      const auto q = GaussianVectors(kQ, kDim, t + 100);
      for (int r = 0; r < 10; ++r) {
        if (!session->Append(r % kLayers, (r / kLayers) * 64, TensorData::F32(k), TensorData::F32(k)).ok()) ++failures;
        if (!session->Attend(r % kLayers, TensorData::F32(q)).ok()) ++failures;
      }
      if (session->Info()->layer_tokens(1) != 5 * 64) ++failures;
      if (!session->Delete().ok()) ++failures;
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(client_->Stats()->sessions(), 0);
}

// The Decode stream through the client: k = 2 queries per session, two
// messages in flight, each item equal to the same work done with Step on a
// twin session (same rotation seed), to the bit.
TEST_P(ServerTest, DecodeStreamEqualsStepsOnTwinSessions) {
  SessionOptions options;
  options.layers = kLayers;
  options.kv_heads = kKv;
  options.q_heads = kQ;
  options.head_dim = kDim;
  std::vector<Session> batched, stepped;
  for (uint64_t seed : {1, 2}) {
    options.rotation_seed = seed;
    batched.push_back(*client_->CreateSession(options));
    stepped.push_back(*client_->CreateSession(options));
  }
  auto stream = client_->OpenDecodeStream();
  DecodeBatch batch;
  batch.session_ids = {batched[0].id(), batched[1].id()};
  batch.k = 2;
  batch.q_heads = kQ;
  batch.kv_heads = kKv;
  batch.head_dim = kDim;
  const auto q = GaussianVectors(2 * 2 * kQ, kDim, 5), kv = GaussianVectors(2 * 2 * kKv, kDim, 6);
  batch.queries = TensorData::F32(q);
  batch.keys = batch.values = TensorData::F32(kv);
  for (int layer = 0; layer < kLayers; ++layer) {
    batch.layer = layer;
    batch.positions = {0, 1, 0, 1};
    ASSERT_TRUE(stream->Write(batch).ok());
  }
  // A tensor of the wrong size is refused before it is sent.
  DecodeBatch wrong = batch;
  wrong.queries = TensorData::F32(absl::MakeConstSpan(q).subspan(0, q.size() / 2));
  EXPECT_EQ(stream->Write(wrong).code(), absl::StatusCode::kInvalidArgument);
  for (int layer = 0; layer < kLayers; ++layer) {
    auto result = stream->Read();
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->failed, 0);
    EXPECT_EQ(result->k, 2);
    EXPECT_THAT(result->tokens, ::testing::ElementsAre(2, 2));
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        const size_t row = static_cast<size_t>(i * 2 + j);
        auto slice = [&](const std::vector<float>& all, int heads) {
          return TensorData::F32(absl::MakeConstSpan(all).subspan(row * heads * kDim, heads * kDim));
        };
        auto step = stepped[i].Step(layer, j, slice(kv, kKv), slice(kv, kKv), slice(q, kQ));
        ASSERT_TRUE(step.ok()) << step.status();
        EXPECT_EQ(0, std::memcmp(step->attention.output.data(), result->output.data() + row * kQ * kDim,
                                 kQ * kDim * sizeof(float)))
            << "layer " << layer << " item " << i << " query " << j;
        EXPECT_EQ(0, std::memcmp(step->attention.lse.data(), result->lse.data() + row * kQ, kQ * sizeof(float)));
      }
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// Two clients, each with its own connection and Decode stream, batch the
// same sessions in opposite orders for two seconds: no deadlock, no failure.
TEST_P(ServerTest, DecodeStreamsSharingSessionsInOppositeOrdersDoNotDeadlock) {
  std::vector<std::string> ids;
  const auto kv = GaussianVectors(kKv, kDim, 1);
  for (int i = 0; i < 6; ++i) {
    Session session = NewSession();
    ASSERT_TRUE(session.Append(0, 0, TensorData::F32(kv), TensorData::F32(kv)).ok());
    ids.push_back(session.id());
  }
  const auto q = GaussianVectors(ids.size() * kQ, kDim, 2);
  std::atomic<int> failures{0}, messages{0};
  auto run = [&](std::vector<std::string> order) {
    auto client = Client::Connect(Endpoint());
    auto stream = client->OpenDecodeStream();
    DecodeBatch batch;
    batch.session_ids = order;
    batch.positions.assign(order.size(), 0);
    batch.q_heads = kQ;
    batch.head_dim = kDim;
    batch.queries = TensorData::F32(q);
    for (const absl::Time end = absl::Now() + absl::Seconds(2); absl::Now() < end;) {
      auto result = stream->Step(batch);
      if (!result.ok() || result->failed != 0) failures.fetch_add(1);
      messages.fetch_add(1);
    }
    if (!stream->Finish().ok()) failures.fetch_add(1);
  };
  std::thread a(run, ids), b(run, std::vector<std::string>(ids.rbegin(), ids.rend()));
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(messages.load(), 10);
}

TEST_P(ServerTest, ShutdownLetsStreamsFinishAndRefusesNewCalls) {
  Session session = NewSession();
  const auto k = GaussianVectors(10 * kKv, kDim, 1);
  auto stream = session.OpenAppendStream();
  ASSERT_TRUE(stream->Write(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());
  while (stream->acknowledged() < 1) absl::SleepFor(absl::Milliseconds(5));
  std::thread shutdown([&] { EXPECT_TRUE(server_->Shutdown(absl::Seconds(10)).ok()); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(*client_->Health(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  auto refused = client_->Stats();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("shutting down"));
  // The stream in flight goes on until it is done.
  EXPECT_TRUE(stream->Write(0, 10, TensorData::F32(k), TensorData::F32(k)).ok());
  auto last = stream->Finish();
  shutdown.join();
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->tokens(), 20);
  EXPECT_FALSE(client_->Health().ok());  // no longer listening
}

// The host:port of the server's metrics endpoint (http://HOST:PORT/metrics).
std::string MetricsAddress(const Server& server) {
  const std::string& url = server.metrics_endpoint();
  const size_t start = url.find("//") + 2;
  return url.substr(start, url.find('/', start) - start);
}

TEST_P(ServerTest, MetricsCountWhatHappened) {
  Session session = NewSession();
  const auto k = GaussianVectors(100 * kKv, kDim, 1);
  ASSERT_TRUE(session.Append(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());
  ASSERT_TRUE(session.Append(0, 50, TensorData::F32(k), TensorData::F32(k)).ok());  // 50 new
  const auto q = GaussianVectors(3 * kQ, kDim, 2);
  ASSERT_TRUE(session.Attend(0, TensorData::F32(q)).ok());
  EXPECT_FALSE(client_->GetSession("missing").ok());
  absl::SleepFor(absl::Milliseconds(100));  // the gauges refresh every 20 ms here
  const std::string text = testing::Scrape(MetricsAddress(*server_));
  EXPECT_THAT(text, HasSubstr("turbokv_sessions 1"));
  EXPECT_THAT(text, HasSubstr("turbokv_tokens_stored 150"));
  EXPECT_THAT(text, HasSubstr("turbokv_appended_tokens_total 150"));
  EXPECT_THAT(text, HasSubstr("turbokv_attended_queries_total 3"));
  EXPECT_THAT(text, HasSubstr("turbokv_memory_budget_bytes{device=\"" + Label() + "\"} 268435456"));
  EXPECT_THAT(text, HasSubstr("turbokv_rpc_errors_total{code=\"NOT_FOUND\",method=\"GetSession\",side=\"client\"} 1"));
  EXPECT_THAT(text, HasSubstr("turbokv_rpc_errors_total{code=\"NOT_FOUND\",method=\"GetSession\",side=\"server\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_tenant_sessions{tenant=\"\"} 1"));
  EXPECT_GT(testing::Sample(text, "turbokv_tenant_memory_bytes{tenant=\"\"}"), 0);
  EXPECT_GT(testing::Sample(text, "turbokv_memory_used_bytes{device=\"" + Label() + "\"}"), 0);
  EXPECT_THAT(text, HasSubstr("turbokv_build_info{device=\"" + Label() + "\",simd=\""));
  EXPECT_THAT(text, HasSubstr("version=\"" TURBOKV_VERSION "\"} 1"));
  EXPECT_GT(testing::Sample(text, "process_resident_memory_bytes"), 1 << 20);
  EXPECT_GT(testing::Sample(text, "process_open_fds"), 2);
  EXPECT_GT(testing::Sample(text, "process_start_time_seconds"), absl::ToUnixSeconds(absl::Now()) - 3600);
  EXPECT_LE(testing::Sample(text, "process_start_time_seconds"), absl::ToUnixMicros(absl::Now()) * 1e-6);
  EXPECT_THAT(text, HasSubstr("turbokv_inflight_calls{method=\"Step\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_rpc_duration_seconds_count{code=\"OK\",method=\"Append\"} 2"));
  EXPECT_THAT(text, HasSubstr("turbokv_kernel_duration_seconds_count{device=\"" + Label() + "\",op=\"attend\"} 1"));
  EXPECT_THAT(text, HasSubstr("turbokv_evictions_total{reason=\"lru\"} 0"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr(session.id())));
}

// Before its first event, a series an alert or a dashboard sums is there
// at 0 (issue 59 item 11): every method's errors on both sides, the
// tenant's gauges; and no tier is exported that the daemon does not have
// (here none: no --spill-dir, no --redis-url).
TEST_P(ServerTest, SeriesThatAreSummedAreThereBeforeTheirFirstEvent) {
  absl::SleepFor(absl::Milliseconds(100));  // the gauges refresh every 20 ms here
  const std::string text = testing::Scrape(MetricsAddress(*server_));
  for (const char* method : {"CreateSession", "Append", "Attend", "Decode", "Step", "ReadKv"}) {
    const std::string m(method);
    EXPECT_EQ(testing::Sample(text, "turbokv_rpc_errors_total{code=\"INTERNAL\",method=\"" + m + "\",side=\"server\"}"),
              0)
        << m;
    EXPECT_EQ(testing::Sample(
                  text, "turbokv_rpc_errors_total{code=\"INVALID_ARGUMENT\",method=\"" + m + "\",side=\"client\"}"),
              0)
        << m;
  }
  EXPECT_THAT(text, HasSubstr("turbokv_tenant_sessions{tenant=\"\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_tenant_memory_bytes{tenant=\"\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_tier_sessions{tier=\"memory\"} 0"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("tier=\"disk\"")));
  // A session's tenant, then none again: the known tenant stays, at 0.
  {
    Session session = NewSession();
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_THAT(testing::Scrape(MetricsAddress(*server_)), HasSubstr("turbokv_tenant_sessions{tenant=\"\"} 1"));
    ASSERT_TRUE(session.Delete().ok());
  }
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_THAT(testing::Scrape(MetricsAddress(*server_)), HasSubstr("turbokv_tenant_sessions{tenant=\"\"} 0"));
}

// The tenants of --auth-tokens-file are exported from the start.
TEST(ServerMetricsTest, TheTenantsOfTheTokensFileAreThereFromTheStart) {
  const std::string tokens = SocketPath() + ".tokens";
  {
    std::ofstream file(tokens);
    file << "alpha-secret alpha\nbeta-secret beta\nalpha-2 alpha\n";
  }
  ServerOptions options;
  options.listen = {"unix://" + SocketPath()};
  options.device = "cpu";
  options.auth_tokens_file = tokens;
  options.expiry_interval = absl::Milliseconds(20);
  options.metrics_listen = "127.0.0.1:0";
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  absl::SleepFor(absl::Milliseconds(100));
  const std::string text = testing::Scrape(MetricsAddress(**server));
  EXPECT_THAT(text, HasSubstr("turbokv_tenant_sessions{tenant=\"alpha\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_tenant_sessions{tenant=\"beta\"} 0"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("turbokv_tenant_sessions{tenant=\"\"}")));
  EXPECT_TRUE((*server)->Shutdown(absl::Seconds(1)).ok());
  std::remove(tokens.c_str());
}

// A stream counts in turbokv_inflight_calls while it is open; failures are
// counted by side: a session's own max_tokens is the client's, the memory
// budget the server's.
TEST(ServerMetricsTest, OpenStreamsAndClientFromServerErrors) {
  ServerOptions options;
  options.listen = {"unix://" + SocketPath()};
  options.device = "cpu";
  options.threads = 2;
  options.memory_budget = size_t{1} << 20;
  options.metrics_listen = "127.0.0.1:0";
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Client::Connect("unix://" + SocketPath());
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(10)).ok());
  const std::string metrics = MetricsAddress(**server);

  auto decode = client->OpenDecodeStream();
  SessionOptions small;
  small.layers = kLayers;
  small.kv_heads = kKv;
  small.q_heads = kQ;
  small.max_tokens = 64;
  auto capped = client->CreateSession(small);
  ASSERT_TRUE(capped.ok()) << capped.status();
  std::string text = testing::Scrape(metrics);
  EXPECT_THAT(text, HasSubstr("turbokv_inflight_calls{method=\"Decode\"} 1"));
  EXPECT_THAT(text, HasSubstr("turbokv_inflight_calls{method=\"Append\"} 0"));
  EXPECT_TRUE(decode->Finish().ok());

  const auto k = GaussianVectors(100 * kKv, kDim, 1);
  auto past = capped->Append(0, 0, TensorData::F32(k), TensorData::F32(k));
  ASSERT_EQ(past.status().code(), absl::StatusCode::kResourceExhausted) << past.status();
  // 1 MiB of budget: 8,000 tokens of 2 kv heads (about 200 bytes each) do not fit.
  small.max_tokens = 0;
  auto full = client->CreateSession(small);
  ASSERT_TRUE(full.ok()) << full.status();
  const auto kb = GaussianVectors(8000 * kKv, kDim, 3);
  auto refused = full->Append(0, 0, TensorData::F32(kb), TensorData::F32(kb));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  ASSERT_THAT(std::string(refused.status().message()), HasSubstr("memory budget"));
  text = testing::Scrape(metrics);
  EXPECT_THAT(text, HasSubstr("turbokv_inflight_calls{method=\"Decode\"} 0"));
  EXPECT_THAT(text, HasSubstr("turbokv_rpc_errors_total{code=\"RESOURCE_EXHAUSTED\",method=\"Append\",side=\"client\"} 1"));
  EXPECT_THAT(text, HasSubstr("turbokv_rpc_errors_total{code=\"RESOURCE_EXHAUSTED\",method=\"Append\",side=\"server\"} 1"));
  EXPECT_TRUE((*server)->Shutdown(absl::Seconds(1)).ok());
}

// A tenant whose last session went has no series left (not a 0 kept forever).
TEST(MetricsTest, AGoneTenantsSeriesAreRemoved) {
  Metrics metrics("cpu");
  auto value = [&](const std::string& family_name, const std::string& tenant) {
    for (const prometheus::MetricFamily& family : metrics.registry()->Collect()) {
      if (family.name != family_name) continue;
      for (const prometheus::ClientMetric& metric : family.metric) {
        for (const prometheus::ClientMetric::Label& label : metric.label) {
          if (label.name == "tenant" && label.value == tenant) return metric.gauge.value;
        }
      }
    }
    return -1.0;
  };
  StoreSnapshot store;
  store.tenants["a"] = {1, 100};
  store.tenants["b"] = {2, 200};
  metrics.SetStore(store);
  EXPECT_EQ(value("turbokv_tenant_sessions", "b"), 2);
  EXPECT_EQ(value("turbokv_tenant_memory_bytes", "b"), 200);
  store.tenants.erase("b");
  store.tenants["a"] = {3, 300};
  metrics.SetStore(store);
  EXPECT_EQ(value("turbokv_tenant_sessions", "a"), 3);
  EXPECT_EQ(value("turbokv_tenant_sessions", "b"), -1);
  EXPECT_EQ(value("turbokv_tenant_memory_bytes", "b"), -1);
}

// Writes `text` to root/path, making the folders on the way.
void WriteUnder(const std::string& root, const std::string& path, const std::string& text) {
  std::string dir = root;
  const size_t slash = path.rfind('/');
  for (absl::string_view part : absl::StrSplit(slash == std::string::npos ? "" : path.substr(0, slash), '/',
                                               absl::SkipEmpty())) {
    dir = absl::StrCat(dir, "/", part);
    mkdir(dir.c_str(), 0755);
  }
  std::ofstream(root + "/" + path) << text << "\n";
}

// --threads=0 on cgroup trees as the kernel lays them out (v2: cpu.max on
// the way from the process's cgroup to the root; v1: the cpu controller's
// cfs quota and period).
TEST(AvailableCoresTest, TheTightestCgroupQuotaCapsTheAffinityMask) {
  cpu_set_t mask;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
  const int cpus = CPU_COUNT(&mask);
  const std::string root = absl::StrCat(::testing::TempDir(), "cgroups-", getpid());
  mkdir(root.c_str(), 0755);
  struct Case {
    std::string name;
    std::vector<std::pair<std::string, std::string>> files;  // path under root, text
    int cores;
    std::string why;
  };
  const Case cases[] = {
      {"v2-no-quota", {{"proc", "0::/"}, {"v2a/cpu.max", "max 100000"}}, cpus, "in the affinity mask"},
      {"v2-half-a-cpu", {{"proc", "0::/pod/c"}, {"v2b/pod/c/cpu.max", "50000 100000"}}, 1, "cgroup CPU quota 0.50"},
      {"v2-tighter-parent",
       {{"proc", "0::/pod/c"}, {"v2c/pod/cpu.max", "150000 100000"}, {"v2c/pod/c/cpu.max", "400000 100000"}},
       std::min(cpus, 2),
       "cgroup CPU quota 1.50"},
      {"v1-one-cpu",
       {{"proc", "4:memory:/x\n3:cpu,cpuacct:/pod\n0::/"},
        {"v1/cpu,cpuacct/pod/cpu.cfs_quota_us", "100000"},
        {"v1/cpu,cpuacct/pod/cpu.cfs_period_us", "100000"}},
       1,
       "cgroup CPU quota 1.00"},
      {"v1-no-quota",
       {{"proc", "3:cpu,cpuacct:/pod"},
        {"v1n/cpu,cpuacct/pod/cpu.cfs_quota_us", "-1"},
        {"v1n/cpu,cpuacct/pod/cpu.cfs_period_us", "100000"}},
       cpus,
       "in the affinity mask"},
  };
  for (const Case& c : cases) {
    const std::string tree = absl::StrCat(root, "/", c.name);
    mkdir(tree.c_str(), 0755);
    std::string mount;
    for (const auto& [path, text] : c.files) {
      WriteUnder(tree, path, text);
      if (path != "proc") mount = path.substr(0, path.find('/'));
    }
    const CoreAllowance allowance = AvailableCores(tree + "/" + mount, tree + "/proc");
    EXPECT_EQ(allowance.cores, c.cores) << c.name << ": " << allowance.why;
    EXPECT_THAT(allowance.why, HasSubstr(c.why)) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(UnixAndTcp, ServerTest, ::testing::Combine(::testing::ValuesIn(testing::TestDevices()), ::testing::Bool()),
                         [](const auto& info) {
                           return testing::DeviceName(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_Tcp" : "_Unix");
                         });

}  // namespace
}  // namespace turbokv
