#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/paged_cache.h"
#include "kernels/vector_chunks.h"
#include "tests/kernels/codec_testing.h"
#include "tests/kernels/layer_testing.h"

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

// F16Dots (the CUDA scoring of f16 keys) against dot products with the
// values DecodeValueAt decodes.
TEST(DecodeValueAtTest, F16DotsMatchDecodedDots) {
  for (int d : {64, 128, 192}) {
    const auto codec = Make(CodecKind::kF16, d, CpuPath::kScalar);
    const Encoded e = RoundTrip(*codec, GaussianVectors(3, d, 16));
    const std::vector<float> q = GaussianVectors(3, d, 17);
    for (int v = 0; v < 3; ++v) {
      const uint8_t* record = e.codes.data() + v * codec->code_size();
      float dot[4] = {};
      F16Dots<4>(record, d, q.data(), d, 3, dot);
      for (int r = 0; r < 3; ++r) {
        double expected = 0;
        for (int i = 0; i < d; ++i) expected += double(q[r * d + i]) * DecodeValueAt(codec->layout(), record, i, nullptr);
        EXPECT_NEAR(dot[r], expected, 1e-5 * (1 + std::fabs(expected))) << d;
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

// PlainLaneValues128 (the CUDA value decode of f16, q8_0 and q4_0 at
// head_dim 128) gives DecodeValueAt's values.
TEST(DecodeValueAtTest, PlainLaneValuesMatch) {
  for (CodecKind kind : {CodecKind::kF16, CodecKind::kQ8_0, CodecKind::kQ4_0}) {
    const auto codec = Make(kind, 128, CpuPath::kScalar, 0);
    const std::vector<float> x = GaussianVectors(4, 128, 15);
    const Encoded e = RoundTrip(*codec, x);
    for (int vec = 0; vec < 4; ++vec) {
      const uint8_t* record = e.codes.data() + vec * codec->code_size();
      for (int lane = 0; lane < 32; ++lane) {
        float v[4];
        PlainLaneValues128(kind, record, lane, v);
        for (int k = 0; k < 4; ++k) {
          ASSERT_EQ(v[k], DecodeValueAt(codec->layout(), record, lane + 32 * k, nullptr))
              << CodecName(kind) << " lane " << lane << " k " << k;
        }
      }
    }
  }
}

// docs/ARCHITECTURE.md, "The method": relative MSE on 100,000 random unit vectors, d = 128.
// The addressing the CUDA codecs use for a batch of chunks (vector_chunks.h)
// finds the records PagedKvCache lays out: encoding each located vector with
// the CPU codec writes the pages EncodeChunkCpu writes.
TEST(VectorChunkTest, LocatedVectorsAreTheLayersRecords) {
  constexpr int kKvHeads = 3, kPage = 16, kDim = 64;
  // Two layers: tokens [5, 40) of one, [16, 17) of another; each encoded
  // by EncodeChunkCpu and, vector by vector, through the chunks.
  const int64_t first[] = {5, 16}, end[] = {40, 17};
  std::vector<std::unique_ptr<testing::HostLayer>> by_chunk, by_vector;
  std::vector<float> k[2], v[2];
  std::vector<VectorChunk> key_chunks, value_chunks;
  int64_t next = 0;
  for (int i = 0; i < 2; ++i) {
    k[i] = testing::GaussianVectors((end[i] - first[i]) * kKvHeads, kDim, 20 + i);
    v[i] = testing::GaussianVectors((end[i] - first[i]) * kKvHeads, kDim, 30 + i);
    for (auto* layers : {&by_chunk, &by_vector}) {
      layers->push_back(
          std::make_unique<testing::HostLayer>(CodecKind::kTurbo3, CodecKind::kQ8_0, kDim, kKvHeads, kPage, end[i], 11));
    }
    EncodeChunk chunk;
    chunk.key_codec = by_chunk[i]->keys.get();
    chunk.value_codec = by_chunk[i]->values.get();
    chunk.cache = by_chunk[i]->cache;
    chunk.first = first[i];
    chunk.keys = k[i].data();
    chunk.values = v[i].data();
    // The new pages zeroed on both sides, as the CPU backend gives them and
    // as a GPU encode's launch leaves them.
    by_chunk[i]->Zero(NewPages(chunk));
    by_vector[i]->Zero(NewPages(chunk));
    EncodeChunkCpu(chunk, nullptr);
    // The table from the chunk's first page on, as a GPU encode stages it.
    const int64_t first_page = first[i] / kPage;
    const uint8_t* const* table = by_vector[i]->table.data() + first_page;
    key_chunks.push_back(
        MakeVectorChunk(by_vector[i]->cache, false, first[i], end[i] - first[i], k[i].data(), next, table, first_page));
    value_chunks.push_back(
        MakeVectorChunk(by_vector[i]->cache, true, first[i], end[i] - first[i], v[i].data(), next, table, first_page));
    next += (end[i] - first[i]) * kKvHeads;
  }
  for (int64_t x = 0; x < next; ++x) {
    const ChunkVector key = LocateChunkVector(key_chunks.data(), 2, x, kDim);
    const ChunkVector value = LocateChunkVector(value_chunks.data(), 2, x, kDim);
    EXPECT_EQ(key.seed, 11u);
    EXPECT_EQ(value.seed, 12u);
    by_vector[0]->keys->Encode(1, key.x, key.record);  // every layer's codecs have the same specs
    by_vector[0]->values->Encode(1, value.x, value.record);
  }
  for (int i = 0; i < 2; ++i) EXPECT_EQ(by_vector[i]->pages, by_chunk[i]->pages) << "layer " << i;
}

// The same addressing in the token-group order (a GPU's native order,
// kernels/page_layout.h): each located vector's record, encoded by the CPU
// codec and written field by field where ChunkVector::Field says, gives the
// pages EncodeChunkCpu's canonical pages translate to, for every codec.
TEST(VectorChunkTest, LocatedFieldsAreTheTokenGroupsRecords) {
  constexpr int kKvHeads = 2, kPage = 32, kDim = 128;
  constexpr int64_t kTokens = 70;
  for (CodecKind kind : {CodecKind::kF16, CodecKind::kQ8_0, CodecKind::kQ4_0, CodecKind::kTurbo2, CodecKind::kTurbo3,
                         CodecKind::kTurbo4}) {
    testing::HostLayer canonical(kind, kind, kDim, kKvHeads, kPage, kTokens, 7);
    testing::HostLayer grouped(kind, kind, kDim, kKvHeads, kPage, kTokens, 7);
    grouped.cache.order = PageOrder::kTokenGroups;
    const std::vector<float> k = testing::GaussianVectors(kTokens * kKvHeads, kDim, 40);
    const std::vector<float> v = testing::GaussianVectors(kTokens * kKvHeads, kDim, 41);
    EncodeChunk chunk;
    chunk.key_codec = canonical.keys.get();
    chunk.value_codec = canonical.values.get();
    chunk.cache = canonical.cache;
    chunk.keys = k.data();
    chunk.values = v.data();
    canonical.Zero(NewPages(chunk));
    grouped.Zero(NewPages(chunk));
    EncodeChunkCpu(chunk, nullptr);
    const VectorChunk keys = MakeVectorChunk(grouped.cache, false, 0, kTokens, const_cast<float*>(k.data()), 0);
    const VectorChunk values = MakeVectorChunk(grouped.cache, true, 0, kTokens, const_cast<float*>(v.data()), 0);
    const CodecLayout layout = canonical.keys->layout();
    std::vector<uint8_t> record(layout.code_size());
    for (int64_t x = 0; x < kTokens * kKvHeads; ++x) {
      for (const auto& [chunks, codec] : {std::make_pair(&keys, canonical.keys.get()),
                                          std::make_pair(&values, canonical.values.get())}) {
        const ChunkVector vector = LocateChunkVector(chunks, 1, x, kDim);
        ASSERT_GE(vector.slot, 0);
        codec->Encode(1, vector.x, record.data());
        for (int byte = 0; byte < static_cast<int>(record.size());) {
          const RecordField f = FieldOf(layout, byte);
          std::copy_n(record.data() + f.offset, f.bytes, vector.Field(f.offset, f.bytes));
          byte += f.bytes;
        }
      }
    }
    for (size_t p = 0; p < canonical.pages.size(); ++p) {
      std::vector<uint8_t> expected(canonical.pages[p].size());
      PageToOrder(grouped.cache.format(), canonical.pages[p].data(), expected.data());
      EXPECT_EQ(grouped.pages[p], expected) << CodecName(kind) << " page " << p;
    }
  }
}

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

// --- EncodeStats: the error the encoder reports, against decoding ----------

// Calls f() with dispatch restricted to each SIMD target this CPU has.
template <class F>
void ForEachSimdTarget(F&& f) {
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    hwy::SetSupportedTargetsForTest(bits & -bits);
    f(hwy::TargetName(bits & -bits));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// e = ||x - x_hat|| / ||x|| of each vector, x_hat decoded from `codes`, in
// double; NaN for a zero vector.
std::vector<double> DecodedErrors(const Codec& codec, const std::vector<float>& x,
                                  const std::vector<uint8_t>& codes) {
  const int d = codec.layout().head_dim;
  const size_t n = x.size() / d;
  std::vector<float> y(x.size());
  codec.Decode(n, codes.data(), y.data());
  std::vector<double> e(n);
  for (size_t v = 0; v < n; ++v) {
    double err = 0, norm = 0;
    for (int i = 0; i < d; ++i) {
      const double r = double(x[v * d + i]) - y[v * d + i];
      err += r * r;
      norm += double(x[v * d + i]) * x[v * d + i];
    }
    e[v] = norm > 0 ? std::sqrt(err / norm) : std::nan("");
  }
  return e;
}

// How far the encoder's e^2 may be from the decoded one. Turbo: e^2 ||x||^2 B
// is ||z||^2 - 2 s <z, c> + s^2 ||c||^2 from three float sums of B
// nonnegative terms (z_i c_i >= 0: c has the sign of z_i), each within
// 12 * 2^-24 = 7.2e-7 of its value (8 terms a partial, then 4 levels of the
// tree), with s <z, c> and s^2 ||c||^2 both at most about ||z||^2: 4 x 7.2e-7
// = 2.9e-6 of ||z||^2; the float rotation of x (encode) and of s c (decode)
// adds about 2 x 7 x 2^-24 = 8e-7: 5e-6 in e^2. The others compute the
// decoded residual itself (q * d and fp16 values are exact in float) and
// differ only in the order of float sums of at most 576 squares (the f16
// SIMD lanes): 576 * 2^-24 = 3.4e-5 of e^2, 1e-4 with margin.
double ErrorSqTolerance(CodecKind kind, double e_sq) { return TurboBits(kind) ? 5e-6 : 1e-4 * e_sq; }

void ExpectSameCounts(const EncodeStats& a, const EncodeStats& b, const std::string& what) {
  EXPECT_EQ(a.vectors, b.vectors) << what;
  EXPECT_EQ(a.zero_vectors, b.zero_vectors) << what;
  for (int k = 0; k < kEncodeErrorBuckets; ++k) EXPECT_EQ(a.histogram[k], b.histogram[k]) << what << " bucket " << k;
  EXPECT_EQ(a.fp16_fields, b.fp16_fields) << what;
  EXPECT_EQ(a.saturated, b.saturated) << what;
  EXPECT_EQ(a.underflowed, b.underflowed) << what;
}

// Encodes x all at once and one vector at a time, with and without stats:
// the bytes never change, each vector's e and bucket match its decoded error,
// and the batch's stats are the per-vector stats merged with Add. Returns the
// batch's stats and, in `per_vector`, each vector's.
EncodeStats CheckStatsAgainstDecoding(const Codec& codec, const std::vector<float>& x, const std::string& what,
                                      std::vector<EncodeStats>* per_vector = nullptr) {
  const CodecKind kind = codec.spec().kind;
  const int d = codec.layout().head_dim;
  const size_t n = x.size() / d;
  const size_t size = codec.code_size();
  std::vector<uint8_t> plain(n * size), with_stats(n * size, 0x5a), one_code(size);
  codec.Encode(n, x.data(), plain.data());
  EncodeStats batch;
  codec.Encode(n, x.data(), with_stats.data(), &batch);
  EXPECT_EQ(plain, with_stats) << what;
  const std::vector<double> decoded = DecodedErrors(codec, x, plain);
  EncodeStats merged;
  for (size_t v = 0; v < n; ++v) {
    EncodeStats one;
    codec.Encode(1, x.data() + v * d, one_code.data(), &one);
    EXPECT_EQ(std::memcmp(one_code.data(), plain.data() + v * size, size), 0) << what << " vector " << v;
    if (std::isnan(decoded[v])) {
      EXPECT_EQ(one.zero_vectors, 1u) << what << " vector " << v;
      EXPECT_EQ(one.vectors, 0u) << what << " vector " << v;
    } else {
      EXPECT_EQ(one.vectors, 1u) << what << " vector " << v;
      const double e = one.error_sum;
      const double e_sq = decoded[v] * decoded[v];
      const double tolerance = ErrorSqTolerance(kind, e_sq);
      EXPECT_NEAR(e * e, e_sq, tolerance) << what << " vector " << v << " decoded e " << decoded[v];
      // Its bucket is the decoded error's; within the tolerance of a bound
      // (no such vector in these inputs so far) either side is right.
      const int low = EncodeErrorBucket(std::sqrt(std::max(0.0, e_sq - tolerance)));
      const int high = EncodeErrorBucket(std::sqrt(e_sq + tolerance));
      int bucket = -1;
      for (int k = 0; k < kEncodeErrorBuckets; ++k) {
        if (one.histogram[k] == 1) bucket = k;
      }
      EXPECT_GE(bucket, low) << what << " vector " << v << " e " << e;
      EXPECT_LE(bucket, high) << what << " vector " << v << " e " << e;
    }
    merged.Add(one);
    if (per_vector) per_vector->push_back(one);
  }
  ExpectSameCounts(batch, merged, what + " batch against merged");
  EXPECT_EQ(batch.error_sum, merged.error_sum) << what;
  return batch;
}

// Gaussian vectors at magnitudes from 1e-3 (f16's small values go subnormal)
// to 1e3, and one zero vector.
std::vector<float> StatsInputs(int d, uint64_t seed) {
  constexpr int kVectors = 17;
  std::vector<float> x = GaussianVectors(kVectors, d, seed);
  const float magnitudes[] = {1.0f, 1e-3f, 1e3f, 0.1f, 10.0f};
  for (int v = 0; v < kVectors; ++v) {
    for (int i = 0; i < d; ++i) x[v * d + i] *= magnitudes[v % 5];
  }
  x.resize(x.size() + d, 0.0f);
  return x;
}

TEST(EncodeStatsTest, ErrorMatchesDecodingOnEveryPathAndTarget) {
  for (CodecKind kind : testing::kAllCodecs) {
    for (int d : {64, 128, 256, 576}) {
      const std::string name = std::string(CodecName(kind)) + " d=" + std::to_string(d);
      const std::vector<float> x = StatsInputs(d, 500 + d);
      const EncodeStats scalar = CheckStatsAgainstDecoding(*Make(kind, d, CpuPath::kScalar), x, name + " scalar");
      EXPECT_EQ(scalar.vectors + scalar.zero_vectors, x.size() / d);
      EXPECT_EQ(scalar.zero_vectors, 1u);
      ForEachSimdTarget([&](const char* target) {
        const std::string what = name + " " + target;
        const EncodeStats simd = CheckStatsAgainstDecoding(*Make(kind, d, CpuPath::kSimd), x, what);
        ExpectSameCounts(simd, scalar, what + " against scalar");
        if (kind == CodecKind::kF16) {
          // Float lane sums on F16C targets: see ErrorSqTolerance.
          EXPECT_NEAR(simd.error_sum, scalar.error_sum, 1e-4 * scalar.error_sum) << what;
        } else {
          // The same float operations in the same order as the scalar code.
          EXPECT_EQ(simd.error_sum, scalar.error_sum) << what;
        }
      });
    }
  }
}

TEST(EncodeStatsTest, CountsSaturatedAndUnderflowedScales) {
  // Vectors of +-a: every block has the same fp16 scale magnitude (turbo:
  // about a * sqrt(B); q8_0: a / 127; q4_0: a / 8; f16: every value is a).
  // 1e9 saturates every scale and value; 1e-6 makes every one a nonzero fp16
  // subnormal or flushes it to zero; 1e-9 flushes all; 1e30 also overflows
  // the float sum of squares (e counts as 1); a zero vector counts its fields
  // but none saturates or underflows.
  struct Case {
    float a;
    bool saturated, underflowed;
  } cases[] = {{1.0f, false, false}, {1e9f, true, false}, {1e-6f, false, true},
               {1e-9f, false, true}, {1e30f, true, false}, {0.0f, false, false}};
  const int d = 128;
  std::vector<float> x;
  const std::vector<float> signs = GaussianVectors(1, d, 3);
  for (const Case& c : cases) {
    for (int i = 0; i < d; ++i) x.push_back(signs[i] < 0 ? -c.a : c.a);
  }
  for (CodecKind kind : testing::kAllCodecs) {
    auto check = [&](const Codec& codec, const std::string& what) {
      std::vector<EncodeStats> per_vector;
      CheckStatsAgainstDecoding(codec, x, what, &per_vector);
      const uint64_t fields = kind == CodecKind::kF16 ? d : codec.layout().blocks;
      for (size_t v = 0; v < per_vector.size(); ++v) {
        const std::string which = what + " a=" + std::to_string(cases[v].a);
        EXPECT_EQ(per_vector[v].fp16_fields, fields) << which;
        EXPECT_EQ(per_vector[v].saturated, cases[v].saturated ? fields : 0) << which;
        EXPECT_EQ(per_vector[v].underflowed, cases[v].underflowed ? fields : 0) << which;
      }
      EXPECT_EQ(per_vector[4].error_sum, 1.0) << what;  // the float overflow rule
      EXPECT_EQ(per_vector[5].zero_vectors, 1u) << what;
    };
    check(*Make(kind, d, CpuPath::kScalar), std::string(CodecName(kind)) + " scalar");
    ForEachSimdTarget([&](const char* target) {
      check(*Make(kind, d, CpuPath::kSimd), std::string(CodecName(kind)) + " " + target);
    });
  }
}

// kEncodeErrorBounds' claim: on Gaussian data each codec fills buckets of
// its own (q4_0 and turbo4 share theirs).
TEST(EncodeStatsTest, BucketsSeparateTheCodecsOnGaussianData) {
  struct Case {
    CodecKind kind;
    double low, high;  // the codec's range of e
    double share;      // the least fraction of vectors in it
  } cases[] = {
      {CodecKind::kF16, 0, 0.0005, 1.0},        {CodecKind::kQ8_0, 0.002, 0.01, 1.0},
      {CodecKind::kQ4_0, 0.06, 0.14, 0.99},     {CodecKind::kTurbo4, 0.06, 0.14, 0.99},
      {CodecKind::kTurbo3, 0.14, 0.25, 0.99},   {CodecKind::kTurbo2, 0.25, 0.5, 0.99},
  };
  const std::vector<float> x = GaussianVectors(2000, 128, 99);
  for (const Case& c : cases) {
    const auto codec = Make(c.kind, 128, CpuPath::kSimd);
    std::vector<uint8_t> codes(2000 * codec->code_size());
    EncodeStats stats;
    codec->Encode(2000, x.data(), codes.data(), &stats);
    uint64_t inside = 0;
    for (int k = EncodeErrorBucket(c.low) + (c.low > 0 ? 1 : 0); k <= EncodeErrorBucket(c.high); ++k) {
      inside += stats.histogram[k];
    }
    EXPECT_GE(inside, c.share * stats.vectors) << CodecName(c.kind);
    EXPECT_EQ(stats.saturated, 0u) << CodecName(c.kind);
    // f16 stores the few values below 2^-14 as subnormals; the scales of the
    // other codecs are all normal.
    if (c.kind != CodecKind::kF16) {
      EXPECT_EQ(stats.underflowed, 0u) << CodecName(c.kind);
    }
    std::printf("%-6s mean e %.5f, %.2f%% in (%g, %g]\n", CodecName(c.kind), stats.mean_error(),
                100.0 * inside / stats.vectors, c.low, c.high);
  }
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
