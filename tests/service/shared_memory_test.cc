// Tensors through shared memory (a client's memfd, registered over the
// daemon's .shm socket): the real server in-process on a unix socket, the
// C++ client, and hand-made clients that register what they should not and
// name slices they do not hold.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "service/server.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::GaussianVectors;

constexpr int kLayers = 2, kKv = 2, kQ = 8, kDim = 128;

std::string Dir() {
  static const std::string dir = [] {
    std::string path = absl::StrCat(::testing::TempDir(), "turbokv-shm-", getpid());
    std::system(("rm -rf " + path + " && mkdir -p " + path).c_str());
    return path;
  }();
  return dir;
}

int OpenFds() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

// A memfd of `bytes`, sealed against shrinking unless `seal` is false.
int MakeMemfd(size_t bytes, bool seal = true) {
  const int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (seal) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

// One registration by hand: the connection (kept open to keep the region)
// and the daemon's answer, "OK <id> <size>" or "ERROR <why>".
struct Registration {
  int connection = -1;
  std::string answer;
  std::string id() const { return answer.substr(3, answer.find(' ', 3) - 3); }
};

Registration Register(const std::string& socket_path, int fd, const std::string& token) {
  Registration r;
  r.connection = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  EXPECT_EQ(connect(r.connection, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_TRUE(SendRegistration(r.connection, token, fd));
  char answer[512];
  const ssize_t got = recv(r.connection, answer, sizeof(answer), 0);
  if (got > 0) r.answer.assign(answer, static_cast<size_t>(got));
  return r;
}

class SharedMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(Dir() + "/tokens") << "alpha-secret alpha\nbeta-secret beta\n";
    ServerOptions options;
    options.listen = {absl::StrCat("unix://", Dir(), "/d.sock")};
    options.device = "cpu";
    options.threads = 2;
    options.memory_budget = size_t{256} << 20;
    options.metrics_listen = "";
    options.auth_tokens_file = Dir() + "/tokens";
    options.shared_memory_max_bytes = size_t{16} << 20;
    auto server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_NE(server_->shared_memory(), nullptr);
    EXPECT_EQ(server_->shared_memory()->socket_path(), Dir() + "/d.sock.shm");
  }
  void TearDown() override {
    if (server_) {
      EXPECT_TRUE(server_->Shutdown(absl::Seconds(1)).ok());
    }
  }

  std::unique_ptr<Client> Connect(const std::string& token, size_t shared_bytes = size_t{8} << 20) const {
    ClientOptions options;
    options.auth_token = token;
    options.shared_memory_bytes = shared_bytes;
    auto client = Client::Connect(server_->endpoints()[0], options);
    EXPECT_TRUE(client->WaitUntilServing(absl::Seconds(10)).ok());
    return client;
  }
  const SharedMemory& shared() const { return *server_->shared_memory(); }

  std::unique_ptr<Server> server_;
};

SessionOptions Shape(v1::Codec codec) {
  SessionOptions s;
  s.layers = kLayers;
  s.kv_heads = kKv;
  s.q_heads = kQ;
  s.head_dim = kDim;
  s.key_codec = codec;
  s.value_codec = codec;
  s.rotation_seed = 77;
  return s;
}

// The values as dtype, as a client would hold them.
struct Held {
  std::vector<float> f32;
  std::vector<uint16_t> bits;
  TensorData data;
  Held(const std::vector<float>& values, v1::DType dtype) : f32(values) {
    if (dtype == v1::DTYPE_F32) {
      data = TensorData::F32(f32);
      return;
    }
    for (float v : values) {
      bits.push_back(dtype == v1::DTYPE_F16 ? FloatToHalfBits(v) : static_cast<uint16_t>(FloatBits(v) >> 16));
    }
    data = dtype == v1::DTYPE_F16 ? TensorData::F16(bits) : TensorData::BF16(bits);
  }
};

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

TEST_F(SharedMemoryTest, EveryCallGivesTheSameBitsThroughSharedMemoryAsThroughBytes) {
  auto shm = Connect("alpha-secret"), bytes = Connect("alpha-secret", 0);
  for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    const std::string what = v1::DType_Name(dtype);
    auto a = shm->CreateSession(Shape(v1::CODEC_TURBO3)), b = bytes->CreateSession(Shape(v1::CODEC_TURBO3));
    ASSERT_TRUE(a.ok() && b.ok());
    const int64_t n = 300;
    const Held k(GaussianVectors(kLayers * n * kKv, kDim, 1), dtype), v(GaussianVectors(kLayers * n * kKv, kDim, 2), dtype);
    const Held q(GaussianVectors(kLayers * n * kQ, kDim, 3), dtype);
    auto ta = a->AppendAllLayers(0, k.data, v.data, q.data), tb = b->AppendAllLayers(0, k.data, v.data, q.data);
    ASSERT_TRUE(ta.ok() && tb.ok()) << ta.status() << tb.status();
    EXPECT_EQ(*ta, *tb);

    const Held queries(GaussianVectors(3 * kQ, kDim, 4), dtype);
    auto xa = a->Attend(1, queries.data, {n - 1, 100, 7}), xb = b->Attend(1, queries.data, {n - 1, 100, 7});
    ASSERT_TRUE(xa.ok() && xb.ok()) << xa.status() << xb.status();
    ExpectSameBits(xa->output, xb->output, what + " Attend output");
    ExpectSameBits(xa->lse, xb->lse, what + " Attend lse");

    const Held key(GaussianVectors(kKv, kDim, 5), dtype), value(GaussianVectors(kKv, kDim, 6), dtype);
    const Held query(GaussianVectors(kQ, kDim, 7), dtype);
    v1::AttentionOptions top;
    top.set_top_k(3);
    auto sa = a->Step(0, n, key.data, value.data, query.data, top), sb = b->Step(0, n, key.data, value.data, query.data, top);
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa.status() << sb.status();
    EXPECT_EQ(sa->tokens, sb->tokens);
    ExpectSameBits(sa->attention.output, sb->attention.output, what + " Step output");
    ExpectSameBits(sa->attention.lse, sb->attention.lse, what + " Step lse");
    EXPECT_EQ(sa->attention.top_k_tokens, sb->attention.top_k_tokens);

    // A Decode batch of both sessions of each client (k = 2 draft tokens).
    auto a2 = a->Fork(n), b2 = b->Fork(n);
    ASSERT_TRUE(a2.ok() && b2.ok());
    auto decode = [&](Client& client, const std::vector<std::string>& ids) {
      DecodeBatch batch;
      batch.layer = 1;
      batch.session_ids = ids;
      batch.positions = {n, n + 1, n, n + 1};
      batch.k = 2;
      batch.q_heads = kQ;
      batch.kv_heads = kKv;
      batch.head_dim = kDim;
      static const Held dq(GaussianVectors(2 * 2 * kQ, kDim, 8), v1::DTYPE_F32);
      const Held qs(dq.f32, dtype), ks(GaussianVectors(2 * 2 * kKv, kDim, 9), dtype),
          vs(GaussianVectors(2 * 2 * kKv, kDim, 10), dtype);
      batch.queries = qs.data;
      batch.keys = ks.data;
      batch.values = vs.data;
      auto stream = client.OpenDecodeStream();
      auto result = stream->Step(batch);
      EXPECT_TRUE(stream->Finish().ok());
      return result;
    };
    auto da = decode(*shm, {a->id(), a2->id()}), db = decode(*bytes, {b->id(), b2->id()});
    ASSERT_TRUE(da.ok() && db.ok()) << da.status() << db.status();
    EXPECT_EQ(da->failed, 0);
    ExpectSameBits(da->output, db->output, what + " Decode output");
    ExpectSameBits(da->lse, db->lse, what + " Decode lse");
    EXPECT_EQ(da->tokens, db->tokens);

    auto ra = a->ReadKv(1), rb = b->ReadKv(1);
    ASSERT_TRUE(ra.ok() && rb.ok());
    ExpectSameBits(ra->keys, rb->keys, what + " stored keys");
    ExpectSameBits(ra->values, rb->values, what + " stored values");
  }
  // The shared-memory client registered one region; the other none.
  EXPECT_EQ(shared().regions(), 1u);
}

