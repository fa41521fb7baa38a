#include "kernels/attention.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/kernels/layer_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::DecodedThroughCodec;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::OutlierKeys;
using ::turbokv::testing::ReferenceAttention;
using ::turbokv::testing::ReferenceResult;
using ::turbokv::testing::RelativeL2;

constexpr int kPage = 64;

struct Problem {
  CodecSpec key_spec, value_spec;
  int kv_heads = 2;
  AttentionParams params;
  std::vector<float> keys, values, q;  // originals
  std::vector<int64_t> positions;
  std::unique_ptr<PagedCacheBuffer> cache;
  int64_t first_token = 0;     // the cache's first attended token
  std::vector<float> offsets;  // [n][q_heads] logit offsets, or empty
};

Problem MakeProblem(CodecKind k, CodecKind v, int d, int kv_heads, int group, int64_t tokens,
                    int64_t n_queries, float q_gain = 2.0f, std::vector<float> keys = {}) {
  Problem p;
  p.key_spec = CodecSpec{k, d, 0x1111};
  p.value_spec = CodecSpec{v, d, 0x2222};
  p.kv_heads = kv_heads;
  p.params.q_heads = kv_heads * group;
  p.keys = keys.empty() ? GaussianVectors(tokens * kv_heads, d, 10 + d + tokens) : std::move(keys);
  p.values = GaussianVectors(tokens * kv_heads, d, 20 + d + tokens);
  p.q = GaussianVectors(n_queries * p.params.q_heads, d, 30 + d + tokens);
  for (float& x : p.q) x *= q_gain;
  for (int64_t i = 0; i < n_queries; ++i) {
    p.positions.push_back(i == 0 ? tokens - 1 : (tokens - 1) * (n_queries - i) / n_queries);
  }
  auto cache = PagedCacheBuffer::Create(p.key_spec, p.value_spec, kv_heads, kPage);
  EXPECT_TRUE(cache.ok()) << cache.status();
  p.cache = *std::move(cache);
  p.cache->Append(tokens, p.keys.data(), p.values.data());
  return p;
}

struct Result {
  std::vector<float> out, lse;
  std::vector<int64_t> top_tokens;
  std::vector<float> top_logits;
};

Result Attend(const Problem& p, const AttentionOptions& options) {
  const int d = p.key_spec.head_dim;
  const size_t rows = p.positions.size() * p.params.q_heads;
  Result r;
  r.out.assign(rows * d, std::nanf(""));
  r.lse.assign(rows, std::nanf(""));
  r.top_tokens.assign(rows * std::max(p.params.top_k, 0), -7);
  r.top_logits.assign(rows * std::max(p.params.top_k, 0), std::nanf(""));
  const AttentionQueries queries{static_cast<int64_t>(p.positions.size()), p.q.data(), p.positions.data(),
                                 p.offsets.empty() ? nullptr : p.offsets.data()};
  const AttentionOutput output{r.out.data(), r.lse.data(), r.top_tokens.data(), r.top_logits.data()};
  PagedKvCache cache = p.cache->descriptor();
  cache.first_token = p.first_token;
  const absl::Status s = AttendCpu(cache, p.params, queries, output, options);
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

// The reference over what the cache stores (decoded keys and values).
ReferenceResult DecodedReference(const Problem& p) {
  return ReferenceAttention(DecodedThroughCodec(p.key_spec, p.keys),
                            DecodedThroughCodec(p.value_spec, p.values), p.kv_heads,
                            p.key_spec.head_dim, p.q, p.positions, p.params, p.first_token, p.offsets);
}

// How close a path must come to the double-precision reference: float
// paths to rounding, the integer path (int16 centroids, queries and weights)
// to about 1e-4 relative.
struct Tolerance {
  double out;    // relative L2 of all outputs
  double logit;  // logits and log-sum-exp, relative to max(1, |x|)
};
constexpr Tolerance kFloat{2e-5, 1e-4};
constexpr Tolerance kInteger{5e-4, 1e-3};

void ExpectMatchesReference(const Result& r, const ReferenceResult& ref, const std::string& what,
                            Tolerance tol = kFloat) {
  EXPECT_LT(RelativeL2(r.out, ref.out), tol.out) << what;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {  // the query sees no token
      ASSERT_EQ(r.lse[i], ref.lse[i]) << what << " row " << i;
      continue;
    }
    ASSERT_NEAR(r.lse[i], ref.lse[i], tol.logit * std::max(1.0, std::fabs(ref.lse[i])))
        << what << " row " << i;
  }
}

