#include "kernels/codec.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/cpu/cpu_codecs.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::CodeComparison;
using ::turbokv::testing::CompareCodes;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::OutlierKeys;
using ::turbokv::testing::RelativeMse;
using ::turbokv::testing::UnitVectors;

std::unique_ptr<Codec> Make(CodecKind kind, int head_dim, CpuPath path, uint64_t seed = 42) {
  auto codec = MakeCpuCodec(CodecSpec{kind, head_dim, seed}, path);
  EXPECT_TRUE(codec.ok()) << codec.status();
  return *std::move(codec);
}

struct Encoded {
  std::vector<uint8_t> codes;
  std::vector<float> decoded;
};

Encoded RoundTrip(const Codec& codec, const std::vector<float>& x) {
  const size_t n = x.size() / codec.layout().head_dim;
  Encoded e;
  e.codes.assign(n * codec.code_size(), 0xa5);
  e.decoded.assign(x.size(), std::nanf(""));
  codec.Encode(n, x.data(), e.codes.data());
  codec.Decode(n, e.codes.data(), e.decoded.data());
  return e;
}

// Expected relative MSE of each codec on Gaussian data (see docs/FORMAT.md).
double ExpectedMse(CodecKind kind) {
  switch (kind) {
    case CodecKind::kF16:
      return 1e-7;
    case CodecKind::kQ8_0:
      return 4e-5;
    case CodecKind::kQ4_0:
      return 0.01;
    case CodecKind::kTurbo2:
      return 0.117;
    case CodecKind::kTurbo3:
      return 0.034;
    default:
      return 0.0094;
  }
}

TEST(CodecSpecTest, RejectsUnsupportedHeadDims) {
  for (int d : {0, -64, 32, 100, 129, 200, 4160}) {
    auto layout = CheckCodecSpec(CodecSpec{CodecKind::kTurbo3, d, 0});
    ASSERT_FALSE(layout.ok()) << d;
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(layout.status().message()).find("multiples of 64"), std::string::npos)
        << layout.status();
  }
}

