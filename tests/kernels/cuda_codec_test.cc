// The CUDA codecs against the scalar CPU reference. Skips, saying why, when no
// usable CUDA device is present.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cuda/cuda_codec.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::CodeComparison;
using ::turbokv::testing::CompareCodes;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::OutlierKeys;
using ::turbokv::testing::RelativeMse;
using ::turbokv::testing::UnitVectors;

class CudaCodecTest : public ::testing::TestWithParam<std::tuple<CodecKind, int, int>> {
 protected:
  void SetUp() override {
    const absl::Status device = cuda::CheckDevice(0);
    if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  }
};

TEST_P(CudaCodecTest, MatchesTheScalarReference) {
  const auto [kind, head_dim, batch] = GetParam();
  const CodecSpec spec{kind, head_dim, 0xc0ffee};
  auto gpu = cuda::CudaCodec::Create(spec, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = MakeCpuCodec(spec, CpuPath::kScalar);
  ASSERT_TRUE(cpu.ok());
  const size_t n = batch;
  const std::vector<float> x = GaussianVectors(n, head_dim, 500 + batch + head_dim);

  std::vector<uint8_t> ref_codes(n * (*cpu)->code_size()), gpu_codes(ref_codes.size(), 0xa5);
  (*cpu)->Encode(n, x.data(), ref_codes.data());
  ASSERT_TRUE((*gpu)->Encode(n, x.data(), gpu_codes.data()).ok());
  const CodeComparison c =
      CompareCodes(spec, (*cpu)->layout(), x.data(), n, ref_codes.data(), gpu_codes.data());
  EXPECT_EQ(c.far_from_boundary, 0u);
  EXPECT_LE(c.index_mismatches, n * head_dim / 10000 + 2) << "indices near a boundary";
  EXPECT_EQ(c.scale_mismatches, 0u);
  EXPECT_EQ(c.byte_mismatches, 0u);

  // Decoding the same bytes gives the same floats.
  std::vector<float> ref_x(x.size()), gpu_x(x.size(), std::nanf(""));
  (*cpu)->Decode(n, ref_codes.data(), ref_x.data());
  ASSERT_TRUE((*gpu)->Decode(n, ref_codes.data(), gpu_x.data()).ok());
  size_t differ = 0;
  for (size_t i = 0; i < x.size(); ++i) differ += std::memcmp(&ref_x[i], &gpu_x[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    AllCodecs, CudaCodecTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllCodecs),
                       ::testing::Values(64, 128, 192, 576), ::testing::Values(1, 7, 1000, 40001)),
    [](const auto& info) {
      return std::string(CodecName(std::get<0>(info.param))) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_n" +
             std::to_string(std::get<2>(info.param));
    });

TEST(CudaFidelityTest, UnitVectorsMeetTheBars) {
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  constexpr size_t kVectors = testing::kFidelityVectors;
  const std::vector<float> x = UnitVectors(kVectors, 128, 2024);
  for (const testing::FidelityBar& b : testing::kFidelityBars) {
    auto gpu = cuda::CudaCodec::Create(CodecSpec{b.kind, 128, 5}, 0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    std::vector<uint8_t> codes(kVectors * (*gpu)->code_size());
    std::vector<float> y(x.size());
    ASSERT_TRUE((*gpu)->Encode(kVectors, x.data(), codes.data()).ok());
    ASSERT_TRUE((*gpu)->Decode(kVectors, codes.data(), y.data()).ok());
    EXPECT_LE(RelativeMse(x, y), b.max_rel_mse) << CodecName(b.kind);
  }
}

TEST(CudaDeviceTest, MissingDeviceIsReportedNotFatal) {
  const absl::Status status = cuda::CheckDevice(1 << 20);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(status.message().empty());
}

}  // namespace
}  // namespace turbokv