// Every path: scalar, SIMD float, SIMD with integer dot products.
void ExpectAllPathsMatch(const Problem& p, const ReferenceResult& ref, const std::string& what) {
  ExpectMatchesReference(Attend(p, {AttentionPath::kScalar}), ref, what + " scalar");
  AttentionOptions simd_float{AttentionPath::kSimd};
  simd_float.integer_dot_products = false;
  ExpectMatchesReference(Attend(p, simd_float), ref, what + " simd float");
  ExpectMatchesReference(Attend(p, {AttentionPath::kSimd}), ref, what + " simd", kInteger);
}

class AttentionTest
    : public ::testing::TestWithParam<std::tuple<std::pair<CodecKind, CodecKind>, int, int>> {};

TEST_P(AttentionTest, ScalarAndSimdMatchTheFloatReference) {
  const auto [codecs, d, group] = GetParam();
  for (int64_t tokens : {int64_t{1}, int64_t{kPage - 1}, int64_t{kPage + 1}, int64_t{10000}}) {
    const Problem p = MakeProblem(codecs.first, codecs.second, d, 2, group, tokens, 3);
    const ReferenceResult ref = DecodedReference(p);
    const std::string what = std::string(CodecName(codecs.first)) + "/" + CodecName(codecs.second) +
                             " d=" + std::to_string(d) + " group=" + std::to_string(group) +
                             " tokens=" + std::to_string(tokens);
    ExpectAllPathsMatch(p, ref, what);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Combine(
        ::testing::Values(std::make_pair(CodecKind::kTurbo3, CodecKind::kTurbo3),
                          std::make_pair(CodecKind::kTurbo2, CodecKind::kTurbo4),
                          std::make_pair(CodecKind::kF16, CodecKind::kF16),
                          std::make_pair(CodecKind::kQ8_0, CodecKind::kQ4_0),
                          std::make_pair(CodecKind::kTurbo4, CodecKind::kF16),
                          std::make_pair(CodecKind::kQ8_0, CodecKind::kTurbo4),
                          std::make_pair(CodecKind::kF16, CodecKind::kTurbo3)),
        ::testing::Values(64, 128, 256), ::testing::Values(1, 4, 8)),
    [](const auto& info) {
      const auto& codecs = std::get<0>(info.param);
      return std::string(CodecName(codecs.first)) + "_" + CodecName(codecs.second) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_g" + std::to_string(std::get<2>(info.param));
    });

TEST(AttentionFeaturesTest, WindowSoftcapAndCausalPositions) {
  Problem p = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, 1000, 5, 6.0f);
  p.params.window = 100;
  p.params.softcap = 5.0f;
  p.params.softmax_scale = 0.2f;
  p.positions = {999, 500, 120, 99, 0};
  const ReferenceResult ref = DecodedReference(p);
  ExpectAllPathsMatch(p, ref, "window+softcap");
  // The window really limits what a query sees: without it the result differs.
  Problem full = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, 1000, 5, 6.0f);
  full.params.softcap = 5.0f;
  full.params.softmax_scale = 0.2f;
  full.positions = p.positions;
  EXPECT_GT(RelativeL2(Attend(full, {}).out, ref.out), 0.05);
}