TEST(CodecSpecTest, ParsesNamesAndRejectsUnknownOnes) {
  for (CodecKind kind : testing::kAllCodecs) {
    auto parsed = ParseCodecKind(CodecName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  auto bad = ParseCodecKind("turbo5");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("turbo5"), std::string::npos);
}

TEST(CodecSpecTest, SizesMatchTheFormat) {
  struct Case {
    CodecKind kind;
    int head_dim;
    size_t bytes;
  } cases[] = {
      {CodecKind::kF16, 128, 256},   {CodecKind::kQ8_0, 128, 136},  {CodecKind::kQ4_0, 128, 72},
      {CodecKind::kTurbo2, 128, 34}, {CodecKind::kTurbo3, 128, 50}, {CodecKind::kTurbo4, 128, 66},
      {CodecKind::kTurbo3, 64, 26},  {CodecKind::kTurbo3, 576, 9 * 26},
      {CodecKind::kTurbo4, 256, 132},
  };
  for (const Case& c : cases) {
    auto layout = CheckCodecSpec(CodecSpec{c.kind, c.head_dim, 0});
    ASSERT_TRUE(layout.ok());
    EXPECT_EQ(layout->code_size(), c.bytes) << CodecName(c.kind) << " d=" << c.head_dim;
  }
  EXPECT_DOUBLE_EQ(CheckCodecSpec({CodecKind::kTurbo3, 128, 0})->bits_per_value(), 3.125);
}

TEST(CodebookTest, SymmetricAscendingAndNearTheGaussianOptimum) {
  // Lloyd-Max for N(0,1): 0.1175, 0.03454, 0.009497; the bounded sphere
  // marginal is a little easier.
  const double gaussian[] = {0, 0, 0.1175, 0.03454, 0.009497};
  for (const Codebook& cb : kCodebooks) {
    const int levels = 1 << cb.bits;
    for (int i = 0; i < levels; ++i) {
      EXPECT_EQ(cb.centroids[i], -cb.centroids[levels - 1 - i]);
      if (i + 1 < levels) {
        EXPECT_LT(cb.centroids[i], cb.boundaries[i]);
        EXPECT_LT(cb.boundaries[i], cb.centroids[i + 1]);
      }
    }
    EXPECT_LT(cb.mse, gaussian[cb.bits]);
    EXPECT_GT(cb.mse, 0.95 * gaussian[cb.bits]);
    EXPECT_GT(cb.mse, std::pow(4.0, -cb.bits));  // the information-theoretic floor
  }
}

TEST(RotationTest, OrthogonalAfterScalingAndInverts) {
  for (int bv : {64, 128}) {
    const HadamardRotation rot(2 * bv, bv, 7);
    std::vector<float> a = GaussianVectors(1, bv, 1), b = GaussianVectors(1, bv, 2);
    double na = 0, dot = 0;
    for (int i = 0; i < bv; ++i) {
      na += double(a[i]) * a[i];
      dot += double(a[i]) * b[i];
    }
    std::vector<float> ra = a, rb = b;
    rot.Forward(1, ra.data());
    rot.Forward(1, rb.data());
    double rna = 0, rdot = 0;
    for (int i = 0; i < bv; ++i) {
      rna += double(ra[i]) * ra[i] / bv;
      rdot += double(ra[i]) * rb[i] / bv;
    }
    EXPECT_NEAR(rna, na, 1e-4 * na);
    EXPECT_NEAR(rdot, dot, 1e-4 * na);
    rot.Inverse(1, ra.data());
    for (int i = 0; i < bv; ++i) EXPECT_NEAR(ra[i] / bv, a[i], 1e-5);
  }
}

TEST(RotationTest, KeyAndValueSignsAreIndependent) {
  const uint64_t k = DeriveRotationSeed(1234, RotationStream::kKeys);
  const uint64_t v = DeriveRotationSeed(1234, RotationStream::kValues);
  ASSERT_NE(k, v);
  int differ = 0, negative = 0;
  for (int i = 0; i < 4096; ++i) {
    differ += RotationSignNegative(k, i) != RotationSignNegative(v, i);
    negative += RotationSignNegative(k, i);
  }
  EXPECT_NEAR(differ, 2048, 200);
  EXPECT_NEAR(negative, 2048, 200);
}

class RoundTripTest : public ::testing::TestWithParam<std::tuple<CodecKind, int, int>> {};

TEST_P(RoundTripTest, ScalarAndSimdAgreeAndStayAccurate) {
  const auto [kind, head_dim, batch] = GetParam();
  const auto scalar = Make(kind, head_dim, CpuPath::kScalar);
  const auto simd = Make(kind, head_dim, CpuPath::kSimd);
  const std::vector<float> x = GaussianVectors(batch, head_dim, 1000 + head_dim + batch);
  const Encoded ref = RoundTrip(*scalar, x);
  const Encoded got = RoundTrip(*simd, x);

  const double mse = RelativeMse(x, ref.decoded);
  const double slack = batch * head_dim < 1000 ? 3.0 : 1.3;
  EXPECT_LT(mse, ExpectedMse(kind) * slack) << CodecName(kind);
  if (kind != CodecKind::kF16) {
    EXPECT_GT(mse, ExpectedMse(kind) / 10);
  }

  // The SIMD path sums in the reference's order: identical bytes and floats.
  const CodeComparison c = CompareCodes(simd->spec(), simd->layout(), x.data(), batch,
                                        ref.codes.data(), got.codes.data());
  EXPECT_EQ(c.index_mismatches, 0u);
  EXPECT_EQ(c.scale_mismatches, 0u);
  EXPECT_EQ(c.byte_mismatches, 0u);
  EXPECT_EQ(std::memcmp(ref.decoded.data(), got.decoded.data(), x.size() * sizeof(float)), 0)
      << simd->implementation();
}

INSTANTIATE_TEST_SUITE_P(
    AllCodecs, RoundTripTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllCodecs),
                       ::testing::Values(64, 128, 256, 576), ::testing::Values(1, 7, 1000)),
    [](const auto& info) {
      return std::string(CodecName(std::get<0>(info.param))) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_n" +
             std::to_string(std::get<2>(info.param));
    });