class RawCall {
 public:
  RawCall(const std::string& target, const std::string& token)
      : stub_(v1::KvCacheService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))),
        token_(token) {}
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + token_);
    v1::StepResponse response;
    const grpc::Status status = stub_->Step(&context, request, &response);
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response;
  }

 private:
  std::unique_ptr<v1::KvCacheService::Stub> stub_;
  std::string token_;
};

void SetShared(v1::Tensor* t, const std::string& region, uint64_t offset, uint64_t length, int64_t heads) {
  t->set_dtype(v1::DTYPE_F32);
  const int64_t shape[] = {1, heads, kDim};
  t->mutable_shape()->Assign(std::begin(shape), std::end(shape));
  t->mutable_shared()->set_region(region);
  t->mutable_shared()->set_offset(offset);
  t->mutable_shared()->set_length(length);
}

TEST_F(SharedMemoryTest, SlicesOutsideTheRegionOrNotTheCallersAreRefusedAndChangeNothing) {
  auto client = Connect("alpha-secret", 0);
  auto session = client->CreateSession(Shape(v1::CODEC_TURBO4));
  ASSERT_TRUE(session.ok());
  const size_t size = size_t{1} << 20;
  const int fd = MakeMemfd(size);
  Registration alpha = Register(shared().socket_path(), fd, "alpha-secret");
  close(fd);
  ASSERT_THAT(alpha.answer, ::testing::StartsWith("OK "));
  const int beta_fd = MakeMemfd(size);
  Registration beta = Register(shared().socket_path(), beta_fd, "beta-secret");
  close(beta_fd);
  ASSERT_THAT(beta.answer, ::testing::StartsWith("OK "));
  EXPECT_EQ(shared().regions(), 2u);
  EXPECT_EQ(shared().region_bytes(), 2 * size);  // turbokv_shared_memory_bytes

  const uint64_t kv_bytes = kKv * kDim * 4, q_bytes = kQ * kDim * 4;
  auto request = [&](const std::string& region, uint64_t key_offset, uint64_t key_length) {
    v1::StepRequest r;
    r.set_session_id(session->id());
    r.set_position(0);
    SetShared(r.mutable_key(), region, key_offset, key_length, kKv);
    SetShared(r.mutable_value(), region, 4096, kv_bytes, kKv);
    SetShared(r.mutable_query(), region, 8192, q_bytes, kQ);
    return r;
  };
  RawCall raw(server_->endpoints()[0], "alpha-secret");
  auto expect = [&](const v1::StepRequest& r, absl::StatusCode code, const std::string& says) {
    auto response = raw.Step(r);
    EXPECT_EQ(response.status().code(), code) << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(says));
  };
  expect(request(alpha.id(), size - 16, kv_bytes), absl::StatusCode::kInvalidArgument, "not within the region");
  expect(request(alpha.id(), UINT64_MAX - 8, kv_bytes), absl::StatusCode::kInvalidArgument, "not within the region");
  expect(request(alpha.id(), 0, kv_bytes - 4), absl::StatusCode::kInvalidArgument, "key.shared holds");
  expect(request(beta.id(), 0, kv_bytes), absl::StatusCode::kNotFound, "no shared-memory region");
  expect(request("no-such-region", 0, kv_bytes), absl::StatusCode::kNotFound, "no shared-memory region");
  // A 100 KB region id comes back cut, as a short NOT_FOUND (not a reply
  // past gRPC's metadata limit).
  auto long_id = raw.Step(request(std::string(100000, 'r'), 0, kv_bytes));
  EXPECT_EQ(long_id.status().code(), absl::StatusCode::kNotFound) << long_id.status().message().substr(0, 200);
  EXPECT_LT(long_id.status().message().size(), 200u);
  v1::StepRequest both = request(alpha.id(), 0, kv_bytes);
  both.mutable_key()->set_data(std::string(kv_bytes, '\0'));
  expect(both, absl::StatusCode::kInvalidArgument, "sets both data and shared");
  // The inputs are fine; the room for the results is not.
  v1::StepRequest small = request(alpha.id(), 0, kv_bytes);
  small.mutable_output_to()->set_region(alpha.id());
  small.mutable_output_to()->set_offset(65536);
  small.mutable_output_to()->set_length(q_bytes);
  expect(small, absl::StatusCode::kInvalidArgument, "the result needs");
  small.mutable_output_to()->set_offset(65536 + 8);
  small.mutable_output_to()->set_length(q_bytes + 4096);
  expect(small, absl::StatusCode::kInvalidArgument, "multiple of 64");
  small.mutable_output_to()->set_offset(size - 64);
  expect(small, absl::StatusCode::kInvalidArgument, "not within the region");
  EXPECT_EQ(session->Info()->layer_tokens(0), 0) << "a refused call stored its token";

  // The same call, within bounds, stores the token and answers into the region.
  v1::StepRequest good = request(alpha.id(), 0, kv_bytes);
  good.mutable_output_to()->set_region(alpha.id());
  good.mutable_output_to()->set_offset(65536);
  good.mutable_output_to()->set_length(q_bytes + 4096);
  auto response = raw.Step(good);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->tokens(), 1);
  EXPECT_TRUE(response->result().output().data().empty());
  EXPECT_EQ(response->result().output().shared().offset(), 65536u);
  EXPECT_EQ(response->result().output().shared().length(), q_bytes);
  EXPECT_EQ(response->result().lse().shared().offset(), 65536u + q_bytes);

  close(alpha.connection);
  close(beta.connection);
  for (int i = 0; i < 500 && shared().regions() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(shared().regions(), 0u);
  expect(good, absl::StatusCode::kNotFound, "no shared-memory region");  // released with its connection
}