TEST(AttentionFeaturesTest, TopKMatchesTheReference) {
  Problem p = MakeProblem(CodecKind::kTurbo4, CodecKind::kTurbo3, 128, 2, 4, 3000, 2);
  p.params.top_k = 8;
  const ReferenceResult ref = DecodedReference(p);
  AttentionOptions simd_float{AttentionPath::kSimd};
  simd_float.integer_dot_products = false;
  const std::pair<AttentionOptions, Tolerance> paths[] = {
      {{AttentionPath::kScalar}, kFloat}, {simd_float, kFloat}, {{AttentionPath::kSimd}, kInteger}};
  for (const auto& [options, tol] : paths) {
    const Result r = Attend(p, options);
    for (size_t row = 0; row < ref.logits.size(); ++row) {
      for (int k = 0; k < p.params.top_k; ++k) {
        const auto& [logit, token] = ref.logits[row][k];
        const double slack = tol.logit * std::max(1.0, std::fabs(logit));
        EXPECT_NEAR(r.top_logits[row * 8 + k], logit, slack) << "row " << row << " rank " << k;
        // Tokens agree unless two logits are within that tolerance of each other.
        if (ref.logits[row][k].first - ref.logits[row][k + 1].first > 2 * slack &&
            (k == 0 || ref.logits[row][k - 1].first - logit > 2 * slack)) {
          EXPECT_EQ(r.top_tokens[row * 8 + k], token) << "row " << row << " rank " << k;
        }
      }
    }
  }
  // Fewer visible tokens than k: the rest is padding.
  Problem small = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 64, 1, 1, 3, 1);
  small.params.top_k = 5;
  const Result r = Attend(small, {});
  EXPECT_EQ(r.top_tokens[3], -1);
  EXPECT_EQ(r.top_logits[4], -INFINITY);
  EXPECT_GE(r.top_tokens[2], 0);
}

// Tokens before the cache's first_token are masked (a query before it sees
// nothing: zeros, lse -inf, top-k padding), a query past the stored tokens
// sees up to the last, and logit offsets shift each row before the softcap.
TEST(AttentionFeaturesTest, FirstTokenPositionsPastTheEndAndLogitOffsets) {
  for (float softcap : {0.0f, 5.0f}) {
    Problem p = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 300, 4, 6.0f);
    p.params.softcap = softcap;
    p.params.top_k = 3;
    p.first_token = 20;
    p.positions = {299, 400, 10, 150};
    p.offsets = GaussianVectors(1, 4 * p.params.q_heads, 99);
    for (float& x : p.offsets) x *= 3.0f;
    const ReferenceResult ref = DecodedReference(p);
    const std::string what = "softcap " + std::to_string(softcap);
    ExpectAllPathsMatch(p, ref, what);
    const Result r = Attend(p, {});
    const size_t row = 2 * p.params.q_heads;  // the query at 10, before the first token
    EXPECT_EQ(r.lse[row], -INFINITY) << what;
    EXPECT_EQ(r.out[row * 128], 0.0f) << what;
    EXPECT_EQ(r.top_tokens[row * 3], -1) << what;
    for (int64_t token : r.top_tokens) EXPECT_TRUE(token == -1 || token >= 20) << what;
    // The offsets are really applied: without them the log-sum-exps move.
    Problem plain = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 300, 4, 6.0f);
    plain.params = p.params;
    plain.first_token = p.first_token;
    plain.positions = p.positions;
    EXPECT_GT(std::fabs(Attend(plain, {}).lse[0] - r.lse[0]), 0.1) << what;
  }
}

// More queries than one pass holds (a long prefill): causal positions over the
// whole cache, split into passes inside AttendCpu.
TEST(AttentionFeaturesTest, ManyQueriesRunInPasses) {
  Problem p = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 500, 75);
  for (int64_t i = 0; i < 75; ++i) p.positions[i] = 425 + i;
  ExpectAllPathsMatch(p, DecodedReference(p), "75 queries");
}

// A head dimension of nine rotation blocks of 64 (MLA-style 576), one kv head
// shared by 16 query heads.
TEST(AttentionFeaturesTest, HeadDim576WithSixteenQueryHeads) {
  const Problem p = MakeProblem(CodecKind::kTurbo4, CodecKind::kTurbo3, 576, 1, 16, 700, 2);
  ExpectAllPathsMatch(p, DecodedReference(p), "d=576 group=16");
}

