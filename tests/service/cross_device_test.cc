// The same sessions on the GPU and on the CPU, side by side through two
// handlers: what the GPU stores reads back as the CPU's (ReadKv), attends as
// the CPU's (Attend, Step, Decode with top_k), forks, truncates and reports
// its quantization error as the CPU does. Skips, saying why, without a GPU
// that can serve.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "service/backend/cpu_backend.h"
#include "service/handler/handler.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/backend_testing.h"
#include "tests/service/service_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::MakeAppend;
using ::turbokv::testing::MakeCreate;
using ::turbokv::testing::MakeTensor;
using ::turbokv::testing::RelativeL2;
using ::turbokv::testing::TensorFloats;

constexpr int kLayers = 2, kKv = 4, kQ = 16, kDim = 128;

// The CPU backend attending with the scalar path (Attend too: it is
// EncodeAndAttend without chunks), the float reference the
// CUDA kernel tests hold the GPU to (1e-4): the default SIMD path rounds its
// integer dot products within 5e-4 of that reference, so it is no oracle for
// a bound of 1e-4.
class ReferenceCpuBackend : public CpuBackend {
 public:
  using CpuBackend::CpuBackend;
  absl::Status EncodeAndAttend(absl::Span<const EncodeChunk> chunks, const AttentionBatch& batch,
                               const AttentionParams& params) override {
    AttentionOptions options{AttentionPath::kScalar, nullptr};
    options.encode_first = chunks;
    return AttendCpu(batch, params, options);
  }
};

// A handler over its own store on one device.
struct Side {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<SessionStore> store;
  std::unique_ptr<Handler> handler;
};

class CrossDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto [side, device] : {std::make_pair(&cpu_, "cpu"), std::make_pair(&gpu_, "cuda:0")}) {
      if (side == &cpu_) {
        side->backend = std::make_unique<ReferenceCpuBackend>(&pool_);
      } else {
        absl::StatusOr<std::unique_ptr<Backend>> backend = testing::TestBackend(device, &pool_, kBudget);
        if (!backend.ok()) GTEST_SKIP() << device << " cannot serve here: " << backend.status().message();
        side->backend = *std::move(backend);
      }
      StoreOptions store;
      store.backend = side->backend.get();
      store.budget_bytes = kBudget;
      store.page_tokens = 16;
      side->store = std::make_unique<SessionStore>(store);
      HandlerOptions options;
      options.kernel_pool = &pool_;
      side->handler = std::make_unique<Handler>(side->store.get(), options);
    }
  }

  // The same request on both sides: both answers must be OK.
  template <typename Call>
  auto Both(Call call) {
    auto c = call(*cpu_.handler);
    auto g = call(*gpu_.handler);
    EXPECT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(g.ok()) << g.status();
    return std::make_pair(*std::move(c), *std::move(g));
  }

  // Every key and value of a session, decoded (ReadKv).
  static std::vector<float> Contents(Handler& handler, const std::string& id) {
    v1::ReadKvRequest request;
    request.set_session_id(id);
    absl::StatusOr<ReadKvCursor> cursor = handler.StartReadKv(request);
    EXPECT_TRUE(cursor.ok()) << cursor.status();
    std::vector<float> all;
    for (;;) {
      v1::ReadKvResponse response;
      absl::StatusOr<bool> more = handler.NextReadKv(*cursor, &response);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) return all;
      for (const v1::Tensor* t : {&response.keys(), &response.values()}) {
        const std::vector<float> part = TensorFloats(*t);
        all.insert(all.end(), part.begin(), part.end());
      }
    }
  }

  // The GPU's floats are the CPU's but for the rare index whose coordinate
  // lies within float rounding of a quantizer boundary.
  static void ExpectSameContents(const std::vector<float>& gpu, const std::vector<float>& cpu) {
    ASSERT_EQ(gpu.size(), cpu.size());
    size_t differ = 0;
    for (size_t i = 0; i < cpu.size(); ++i) differ += gpu[i] != cpu[i];
    EXPECT_LE(differ, cpu.size() / 5000 + 8) << differ << " of " << cpu.size() << " values differ";
  }

  static constexpr size_t kBudget = size_t{512} << 20;
  ThreadPool pool_{2};
  Side cpu_, gpu_;
};