TEST_F(SharedMemoryTest, RegistrationRefusesWhatCannotBeMappedSafely) {
  auto refused = [&](int fd, const std::string& token, const std::string& says) {
    Registration r = Register(shared().socket_path(), fd, token);
    EXPECT_THAT(r.answer, ::testing::StartsWith("ERROR ")) << says;
    EXPECT_THAT(r.answer, HasSubstr(says));
    close(r.connection);
  };
  const int unsealed = MakeMemfd(4096, /*seal=*/false);
  refused(unsealed, "alpha-secret", "sealed against shrinking");
  close(unsealed);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  refused(pipe_fds[0], "alpha-secret", "not a memfd");
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  refused(-1, "alpha-secret", "one fd");
  const int fine = MakeMemfd(4096);
  refused(fine, "guess", "unknown bearer token");
  close(fine);
  const int huge = MakeMemfd(size_t{32} << 20);
  refused(huge, "alpha-secret", "--shared-memory-max-bytes");
  close(huge);
  const int empty = MakeMemfd(0);
  refused(empty, "alpha-secret", "it must have 1 to");
  close(empty);
  EXPECT_EQ(shared().regions(), 0u);
}

TEST_F(SharedMemoryTest, RegionsAreReleasedWhenTheirClientsGo) {
  const int fds_before = OpenFds();
  for (int i = 0; i < 1000; ++i) {
    const int fd = MakeMemfd(65536);
    Registration r = Register(shared().socket_path(), fd, "alpha-secret");
    close(fd);
    ASSERT_THAT(r.answer, ::testing::StartsWith("OK ")) << i;
    close(r.connection);
  }
  for (int i = 0; i < 500 && shared().regions() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(shared().regions(), 0u);
  EXPECT_EQ(shared().region_bytes(), 0u);
  EXPECT_LE(OpenFds(), fds_before + 2) << "connections or memfds left open";
  // Clients that come and go through the C++ client, each with a call.
  auto session = Connect("alpha-secret", 0)->CreateSession(Shape(v1::CODEC_TURBO3));
  ASSERT_TRUE(session.ok());
  for (int i = 0; i < 20; ++i) {
    auto client = Connect("alpha-secret");
    auto opened = client->OpenSession(session->id());
    ASSERT_TRUE(opened.ok());
    const std::vector<float> key = GaussianVectors(kKv, kDim, i), query = GaussianVectors(kQ, kDim, i);
    ASSERT_TRUE(opened->Step(0, i, TensorData::F32(key), TensorData::F32(key), TensorData::F32(query)).ok());
  }
  for (int i = 0; i < 500 && shared().regions() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(shared().regions(), 0u);
}

TEST_F(SharedMemoryTest, ARegionStaysMappedWhileACallHoldsIt) {
  const int fd = MakeMemfd(8192);
  Registration r = Register(shared().socket_path(), fd, "alpha-secret");
  ASSERT_THAT(r.answer, ::testing::StartsWith("OK "));
  auto held = shared().Find("alpha", r.id());
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(shared().Find("beta", r.id()).status().code(), absl::StatusCode::kNotFound);
  void* mine = mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  std::memset(mine, 0x5a, 8192);
  // The client unmaps and goes, as one that dies mid-call would.
  munmap(mine, 8192);
  close(r.connection);
  for (int i = 0; i < 500 && shared().regions() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(shared().regions(), 0u);
  auto slice = (*held)->Slice(4096, 4096, "test");
  ASSERT_TRUE(slice.ok());
  EXPECT_EQ((*slice)[4095], 0x5a);
}

// A CPU server on Dir()/NAME.sock, without metrics.
ServerOptions Plain(const std::string& name) {
  ServerOptions options;
  options.listen = {absl::StrCat("unix://", Dir(), "/", name, ".sock")};
  options.device = "cpu";
  options.threads = 2;
  options.metrics_listen = "";
  return options;
}

TEST(SharedMemoryFallbackTest, WithoutSharedMemoryTheClientSendsBytes) {
  ServerOptions options = Plain("plain");
  options.shared_memory_socket = "";
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Start().ok());
  EXPECT_EQ((*server)->shared_memory(), nullptr);
  auto client = Client::Connect(options.listen[0]);
  ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(10)).ok());
  auto session = client->CreateSession(Shape(v1::CODEC_TURBO3));
  ASSERT_TRUE(session.ok());
  const std::vector<float> key = GaussianVectors(kKv, kDim, 1), query = GaussianVectors(kQ, kDim, 2);
  auto step = session->Step(0, 0, TensorData::F32(key), TensorData::F32(key), TensorData::F32(query));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->attention.output.size(), static_cast<size_t>(kQ * kDim));
  // A tensor naming shared memory is refused by such a daemon, saying why.
  v1::StepRequest request;
  request.set_session_id(session->id());
  request.set_position(1);
  SetShared(request.mutable_key(), "r", 0, kKv * kDim * 4, kKv);
  RawCall raw(options.listen[0], "");
  auto refused = raw.Step(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("does not serve"));
  EXPECT_TRUE((*server)->Shutdown(absl::Seconds(1)).ok());
}