// Every SIMD target compiled in and supported here against the scalar path:
// every codec on the integer scan, rotation blocks of 128 and 64, records of
// several blocks (d = 576: nine of 64), softcap and window.
TEST(AttentionTargetsTest, EveryTargetMatchesTheScalarPath) {
  std::vector<Problem> problems;
  problems.push_back(MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kF16, CodecKind::kQ8_0, 64, 2, 4, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kQ8_0, CodecKind::kTurbo4, 128, 2, 4, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kQ4_0, CodecKind::kTurbo3, 64, 2, 3, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kTurbo2, CodecKind::kTurbo3, 576, 1, 5, 130, 1));
  problems.push_back(MakeProblem(CodecKind::kTurbo3, CodecKind::kF16, 256, 1, 2, 200, 1));
  Problem capped = MakeProblem(CodecKind::kTurbo4, CodecKind::kTurbo2, 128, 2, 4, 300, 2, 6.0f);
  capped.params.softcap = 5.0f;
  capped.params.window = 50;
  capped.first_token = 7;
  capped.offsets = GaussianVectors(1, 2 * capped.params.q_heads, 98);
  problems.push_back(std::move(capped));
  // Queries that agree with a stored key: the integer dot products of key
  // and query add up coherently (they overflowed int32 on AVX3_DL).
  Problem agree = MakeProblem(CodecKind::kTurbo4, CodecKind::kTurbo4, 128, 2, 4, 300, 2);
  for (size_t row = 0; row < agree.q.size() / 128; ++row) {
    const size_t kv_head = row % agree.params.q_heads / 4;
    const float* key = agree.keys.data() + (100 * 2 + kv_head) * 128;
    for (size_t c = 0; c < 128; ++c) agree.q[row * 128 + c] = 0.3f * key[c];
  }
  problems.push_back(std::move(agree));
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  int tested = 0;
  for (int64_t bits = targets; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    for (const Problem& problem : problems) {
      const std::string what = std::string(hwy::TargetName(target)) + " " + CodecName(problem.key_spec.kind) +
                               "/" + CodecName(problem.value_spec.kind) + " d=" +
                               std::to_string(problem.key_spec.head_dim);
      const Result scalar = Attend(problem, {AttentionPath::kScalar});
      AttentionOptions simd_float{AttentionPath::kSimd};
      simd_float.integer_dot_products = false;
      const Result float_path = Attend(problem, simd_float);
      const Result integer_path = Attend(problem, {AttentionPath::kSimd});
      EXPECT_LT(RelativeL2(float_path.out, scalar.out), 2e-5) << what;
      EXPECT_LT(RelativeL2(integer_path.out, scalar.out), 5e-4) << what;
      for (size_t i = 0; i < scalar.lse.size(); ++i) {
        EXPECT_NEAR(integer_path.lse[i], scalar.lse[i], 1e-3 * std::max(1.0f, std::fabs(scalar.lse[i]))) << what;
      }
      // The integer scan really ran (it rounds differently from the float
      // scan), except where there is none: SCALAR, and f16 on both sides.
      if (target != HWY_SCALAR && problem.key_spec.kind != CodecKind::kF16) {
        EXPECT_GT(RelativeL2(integer_path.out, float_path.out), 0.0) << what;
      }
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  // x86 compiles several targets (SSSE3 at least beside the best); Arm builds
  // NEON only (kernels/CMakeLists.txt).
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

// On AVX3_DL, codec pairs without f16 other than turbo keys with turbo values
// take the 256-bit integer scan that AVX3 runs: the same bits, whatever each
// target's instructions (a 256-bit vpdpwssd there measured no faster).
TEST(AttentionTargetsTest, Avx3DlsIntegerScanGivesAvx3sBits) {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  if ((targets & HWY_AVX3_DL) == 0 || (targets & HWY_AVX3) == 0) GTEST_SKIP() << "this CPU has no AVX3_DL";
  std::vector<Problem> problems;
  problems.push_back(MakeProblem(CodecKind::kQ8_0, CodecKind::kTurbo4, 128, 2, 4, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kQ4_0, CodecKind::kTurbo3, 64, 2, 3, 300, 2));
  problems.push_back(MakeProblem(CodecKind::kTurbo3, CodecKind::kQ8_0, 128, 1, 4, 200, 1));
  for (const Problem& problem : problems) {
    hwy::SetSupportedTargetsForTest(HWY_AVX3);
    const Result avx3 = Attend(problem, {AttentionPath::kSimd});
    hwy::SetSupportedTargetsForTest(HWY_AVX3_DL);
    const Result avx3_dl = Attend(problem, {AttentionPath::kSimd});
    const std::string what =
        std::string(CodecName(problem.key_spec.kind)) + "/" + CodecName(problem.value_spec.kind);
    EXPECT_EQ(avx3_dl.out, avx3.out) << what;
    EXPECT_EQ(avx3_dl.lse, avx3.lse) << what;
  }
  hwy::SetSupportedTargetsForTest(0);
}

// turbokv-bench attend's floor runs the multiply-add step of the path the
// scan takes for the codecs on every target, and counts the products by what
// one step does: 32 for AVX3_DL's 512-bit VNNI (turbo keys and values), 16
// for 256-bit vectors, 8 for 128-bit ones; none where the scan multiplies
// floats (SCALAR, f16).
TEST(AttentionTargetsTest, MultiplyAddPeakRunsTheScansStep) {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  for (int64_t bits = targets; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    int turbo = -1, mixed = -1, f16 = -1, unused;
    const int64_t none = MultiplyAddPeak(CodecKind::kTurbo3, CodecKind::kTurbo4, 0, &turbo);
    const int64_t some = MultiplyAddPeak(CodecKind::kTurbo3, CodecKind::kTurbo4, 1000, &unused);
    const int64_t more = MultiplyAddPeak(CodecKind::kTurbo3, CodecKind::kTurbo4, 2000, &unused);
    MultiplyAddPeak(CodecKind::kQ8_0, CodecKind::kTurbo4, 0, &mixed);
    MultiplyAddPeak(CodecKind::kF16, CodecKind::kTurbo4, 0, &f16);
    EXPECT_EQ(f16, 0) << name;
    if (target == HWY_SCALAR) {
      EXPECT_EQ(turbo, 0);
      EXPECT_EQ(mixed, 0);
      continue;
    }
    const bool narrow = name == "SSSE3" || name == "SSE4" || name == "NEON" || name == "EMU128";  // 128 bits
    const int lanes = narrow ? 8 : 16;
    EXPECT_EQ(turbo, target == HWY_AVX3_DL ? 32 : lanes) << name;
    EXPECT_EQ(mixed, lanes) << name;
    // The products ran, as many times as asked.
    EXPECT_NE(some, none) << name;
    EXPECT_NE(more, some) << name;
    EXPECT_EQ(MultiplyAddPeak(CodecKind::kTurbo3, CodecKind::kTurbo4, 1000, &unused), some) << name;
  }
  hwy::SetSupportedTargetsForTest(0);
}

// What the integer scan adds to a codec's own error, at every softmax scale
// from 0.01 to one that makes the softmax one-hot (100: logits of about
// +-1,000), with and without a softcap: its output's distance from the float
// reference over the decoded data is at most 2% of the codec's own distance
// (that reference over the decoded data against it over the originals). A
// bound in absolute terms would not hold: the scan's error grows with the
// logits' range (3e-3 relative L2 at scale 10 with turbo4), and so does the
// codec's. Measured on every x86 target at 0.13% to 0.54%.
TEST(AttentionFeaturesTest, TheIntegerScanAddsLittleToTheCodecsError) {
  const std::vector<std::pair<CodecKind, CodecKind>> codecs = {{CodecKind::kTurbo3, CodecKind::kTurbo3},
                                                               {CodecKind::kTurbo4, CodecKind::kTurbo4},
                                                               {CodecKind::kQ8_0, CodecKind::kTurbo4},
                                                               {CodecKind::kTurbo2, CodecKind::kTurbo2}};
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  int tested = 0;
  for (int64_t bits = targets; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    if (target == HWY_SCALAR) continue;  // no integer scan there
    hwy::SetSupportedTargetsForTest(target);
    for (const auto& [k, v] : codecs) {
      Problem p = MakeProblem(k, v, 128, 2, 4, 600, 2, 1.0f);
      for (float softcap : {0.0f, 5.0f, 50.0f}) {
        for (float scale : {0.01f, 0.03f, 0.1f, 0.3f, 1.0f, 3.0f, 10.0f, 100.0f}) {
          p.params.softmax_scale = scale;
          p.params.softcap = softcap;
          const ReferenceResult decoded = DecodedReference(p);
          const ReferenceResult original =
              ReferenceAttention(p.keys, p.values, p.kv_heads, 128, p.q, p.positions, p.params);
          const double scan = RelativeL2(Attend(p, {AttentionPath::kSimd}).out, decoded.out);
          const double codec = RelativeL2(decoded.out, original.out);
          EXPECT_LE(scan, 0.02 * codec) << hwy::TargetName(target) << " " << CodecName(k) << "/" << CodecName(v)
                                        << " softcap " << softcap << " softmax_scale " << scale;
        }
      }
      ++tested;
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GT(tested, 0);
}

TEST(AttentionFeaturesTest, ThreadsAndChunksGiveTheSameResult) {
  // Float path: the integer path quantizes weights per tile, and chunks move
  // tile boundaries.
  const Problem p = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 4, 4, 5000, 2);
  AttentionOptions options{AttentionPath::kSimd};
  options.integer_dot_products = false;
  const Result single = Attend(p, options);
  ThreadPool pool(3);
  options.pool = &pool;
  for (int64_t chunk : {int64_t{0}, int64_t{100}, int64_t{777}}) {
    options.chunk_tokens = chunk;
    const Result split = Attend(p, options);
    // Only the order of float sums changes: a few float epsilons over 5000 tokens.
    EXPECT_LT(RelativeL2(split.out, single.out), 1e-5) << "chunk " << chunk;
    for (size_t i = 0; i < single.lse.size(); ++i) EXPECT_NEAR(split.lse[i], single.lse[i], 1e-5);
  }
}

// AttendCpu with encode_first stores the chunks and attends the pages they
// fill in one parallel job: bit for bit what EncodeChunkCpu and then AttendCpu
// give. A batch without problems still stores them; a refused batch stores
// nothing.
TEST(AttentionFeaturesTest, EncodeFirstStoresTheChunksItsProblemsRead) {
  constexpr int kLayers = 6, kKv = 2, kGroup = 4, kDim = 128, kPageTokens = 16;
  using ::turbokv::testing::HostLayer;
  enum Way { kApart, kFused, kAlone, kRefused, kWays };
  std::vector<std::unique_ptr<HostLayer>> layers[kWays];
  std::vector<std::vector<float>> keys, values, queries;
  std::vector<int64_t> last;
  std::vector<EncodeChunk> chunks[kWays];
  for (int i = 0; i < kLayers; ++i) {
    const int64_t tokens = 20 + 9 * i, held = tokens - 1 - i % 3;  // one to three new tokens
    keys.push_back(GaussianVectors(tokens * kKv, kDim, 40 + i));
    values.push_back(GaussianVectors(tokens * kKv, kDim, 50 + i));
    queries.push_back(GaussianVectors(kKv * kGroup, kDim, 60 + i));
    last.push_back(tokens - 1);
    for (int way = 0; way < kWays; ++way) {
      layers[way].push_back(std::make_unique<HostLayer>(CodecKind::kTurbo3, CodecKind::kTurbo4, kDim, kKv,
                                                        kPageTokens, tokens, 7));
      HostLayer& layer = *layers[way].back();
      for (std::vector<uint8_t>& page : layer.pages) std::fill(page.begin(), page.end(), 0);
      EncodeChunk chunk;
      chunk.key_codec = layer.keys.get();
      chunk.value_codec = layer.values.get();
      chunk.cache = layer.cache;
      chunk.cache.tokens = held;
      chunk.keys = keys.back().data();
      chunk.values = values.back().data();
      EncodeChunkCpu(chunk, nullptr);  // tokens [0, held), stored before
      chunk.cache.tokens = tokens;
      chunk.first = held;
      chunk.keys += held * kKv * kDim;
      chunk.values += held * kKv * kDim;
      chunks[way].push_back(chunk);
    }
  }
  const std::vector<std::vector<uint8_t>> before = layers[kRefused][0]->pages;
  AttentionParams params;
  params.q_heads = kKv * kGroup;
  std::vector<float> out[kWays], lse[kWays];
  auto batch = [&](int way) {
    out[way].assign(kLayers * kKv * kGroup * kDim, 0.0f);
    lse[way].assign(kLayers * kKv * kGroup, 0.0f);
    std::vector<AttentionProblem> problems(kLayers);
    for (int i = 0; i < kLayers; ++i) {
      problems[i].cache = layers[way][i]->cache;
      problems[i].queries = {1, queries[i].data(), &last[i]};
      problems[i].output = {out[way].data() + i * kKv * kGroup * kDim, lse[way].data() + i * kKv * kGroup};
    }
    return problems;
  };
  ThreadPool pool(2);
  AttentionOptions options{AttentionPath::kSimd};
  options.pool = &pool;

  for (const EncodeChunk& chunk : chunks[kApart]) EncodeChunkCpu(chunk, nullptr);
  std::vector<AttentionProblem> apart = batch(kApart);
  ASSERT_TRUE(AttendCpu(AttentionBatch{apart.data(), kLayers}, params, options).ok());

  options.encode_first = chunks[kFused];
  std::vector<AttentionProblem> fused = batch(kFused);
  ASSERT_TRUE(AttendCpu(AttentionBatch{fused.data(), kLayers}, params, options).ok());
  EXPECT_EQ(out[kFused], out[kApart]);
  EXPECT_EQ(lse[kFused], lse[kApart]);

  options.encode_first = chunks[kAlone];
  ASSERT_TRUE(AttendCpu(AttentionBatch{nullptr, 0}, params, options).ok());

  options.encode_first = chunks[kRefused];
  std::vector<AttentionProblem> refused = batch(kRefused);
  refused[kLayers - 1].cache.kv_heads = 0;
  EXPECT_EQ(AttendCpu(AttentionBatch{refused.data(), kLayers}, params, options).code(),
            absl::StatusCode::kInvalidArgument);
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_EQ(layers[kFused][i]->pages, layers[kApart][i]->pages) << "layer " << i;
    EXPECT_EQ(layers[kAlone][i]->pages, layers[kApart][i]->pages) << "layer " << i;
  }
  EXPECT_EQ(layers[kRefused][0]->pages, before);
}

TEST(AttentionFeaturesTest, MergingTwoHalvesEqualsTheWhole) {
  constexpr int64_t kTokens = 2000;
  const Problem whole = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, kTokens, 1);
  // The same tokens split into two caches; the query sees both halves.
  const int d = 128, kv = 2, half = kTokens / 2;
  auto first = PagedCacheBuffer::Create(whole.key_spec, whole.value_spec, kv, kPage);
  auto second = PagedCacheBuffer::Create(whole.key_spec, whole.value_spec, kv, kPage);
  (*first)->Append(half, whole.keys.data(), whole.values.data());
  (*second)->Append(kTokens - half, whole.keys.data() + half * kv * d, whole.values.data() + half * kv * d);
  const size_t rows = whole.params.q_heads;
  std::vector<float> out_a(rows * d), lse_a(rows), out_b(rows * d), lse_b(rows);
  const int64_t last_a = half - 1, last_b = kTokens - half - 1;
  AttentionOptions options{AttentionPath::kSimd};
  options.integer_dot_products = false;  // exact up to float rounding
  ASSERT_TRUE(AttendCpu((*first)->descriptor(), whole.params, {1, whole.q.data(), &last_a},
                        {out_a.data(), lse_a.data()}, options)
                  .ok());
  ASSERT_TRUE(AttendCpu((*second)->descriptor(), whole.params, {1, whole.q.data(), &last_b},
                        {out_b.data(), lse_b.data()}, options)
                  .ok());
  MergeAttention(rows, d, out_a.data(), lse_a.data(), out_b.data(), lse_b.data());
  const Result r = Attend(whole, options);
  EXPECT_LT(RelativeL2(out_a, r.out), 1e-6);
  for (size_t i = 0; i < rows; ++i) EXPECT_NEAR(lse_a[i], r.lse[i], 1e-5);
}

// Error against attention over the original, uncompressed vectors.
double ErrorVsOriginal(const Problem& p) {
  const ReferenceResult exact =
      ReferenceAttention(p.keys, p.values, p.kv_heads, p.key_spec.head_dim, p.q, p.positions, p.params);
  return RelativeL2(Attend(p, {}).out, exact.out);
}

TEST(AttentionFidelityTest, WithinTheCodecErrorOfTheOriginal) {
  // First-order prediction of the output error for random keys, values and
  // queries of gain g (logits of standard deviation g): value errors carry
  // over at sqrt(rel_mse), key errors move the logits by g * sqrt(rel_mse)
  // and the softmax weights by as much, so the error is about
  // sqrt((1 + g^2) * rel_mse). Allow 25% over the prediction.
  constexpr float kGain = 2.0f;
  const struct {
    CodecKind kind;
    double rel_mse;
  } codecs[] = {{CodecKind::kTurbo2, 0.1165}, {CodecKind::kTurbo3, 0.0342}, {CodecKind::kTurbo4, 0.0094},
                {CodecKind::kQ8_0, 4e-5}, {CodecKind::kF16, 1e-7}};
  for (const auto& c : codecs) {
    const Problem p = MakeProblem(c.kind, c.kind, 128, 2, 4, 4096, 4, kGain);
    const double error = ErrorVsOriginal(p);
    const double predicted = std::sqrt((1 + kGain * kGain) * c.rel_mse);
    EXPECT_LT(error, 1.25 * predicted) << CodecName(c.kind);
    std::printf("%s: output relative L2 error vs uncompressed attention %.4f (predicted %.4f)\n",
                CodecName(c.kind), error, predicted);
  }
}

TEST(AttentionFidelityTest, Turbo4BeatsQ4OnOutlierKeys) {
  const std::vector<float> keys = OutlierKeys(4096 * 2, 128, 77);
  const double turbo4 = ErrorVsOriginal(MakeProblem(CodecKind::kTurbo4, CodecKind::kF16, 128, 2, 4,
                                                    4096, 4, 0.3f, keys));
  const double q4 = ErrorVsOriginal(MakeProblem(CodecKind::kQ4_0, CodecKind::kF16, 128, 2, 4, 4096,
                                                4, 0.3f, keys));
  std::printf("outlier keys: turbo4 %.4f, q4_0 %.4f\n", turbo4, q4);
  EXPECT_LT(turbo4, q4);
}

TEST(AttentionValidationTest, BadRequestsNameTheField) {
  Problem p = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, 10, 1);
  std::vector<float> out(8 * 128), lse(8);
  const AttentionOutput output{out.data(), lse.data()};
  auto attend = [&](const AttentionParams& params, int64_t position) {
    return AttendCpu(p.cache->descriptor(), params, {1, p.q.data(), &position}, output);
  };
  auto expect = [](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
  };
  expect(attend(p.params, -1), "positions");
  EXPECT_TRUE(attend(p.params, 10).ok());  // past the stored tokens: sees them all
  AttentionParams bad = p.params;
  bad.q_heads = 7;
  expect(attend(bad, 3), "q_heads");
  bad = p.params;
  bad.softcap = -1;
  expect(attend(bad, 3), "softcap");
  bad = p.params;
  bad.top_k = 4;  // no top-k buffers
  expect(attend(bad, 3), "output");
  EXPECT_TRUE(attend(p.params, 9).ok());

  std::vector<float> q = p.q;
  q[5] = std::nanf("");
  const int64_t position = 3;
  expect(AttendCpu(p.cache->descriptor(), p.params, {1, q.data(), &position}, output), "queries");
  PagedKvCache wrong = p.cache->descriptor();
  wrong.key_layout.block_bytes += 2;  // records would be read past their end
  expect(AttendCpu(wrong, p.params, {1, p.q.data(), &position}, output), "key_layout");
  wrong = p.cache->descriptor();
  wrong.value_layout.kind = static_cast<CodecKind>(42);
  expect(AttendCpu(wrong, p.params, {1, p.q.data(), &position}, output), "value_layout");
  wrong = p.cache->descriptor();
  wrong.first_token = 11;
  expect(AttendCpu(wrong, p.params, {1, p.q.data(), &position}, output), "first_token");
  std::vector<float> offsets(8, 0.0f);
  offsets[2] = INFINITY;
  expect(AttendCpu(p.cache->descriptor(), p.params, {1, p.q.data(), &position, offsets.data()}, output),
         "logit_offset");
}

}  // namespace
}  // namespace turbokv
