// CUDA attention against the scalar CPU path on the same pages. Skips, saying
// why, when no usable CUDA device is present.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::RelativeL2;

class CudaAttentionTest
    : public ::testing::TestWithParam<std::tuple<std::pair<CodecKind, CodecKind>, int, int>> {
 protected:
  void SetUp() override {
    const absl::Status device = cuda::CheckDevice(0);
    if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  }
};

TEST_P(CudaAttentionTest, MatchesTheScalarCpuPath) {
  const auto [codecs, d, group] = GetParam();
  constexpr int kKvHeads = 2, kPage = 64;
  for (int64_t tokens : {int64_t{1}, int64_t{kPage - 1}, int64_t{kPage + 1}, int64_t{10000}}) {
    auto cache = PagedCacheBuffer::Create({codecs.first, d, 0x33}, {codecs.second, d, 0x44}, kKvHeads, kPage);
    ASSERT_TRUE(cache.ok());
    const std::vector<float> k = GaussianVectors(tokens * kKvHeads, d, 1 + tokens);
    const std::vector<float> v = GaussianVectors(tokens * kKvHeads, d, 2 + tokens);
    (*cache)->Append(tokens, k.data(), v.data());
    auto device_cache = cuda::DevicePagedCache::Upload((*cache)->descriptor(), 0);
    ASSERT_TRUE(device_cache.ok()) << device_cache.status();

    for (const auto& [window, softcap] : {std::make_pair(int64_t{0}, 0.0f), std::make_pair(int64_t{37}, 4.0f)}) {
      AttentionParams params;
      params.q_heads = kKvHeads * group;
      params.window = window;
      params.softcap = softcap;
      const std::vector<int64_t> positions = {tokens - 1, (tokens - 1) / 2, 0};
      std::vector<float> q = GaussianVectors(positions.size() * params.q_heads, d, 3 + tokens);
      for (float& x : q) x *= 2.0f;
      const size_t rows = positions.size() * params.q_heads;
      std::vector<float> cpu_out(rows * d), cpu_lse(rows), gpu_out(rows * d, std::nanf("")), gpu_lse(rows, std::nanf(""));
      const AttentionQueries queries{static_cast<int64_t>(positions.size()), q.data(), positions.data()};
      ASSERT_TRUE(AttendCpu((*cache)->descriptor(), params, queries, {cpu_out.data(), cpu_lse.data()},
                            {AttentionPath::kScalar})
                      .ok());
      const absl::Status s = cuda::AttendCudaFromHost(**device_cache, params, queries, {gpu_out.data(), gpu_lse.data()});
      ASSERT_TRUE(s.ok()) << s;
      const std::string what = std::string(CodecName(codecs.first)) + "/" + CodecName(codecs.second) + " d=" +
                               std::to_string(d) + " group=" + std::to_string(group) + " tokens=" +
                               std::to_string(tokens) + " window=" + std::to_string(window);
      EXPECT_LT(RelativeL2(gpu_out, cpu_out), 2e-5) << what;
      for (size_t i = 0; i < rows; ++i) {
        ASSERT_NEAR(gpu_lse[i], cpu_lse[i], 1e-4 * std::max(1.0f, std::fabs(cpu_lse[i]))) << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTest,
    ::testing::Combine(::testing::Values(std::make_pair(CodecKind::kTurbo3, CodecKind::kTurbo3),
                                         std::make_pair(CodecKind::kTurbo2, CodecKind::kTurbo4),
                                         std::make_pair(CodecKind::kF16, CodecKind::kF16),
                                         std::make_pair(CodecKind::kQ8_0, CodecKind::kQ4_0)),
                       ::testing::Values(64, 128, 256), ::testing::Values(1, 4, 8)),
    [](const auto& info) {
      const auto& codecs = std::get<0>(info.param);
      return std::string(CodecName(codecs.first)) + "_" + CodecName(codecs.second) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_g" + std::to_string(std::get<2>(info.param));
    });

TEST(CudaAttentionLimitsTest, TopKIsReportedUnimplemented) {
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  auto cache = PagedCacheBuffer::Create({CodecKind::kTurbo3, 128, 1}, {CodecKind::kTurbo3, 128, 2}, 1, 16);
  const std::vector<float> k = GaussianVectors(4, 128, 1);
  (*cache)->Append(4, k.data(), k.data());
  auto device_cache = cuda::DevicePagedCache::Upload((*cache)->descriptor(), 0);
  ASSERT_TRUE(device_cache.ok());
  AttentionParams params;
  params.q_heads = 1;
  params.top_k = 2;
  std::vector<float> out(128), lse(1), top_logits(2);
  std::vector<int64_t> top_tokens(2);
  const int64_t position = 3;
  const absl::Status s = cuda::AttendCudaFromHost(**device_cache, params, {1, k.data(), &position},
                                                  {out.data(), lse.data(), top_tokens.data(), top_logits.data()});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
}

}  // namespace
}  // namespace turbokv