// A shared-memory socket that takes no client (its backlog full) or takes
// one and never answers: the C++ client's first call falls back to the
// messages at once, or within a second (issue 58 item 3: it hung in
// connect, or stalled 5 s).
TEST(SharedMemoryFallbackTest, AShmSocketThatDoesNotAnswerCostsTheClientAtMostASecond) {
  ServerOptions options = Plain("stuck");
  options.shared_memory_socket = Dir() + "/elsewhere.shm";  // the client looks for stuck.sock.shm
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Start().ok());
  const std::string stuck = Dir() + "/stuck.sock.shm";
  for (const bool full : {true, false}) {
    (void)unlink(stuck.c_str());
    const int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, stuck.data(), stuck.size());
    ASSERT_EQ(bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
    ASSERT_EQ(listen(listener, 0), 0);
    std::vector<int> filling;  // a backlog of 0 still takes one or two: filled
    for (int i = 0; full && i < 4; ++i) {
      const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0) {
        filling.push_back(fd);
      } else {
        close(fd);
      }
    }
    ClientOptions client_options;
    client_options.shared_memory_bytes = size_t{1} << 20;
    auto client = Client::Connect(options.listen[0], client_options);
    ASSERT_TRUE(client->WaitUntilServing(absl::Seconds(10)).ok());
    auto session = client->CreateSession(Shape(v1::CODEC_TURBO3));
    ASSERT_TRUE(session.ok());
    const std::vector<float> key = GaussianVectors(kKv, kDim, 1), query = GaussianVectors(kQ, kDim, 2);
    const absl::Time start = absl::Now();
    auto step = session->Step(0, 0, TensorData::F32(key), TensorData::F32(key), TensorData::F32(query));
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->attention.output.size(), static_cast<size_t>(kQ * kDim));
    EXPECT_LT(took, full ? absl::Milliseconds(500) : absl::Milliseconds(1800)) << (full ? "backlog full" : "no answer");
    for (int fd : filling) close(fd);
    close(listener);
  }
  (void)unlink(stuck.c_str());
  EXPECT_TRUE((*server)->Shutdown(absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace turbokv