TEST_F(CrossDeviceTest, TheGpuStoresReadsAndAttendsAsTheCpu) {
  // Sessions of every codec pair, the same rotation seed on both sides.
  const std::vector<std::pair<v1::Codec, v1::Codec>> codecs = {{v1::CODEC_TURBO3, v1::CODEC_TURBO3},
                                                                {v1::CODEC_TURBO4, v1::CODEC_TURBO2},
                                                                {v1::CODEC_Q8_0, v1::CODEC_F16},
                                                                {v1::CODEC_Q4_0, v1::CODEC_TURBO3}};
  std::vector<std::string> cpu_ids, gpu_ids;
  for (size_t s = 0; s < codecs.size(); ++s) {
    auto [c, g] = Both([&](Handler& h) {
      return h.CreateSession(MakeCreate(kLayers, kKv, kQ, kDim, codecs[s].first, codecs[s].second));
    });
    cpu_ids.push_back(c.session_id());
    gpu_ids.push_back(g.session_id());
    // A prefill over several pages, then a chunk that repeats and extends it.
    const int64_t n = 100 + 37 * static_cast<int64_t>(s);
    const auto k = GaussianVectors(kLayers * n * kKv, kDim, 10 + s), v = GaussianVectors(kLayers * n * kKv, kDim, 20 + s);
    Both([&](Handler& h) {
      const std::string& id = &h == cpu_.handler.get() ? cpu_ids[s] : gpu_ids[s];
      return h.Append(MakeAppend(id, -1, 0, k, v, {kLayers, n, kKv, kDim}));
    });
    const auto k2 = GaussianVectors(30 * kKv, kDim, 30 + s), v2 = GaussianVectors(30 * kKv, kDim, 40 + s);
    Both([&](Handler& h) {
      const std::string& id = &h == cpu_.handler.get() ? cpu_ids[s] : gpu_ids[s];
      return h.Append(MakeAppend(id, 1, n - 10, k2, v2, {30, kKv, kDim}));
    });
  }
  for (size_t s = 0; s < codecs.size(); ++s) {
    ExpectSameContents(Contents(*gpu_.handler, gpu_ids[s]), Contents(*cpu_.handler, cpu_ids[s]));
  }

  // Decode with top_k over all sessions: one batch on each side.
  v1::DecodeRequest decode;
  decode.set_layer(1);
  decode.mutable_options()->set_top_k(4);
  decode.mutable_options()->set_window(64);
  const auto q = GaussianVectors(codecs.size() * kQ, kDim, 50);
  const auto dk = GaussianVectors(codecs.size() * kKv, kDim, 51), dv = GaussianVectors(codecs.size() * kKv, kDim, 52);
  const int64_t b = static_cast<int64_t>(codecs.size());
  *decode.mutable_queries() = MakeTensor(q, {b, kQ, kDim});
  *decode.mutable_keys() = MakeTensor(dk, {b, kKv, kDim});
  *decode.mutable_values() = MakeTensor(dv, {b, kKv, kDim});
  for (size_t s = 0; s < codecs.size(); ++s) decode.add_positions(100 + 37 * static_cast<int64_t>(s) + 20);
  v1::DecodeRequest cpu_decode = decode, gpu_decode = decode;
  for (size_t s = 0; s < codecs.size(); ++s) {
    cpu_decode.add_session_ids(cpu_ids[s]);
    gpu_decode.add_session_ids(gpu_ids[s]);
  }
  auto [cpu_step, gpu_step] = Both([&](Handler& h) {
    return h.Decode(&h == cpu_.handler.get() ? cpu_decode : gpu_decode);
  });
  EXPECT_EQ(gpu_step.failed(), 0);
  EXPECT_LT(RelativeL2(TensorFloats(gpu_step.output()), TensorFloats(cpu_step.output())), 1e-4);
  const std::vector<float> cpu_lse = TensorFloats(cpu_step.lse()), gpu_lse = TensorFloats(gpu_step.lse());
  for (size_t i = 0; i < cpu_lse.size(); ++i) EXPECT_NEAR(gpu_lse[i], cpu_lse[i], 1e-3 * std::fabs(cpu_lse[i]) + 1e-3);
  ASSERT_EQ(gpu_step.top_k_logits_size(), cpu_step.top_k_logits_size());
  for (int i = 0; i < cpu_step.top_k_logits_size(); ++i) {
    EXPECT_NEAR(gpu_step.top_k_logits(i), cpu_step.top_k_logits(i), 1e-3 * std::fabs(cpu_step.top_k_logits(i)) + 1e-3);
  }

  // A fork of a truncated session, on both sides, then a Step on the fork.
  auto [cpu_info, gpu_info] = Both([&](Handler& h) {
    v1::TruncateSessionRequest truncate;
    truncate.set_session_id(&h == cpu_.handler.get() ? cpu_ids[0] : gpu_ids[0]);
    truncate.set_tokens(70);
    return h.TruncateSession(truncate);
  });
  EXPECT_EQ(gpu_info.layer_tokens(1), cpu_info.layer_tokens(1));
  // (Not a structured binding: the lambda below uses them.)
  const auto forks = Both([&](Handler& h) {
    v1::ForkSessionRequest fork;
    fork.set_source_session_id(&h == cpu_.handler.get() ? cpu_ids[0] : gpu_ids[0]);
    fork.set_prefix_tokens(61);
    return h.ForkSession(fork);
  });
  const v1::ForkSessionResponse& cpu_fork = forks.first;
  const v1::ForkSessionResponse& gpu_fork = forks.second;
  auto [cpu_attend, gpu_attend] = Both([&](Handler& h) {
    v1::StepRequest step;
    step.set_session_id(&h == cpu_.handler.get() ? cpu_fork.session_id() : gpu_fork.session_id());
    step.set_layer(0);
    step.set_position(61);
    *step.mutable_key() = MakeTensor(GaussianVectors(kKv, kDim, 60), {1, kKv, kDim});
    *step.mutable_value() = MakeTensor(GaussianVectors(kKv, kDim, 61), {1, kKv, kDim});
    *step.mutable_query() = MakeTensor(GaussianVectors(kQ, kDim, 62), {1, kQ, kDim});
    return h.Step(step);
  });
  EXPECT_LT(RelativeL2(TensorFloats(gpu_attend.result().output()), TensorFloats(cpu_attend.result().output())), 1e-4);
  ExpectSameContents(Contents(*gpu_.handler, gpu_fork.session_id()), Contents(*cpu_.handler, cpu_fork.session_id()));
  ExpectSameContents(Contents(*gpu_.handler, gpu_ids[0]), Contents(*cpu_.handler, cpu_ids[0]));

  // The live quantization error, as each side's encoder measured it.
  for (size_t s = 0; s < codecs.size(); ++s) {
    auto [c, g] = Both([&](Handler& h) {
      v1::GetSessionRequest get;
      get.set_session_id(&h == cpu_.handler.get() ? cpu_ids[s] : gpu_ids[s]);
      return h.GetSession(get);
    });
    EXPECT_EQ(g.bytes_used(), c.bytes_used()) << s;
    ASSERT_EQ(g.key_errors_size(), c.key_errors_size());
    for (int l = 0; l < c.key_errors_size(); ++l) {
      EXPECT_NEAR(g.key_errors(l), c.key_errors(l), 1e-3 * c.key_errors(l) + 1e-9) << s << " layer " << l;
      EXPECT_NEAR(g.value_errors(l), c.value_errors(l), 1e-3 * c.value_errors(l) + 1e-9) << s << " layer " << l;
    }
  }
}

}  // namespace
}  // namespace turbokv