// Every SIMD target compiled in and supported by this CPU (AVX-512, AVX2,
// SSE4, ... down to the emulated one) against the scalar reference.
TEST(SimdTargetsTest, EveryTargetMatchesTheReference) {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  int tested = 0;
  for (int64_t bits = targets; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    ASSERT_EQ(std::string(ChosenSimdTarget()), hwy::TargetName(target));
    for (CodecKind kind : testing::kAllCodecs) {
      for (int d : {64, 128, 576}) {
        const auto scalar = Make(kind, d, CpuPath::kScalar, 9);
        const auto simd = Make(kind, d, CpuPath::kSimd, 9);
        const std::vector<float> x = GaussianVectors(33, d, 77);
        const Encoded ref = RoundTrip(*scalar, x);
        const Encoded got = RoundTrip(*simd, x);
        EXPECT_EQ(ref.codes, got.codes) << hwy::TargetName(target) << " " << CodecName(kind) << " d=" << d;
        EXPECT_EQ(std::memcmp(ref.decoded.data(), got.decoded.data(), x.size() * sizeof(float)), 0)
            << hwy::TargetName(target) << " " << CodecName(kind) << " d=" << d;
      }
    }
    ++tested;
    std::printf("checked SIMD target %s\n", hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);  // Arm builds NEON only
}

// The SIMD rotation of whole rows (the attention's query and output
// rotations) against HadamardRotation, to the bit, on every target.
TEST(SimdTargetsTest, RowRotationsMatchHadamardRotationOnEveryTarget) {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  for (int64_t bits = targets; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    for (const auto& [d, b] : {std::make_pair(64, 64), std::make_pair(128, 128), std::make_pair(192, 64),
                               std::make_pair(576, 64)}) {
      const HadamardRotation rotation(d, b, 1234);
      for (const bool inverse : {false, true}) {
        std::vector<float> expected = GaussianVectors(5, d, 3), got = expected;
        for (int r = 0; r < 5; ++r) {
          for (int block = 0; block < d / b; ++block) {
            float* v = expected.data() + r * d + block * b;
            inverse ? rotation.Inverse(block, v) : rotation.Forward(block, v);
          }
        }
        RotateRowsSimd(rotation, inverse, got.data(), 5);
        EXPECT_EQ(std::memcmp(expected.data(), got.data(), got.size() * sizeof(float)), 0)
            << hwy::TargetName(target) << " d=" << d << (inverse ? " inverse" : " forward");
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// DecodeValueAt, the per-coordinate decode the CUDA attention uses, agrees
// with the codecs: plain values equal, turbo values equal after the inverse
// rotation.
TEST(DecodeValueAtTest, MatchesTheCodecs) {
  for (CodecKind kind : testing::kAllCodecs) {
    for (int d : {64, 128, 576}) {
      const auto codec = Make(kind, d, CpuPath::kScalar, 21);
      const std::vector<float> x = GaussianVectors(3, d, 8);
      const Encoded e = RoundTrip(*codec, x);
      const float* centroids = LayoutCentroids(codec->layout());
      for (int v = 0; v < 3; ++v) {
        std::vector<float> row(d);
        for (int i = 0; i < d; ++i) {
          row[i] = DecodeValueAt(codec->layout(), e.codes.data() + v * codec->code_size(), i,
                                 centroids);
        }
        if (centroids) {
          const HadamardRotation rotation(d, codec->layout().block_values, 21);
          for (int b = 0; b < codec->layout().blocks; ++b) rotation.Inverse(b, row.data() + b * codec->layout().block_values);
        }
        EXPECT_EQ(std::memcmp(row.data(), e.decoded.data() + v * d, d * sizeof(float)), 0)
            << CodecName(kind) << " d=" << d;
      }
    }
  }
}

// TurboBlock128Dots (the CUDA key scoring) against dot products with the
// blocks DecodeValueAt decodes.
TEST(DecodeValueAtTest, Block128DotsMatchDecodedDots) {
  for (CodecKind kind : {CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4}) {
    const auto codec = Make(kind, 256, CpuPath::kScalar, 4);
    const std::vector<float> x = GaussianVectors(5, 256, 12);
    const std::vector<float> q = GaussianVectors(3, 256, 13);
    const Encoded e = RoundTrip(*codec, x);
    const Codebook* cb = FindCodebook(128, TurboBits(kind));
    for (int v = 0; v < 5; ++v) {
      const uint8_t* record = e.codes.data() + v * codec->code_size();
      float dot[4] = {};
      for (int b = 0; b < 2; ++b) {
        const uint8_t* block = record + b * codec->layout().block_bytes;
        switch (kind) {
          case CodecKind::kTurbo2: TurboBlock128Dots<2, 4>(block, q.data() + b * 128, 256, 3, cb->centroids, dot); break;
          case CodecKind::kTurbo3: TurboBlock128Dots<3, 4>(block, q.data() + b * 128, 256, 3, cb->centroids, dot); break;
          default: TurboBlock128Dots<4, 4>(block, q.data() + b * 128, 256, 3, cb->centroids, dot); break;
        }
      }
      for (int r = 0; r < 3; ++r) {
        double expected = 0;
        for (int i = 0; i < 256; ++i) {
          expected += double(q[r * 256 + i]) * DecodeValueAt(codec->layout(), record, i, cb->centroids);
        }
        EXPECT_NEAR(dot[r], expected, 1e-4 * (1 + std::fabs(expected))) << CodecName(kind);
      }
      EXPECT_EQ(dot[3], 0.0f);
    }
  }
}

// TurboBlock128LaneValues (the CUDA value decode) gives DecodeValueAt's values.
TEST(DecodeValueAtTest, LaneValuesMatch) {
  for (CodecKind kind : {CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4}) {
    const auto codec = Make(kind, 256, CpuPath::kScalar, 6);
    const std::vector<float> x = GaussianVectors(4, 256, 14);
    const Encoded e = RoundTrip(*codec, x);
    const Codebook* cb = FindCodebook(128, TurboBits(kind));
    for (int vec = 0; vec < 4; ++vec) {
      const uint8_t* record = e.codes.data() + vec * codec->code_size();
      for (int b = 0; b < 2; ++b) {
        for (int lane = 0; lane < 32; ++lane) {
          float v[4];
          TurboBlock128LaneValues(record + b * codec->layout().block_bytes, TurboBits(kind), lane, cb->centroids, v);
          for (int k = 0; k < 4; ++k) {
            const float expected = DecodeValueAt(codec->layout(), record, b * 128 + lane + 32 * k, cb->centroids);
            ASSERT_EQ(v[k], expected) << CodecName(kind) << " lane " << lane << " k " << k;
          }
        }
      }
    }
  }
}

// DESIGN.md section 1: relative MSE on 100,000 random unit vectors, d = 128.
TEST(FidelityTest, UnitVectorsMeetTheBars) {
  constexpr size_t kVectors = testing::kFidelityVectors;
  const std::vector<float> x = UnitVectors(kVectors, 128, 2024);
  for (const testing::FidelityBar& b : testing::kFidelityBars) {
    const auto codec = Make(b.kind, 128, CpuPath::kSimd, 5);
    const double mse = RelativeMse(x, RoundTrip(*codec, x).decoded);
    EXPECT_LE(mse, b.max_rel_mse) << CodecName(b.kind);
    // Not better than the Lloyd-Max error per coordinate allows, minus the
    // small gain of the MSE-optimal scale.
    EXPECT_GE(mse, 0.95 * FindCodebook(128, TurboBits(b.kind))->mse) << CodecName(b.kind);
  }
}

TEST(FidelityTest, Turbo4BeatsQ4OnOutlierKeys) {
  const std::vector<float> x = OutlierKeys(20000, 128, 31);
  const double turbo4 = RelativeMse(x, RoundTrip(*Make(CodecKind::kTurbo4, 128, CpuPath::kSimd), x).decoded);
  const double q4 = RelativeMse(x, RoundTrip(*Make(CodecKind::kQ4_0, 128, CpuPath::kSimd), x).decoded);
  EXPECT_LT(turbo4, q4);
  // The rotation keeps turbo4 at its unit-vector error level.
  EXPECT_LT(turbo4, 0.0094);
}

TEST(EdgeInputTest, ZeroVectorsDecodeToZero) {
  for (CodecKind kind : testing::kAllCodecs) {
    for (CpuPath path : {CpuPath::kScalar, CpuPath::kSimd}) {
      const auto codec = Make(kind, 192, path);
      const std::vector<float> x(3 * 192, 0.0f);
      const Encoded e = RoundTrip(*codec, x);
      for (float v : e.decoded) ASSERT_EQ(v, 0.0f) << CodecName(kind);
    }
  }
}

TEST(EdgeInputTest, MagnitudesAcrossTheFp16Range) {
  // Per-value magnitudes from 1e-3 to 1e3 (block norms up to about 1.1e4)
  // keep the codec's relative error.
  for (CodecKind kind : testing::kAllCodecs) {
    const auto codec = Make(kind, 128, CpuPath::kSimd);
    for (float magnitude : {1e-3f, 1e-1f, 1e1f, 1e3f}) {
      std::vector<float> x = GaussianVectors(200, 128, 3);
      for (float& v : x) v *= magnitude;
      const double mse = RelativeMse(x, RoundTrip(*codec, x).decoded);
      EXPECT_LT(mse, ExpectedMse(kind) * 1.5) << CodecName(kind) << " magnitude " << magnitude;
    }
  }
}

TEST(EdgeInputTest, OutOfRangeMagnitudesStayFinite) {
  // Beyond fp16's range the scale saturates and values below it flush toward
  // zero; the output is always finite and bounded by what the stored scales
  // allow (q8_0: 127 x the largest fp16 scale).
  for (CodecKind kind : testing::kAllCodecs) {
    for (CpuPath path : {CpuPath::kScalar, CpuPath::kSimd}) {
      const auto codec = Make(kind, 128, path);
      for (float magnitude : {1e-38f, 1e-30f, 1e-8f, 1e6f, 1e30f}) {
        std::vector<float> x = GaussianVectors(4, 128, 11);
        for (float& v : x) v *= magnitude;
        const Encoded e = RoundTrip(*codec, x);
        for (float v : e.decoded) {
          ASSERT_TRUE(std::isfinite(v)) << CodecName(kind) << " magnitude " << magnitude;
          ASSERT_LE(std::fabs(v), 127 * kHalfMax) << CodecName(kind);
        }
      }
    }
  }
}

}  // namespace
}  // namespace turbokv
