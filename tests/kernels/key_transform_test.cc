// KeyTransform and attention over layers stored with a transform and sink
// tokens (AttendTransformed): exact against float attention over the same
// stored data mapped back, on every path and every SIMD target.
#include "kernels/key_transform.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::DecodedThroughCodec;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::ReferenceAttention;
using ::turbokv::testing::ReferenceResult;
using ::turbokv::testing::RelativeL2;
using ::turbokv::testing::SharedComponentVectors;

constexpr int kPage = 64;

struct Result {
  std::vector<float> out, lse, top_logits;
  std::vector<int64_t> top_tokens;
};

// A layer stored as the service stores it: the first `sinks` tokens apart
// in f16 (zeros in the pages), the rest through a transform fitted on
// tokens [sinks, sinks + fit) and their queries, in the pages' codecs.
struct Stored {
  int d = 0, kv_heads = 0;
  AttentionParams params;
  std::vector<float> keys, values, q;  // the originals
  std::vector<int64_t> positions;
  KeyTransform transform;
  int64_t sink_tokens = 0;
  std::unique_ptr<PagedCacheBuffer> pages, sinks;
  // What the layer holds, mapped back: the sinks decoded, the rest decoded
  // and inverted.
  std::vector<float> held_keys, held_values;

  // The problem, its outputs in *r; `with_transform` false leaves the
  // transform out (attention over what is stored, as if untransformed).
  AttentionProblem Problem(Result* r, bool with_transform = true) const {
    const size_t rows = positions.size() * params.q_heads;
    r->out.assign(rows * d, std::nanf(""));
    r->lse.assign(rows, std::nanf(""));
    r->top_tokens.assign(rows * params.top_k, -7);
    r->top_logits.assign(rows * params.top_k, std::nanf(""));
    AttentionProblem p;
    p.cache = pages->descriptor();
    p.cache.first_token = sink_tokens;
    p.queries = {static_cast<int64_t>(positions.size()), q.data(), positions.data()};
    p.output = {r->out.data(), r->lse.data(), r->top_tokens.data(), r->top_logits.data()};
    p.transform = with_transform && !transform.empty() ? &transform : nullptr;
    if (sink_tokens > 0) p.sinks = sinks->descriptor();
    return p;
  }

  Result Attend(const AttentionOptions& options) const {
    Result r;
    const AttentionProblem p = Problem(&r);
    const absl::Status s = AttendCpu(AttentionBatch{&p, 1}, params, options);
    EXPECT_TRUE(s.ok()) << s;
    return r;
  }

  // Float attention (double) over what the layer holds, mapped back.
  ReferenceResult Reference() const {
    return ReferenceAttention(held_keys, held_values, kv_heads, d, q, positions, params);
  }
};

Stored MakeStored(CodecKind key_codec, CodecKind value_codec, int d, int kv_heads, int group, int64_t tokens,
                  int64_t sinks, const KeyTransformOptions& options, int64_t fit = 256) {
  Stored s;
  s.d = d;
  s.kv_heads = kv_heads;
  s.params.q_heads = kv_heads * group;
  s.sink_tokens = sinks;
  const size_t row = static_cast<size_t>(kv_heads) * d;
  s.keys = SharedComponentVectors(tokens, kv_heads, d, 300.0f, 1 + d);
  s.values = SharedComponentVectors(tokens, kv_heads, d, 3.0f, 2 + d);
  // Queries: a shared component too, at a gain that keeps attention peaked
  // but not one-hot.
  s.q = SharedComponentVectors(5 * group, kv_heads, d, 6.0f, 3 + d);
  for (float& x : s.q) x *= 0.05f;
  s.positions = {tokens - 1, tokens / 2, sinks, std::max<int64_t>(sinks - 1, 0), tokens * 3 / 4};
  fit = std::min(fit, tokens - sinks);
  const std::vector<float> fit_q = SharedComponentVectors(fit * group, kv_heads, d, 6.0f, 4 + d);
  s.transform = FitKeyTransform(options, fit, kv_heads, d, s.keys.data() + sinks * row, s.values.data() + sinks * row,
                                s.params.q_heads, fit_q.data());
  std::vector<float> k = s.keys, v = s.values;
  std::fill(k.begin(), k.begin() + sinks * row, 0.0f);
  std::fill(v.begin(), v.begin() + sinks * row, 0.0f);
  s.transform.Apply(tokens - sinks, k.data() + sinks * row, v.data() + sinks * row);
  const CodecSpec key_spec{key_codec, d, 0x1234}, value_spec{value_codec, d, 0x5678};
  s.pages = *PagedCacheBuffer::Create(key_spec, value_spec, kv_heads, kPage);
  s.pages->Append(tokens, k.data(), v.data());
  s.held_keys = DecodedThroughCodec(key_spec, k);
  s.held_values = DecodedThroughCodec(value_spec, v);
  s.transform.Invert(tokens - sinks, s.held_keys.data() + sinks * row, s.held_values.data() + sinks * row);
  if (sinks > 0) {
    const CodecSpec f16{CodecKind::kF16, d, 0};
    s.sinks = *PagedCacheBuffer::Create(f16, f16, kv_heads, static_cast<int>(sinks));
    s.sinks->Append(sinks, s.keys.data(), s.values.data());
    const std::vector<float> sink_keys(s.keys.begin(), s.keys.begin() + sinks * row);
    const std::vector<float> sink_values(s.values.begin(), s.values.begin() + sinks * row);
    const std::vector<float> held_k = DecodedThroughCodec(f16, sink_keys), held_v = DecodedThroughCodec(f16, sink_values);
    std::copy(held_k.begin(), held_k.end(), s.held_keys.begin());
    std::copy(held_v.begin(), held_v.end(), s.held_values.begin());
  }
  return s;
}

// The outputs within `out` relative L2 of the reference, log-sum-exps and
// top-k logits within `logit` of max(1, |x|), top-k tokens equal where
// their logits are apart.
void ExpectMatches(const Result& r, const ReferenceResult& ref, int top_k, double out, double logit,
                   const std::string& what) {
  EXPECT_LT(RelativeL2(r.out, ref.out), out) << what;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    ASSERT_NEAR(r.lse[i], ref.lse[i], logit * std::max(1.0, std::fabs(ref.lse[i]))) << what << " row " << i;
    const std::vector<std::pair<double, int64_t>>& logits = ref.logits[i];
    for (size_t j = 0; j < static_cast<size_t>(top_k); ++j) {
      if (j >= logits.size()) {  // past what the query sees: padding
        EXPECT_EQ(r.top_tokens[i * top_k + j], -1) << what << " row " << i << " rank " << j;
        continue;
      }
      const auto& [l, token] = logits[j];
      const double slack = logit * std::max(1.0, std::fabs(l));
      ASSERT_NEAR(r.top_logits[i * top_k + j], l, slack) << what << " row " << i << " rank " << j;
      const bool apart = (j == 0 || logits[j - 1].first - l > 2 * slack) &&
                         (j + 1 >= logits.size() || l - logits[j + 1].first > 2 * slack);
      if (apart) {
        EXPECT_EQ(r.top_tokens[i * top_k + j], token) << what << " row " << i << " rank " << j;
      }
    }
  }
}

const KeyTransformOptions kCenterScale{true, true, false};
const KeyTransformOptions kEverything{true, true, true};

TEST(KeyTransformTest, ApplyAndInvertAreInverses) {
  const std::vector<float> keys = SharedComponentVectors(100, 2, 64, 300.0f, 5);
  const std::vector<float> values = SharedComponentVectors(100, 2, 64, 3.0f, 6);
  const KeyTransform t = FitKeyTransform(kEverything, 100, 2, 64, keys.data(), values.data(), 2, nullptr);
  ASSERT_FALSE(t.empty());
  EXPECT_TRUE(t.Check(2, 64).ok());
  std::vector<float> k = keys, v = values;
  t.Apply(100, k.data(), v.data());
  // Centered: the stored keys' mean is (near) zero, their norm far below the originals'.
  double mean0 = 0;
  for (int i = 0; i < 100; ++i) mean0 += k[static_cast<size_t>(i) * 128];
  EXPECT_NEAR(mean0 / 100, 0.0, 1e-3);
  EXPECT_LT(std::inner_product(k.begin(), k.end(), k.begin(), 0.0),
            0.1 * std::inner_product(keys.begin(), keys.end(), keys.begin(), 0.0));
  t.Invert(100, k.data(), v.data());
  EXPECT_LT(RelativeL2(k, keys), 1e-6);
  EXPECT_LT(RelativeL2(v, values), 1e-6);
}

TEST(KeyTransformTest, TooFewTokensOrNothingAskedFitNothing) {
  const std::vector<float> keys = SharedComponentVectors(kMinTransformTokens, 1, 64, 300.0f, 7);
  EXPECT_TRUE(FitKeyTransform(kEverything, kMinTransformTokens - 1, 1, 64, keys.data(), keys.data(), 1, nullptr).empty());
  EXPECT_TRUE(FitKeyTransform({}, kMinTransformTokens, 1, 64, keys.data(), keys.data(), 1, nullptr).empty());
  const KeyTransform centered =
      FitKeyTransform({true, false, false}, kMinTransformTokens, 1, 64, keys.data(), keys.data(), 1, nullptr);
  EXPECT_EQ(centered.key_mean.size(), 64u);
  EXPECT_TRUE(centered.key_scale.empty());
  EXPECT_TRUE(centered.value_mean.empty());
}

TEST(KeyTransformTest, ScalesAreNormalizedAndFollowTheQueries) {
  constexpr int d = 64;
  const std::vector<float> keys = SharedComponentVectors(500, 1, d, 300.0f, 8);
  // Queries large on channel 5 only: keys there must be kept more precisely
  // (a smaller scale) than without queries.
  std::vector<float> q(500 * 2 * d, 0.1f);
  for (int i = 0; i < 500 * 2; ++i) q[static_cast<size_t>(i) * d + 5] = 20.0f;
  const KeyTransform plain = FitKeyTransform(kCenterScale, 500, 1, d, keys.data(), keys.data(), 2, nullptr);
  const KeyTransform aware = FitKeyTransform(kCenterScale, 500, 1, d, keys.data(), keys.data(), 2, q.data());
  for (const KeyTransform* t : {&plain, &aware}) {
    double square = 0;
    for (float s : t->key_scale) {
      EXPECT_GT(s, 0.0f);
      square += s * s;
    }
    EXPECT_NEAR(square / d, 1.0, 1e-4);
  }
  EXPECT_LT(aware.key_scale[5] / plain.key_scale[5], 0.5);
}

// Keys almost alike and huge queries: sigma / r underflows, and scales
// normalized from it would be 0 x inf. The keys are then left unscaled (still
// centered), and what is fitted passes Check.
TEST(KeyTransformTest, ScalesThatWouldNotBeFiniteAreLeftOut) {
  constexpr int d = 64;
  constexpr int n = 64;
  std::vector<float> keys(static_cast<size_t>(n) * d), q(static_cast<size_t>(n) * d, 1e30f);
  for (int i = 0; i < n; ++i) {
    for (int c = 0; c < d; ++c) keys[static_cast<size_t>(i) * d + c] = 1e-30f * static_cast<float>((i + c) % 2);
  }
  const KeyTransform t = FitKeyTransform(kCenterScale, n, 1, d, keys.data(), keys.data(), 1, q.data());
  EXPECT_EQ(t.key_mean.size(), static_cast<size_t>(d));
  EXPECT_TRUE(t.key_scale.empty());
  EXPECT_TRUE(t.Check(1, d).ok()) << t.Check(1, d);
}

// DotDouble on every SIMD target against a long double sum: lengths around
// the vector widths, and terms that cancel (where float sums would not do).
TEST(KeyTransformTest, DotDoubleOnEveryTarget) {
  int tested = 0;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    for (int n : {0, 1, 7, 16, 33, 128, 576, 1001}) {
      std::vector<float> a = GaussianVectors(1, std::max(n, 1), 5 + n), b = GaussianVectors(1, std::max(n, 1), 6 + n);
      for (int i = 0; i < n; ++i) a[i] += i % 2 ? 300.0f : -300.0f;  // a large shared part, cancelling
      long double exact = 0, magnitude = 0;
      for (int i = 0; i < n; ++i) {
        exact += static_cast<long double>(a[i]) * b[i];
        magnitude += std::fabs(static_cast<long double>(a[i]) * b[i]);
      }
      EXPECT_NEAR(DotDouble(a.data(), b.data(), n), static_cast<double>(exact), 1e-14 * static_cast<double>(magnitude))
          << hwy::TargetName(target) << " n=" << n;
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

TEST(KeyTransformTest, CheckNamesWhatDoesNotMatch) {
  const std::vector<float> keys = SharedComponentVectors(64, 2, 64, 300.0f, 9);
  KeyTransform t = FitKeyTransform(kEverything, 64, 2, 64, keys.data(), keys.data(), 2, nullptr);
  EXPECT_NE(std::string(t.Check(2, 128).message()).find("kv heads"), std::string::npos);
  t.key_scale[3] = 0.0f;
  EXPECT_NE(std::string(t.Check(2, 64).message()).find("not positive"), std::string::npos);
  t.key_scale[3] = 1.0f;
  t.value_mean[7] = INFINITY;
  EXPECT_NE(std::string(t.Check(2, 64).message()).find("value_mean"), std::string::npos);
  EXPECT_TRUE(t.CheckShape(2, 64).ok());  // the values are Check's alone
  EXPECT_NE(std::string(t.CheckShape(2, 128).message()).find("kv heads"), std::string::npos);
  t.value_mean.pop_back();
  EXPECT_NE(std::string(t.Check(2, 64).message()).find("holds"), std::string::npos);
  EXPECT_NE(std::string(t.CheckShape(2, 64).message()).find("holds"), std::string::npos);
}

// Exactness: attention over a layer stored with the transform and sinks
// equals float attention over what it holds mapped back, for every path,
// codec pair, head dimension, with window, softcap and top-k.
TEST(TransformedAttentionTest, EqualsFloatAttentionOverTheHeldDataOnEveryPath) {
  struct Case {
    CodecKind k, v;
    int d, group;
    int64_t sinks;
    KeyTransformOptions options;
  };
  const Case cases[] = {{CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 4, 4, kCenterScale},
                        {CodecKind::kTurbo4, CodecKind::kTurbo3, 64, 7, 1, kEverything},
                        {CodecKind::kQ8_0, CodecKind::kTurbo4, 128, 2, 0, kEverything},
                        {CodecKind::kTurbo2, CodecKind::kQ4_0, 64, 3, 4, {true, false, false}},
                        {CodecKind::kF16, CodecKind::kF16, 64, 2, 4, {}}};
  AttentionOptions simd_float{AttentionPath::kSimd};
  simd_float.integer_dot_products = false;
  for (const Case& c : cases) {
    for (int variant = 0; variant < 3; ++variant) {
      Stored s = MakeStored(c.k, c.v, c.d, 2, c.group, 700, c.sinks, c.options);
      if (variant == 1) {
        s.params.softcap = 30.0f;
        s.params.window = 200;
      }
      if (variant == 2) {
        s.params.top_k = 5;
        s.params.softmax_scale = 0.3f;
      }
      const ReferenceResult ref = s.Reference();
      const std::string what = std::string(CodecName(c.k)) + "/" + CodecName(c.v) + " d=" + std::to_string(c.d) +
                               " sinks=" + std::to_string(c.sinks) + " variant " + std::to_string(variant);
      ExpectMatches(s.Attend({AttentionPath::kScalar}), ref, s.params.top_k, 2e-5, 1e-4, what + " scalar");
      ExpectMatches(s.Attend(simd_float), ref, s.params.top_k, 2e-5, 1e-4, what + " simd float");
      ExpectMatches(s.Attend({AttentionPath::kSimd}), ref, s.params.top_k, 5e-4, 1e-3, what + " simd");
    }
  }
}

TEST(TransformedAttentionTest, EveryTargetMatchesTheReference) {
  const Stored s = MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 500, 4, kEverything);
  Stored capped = MakeStored(CodecKind::kTurbo4, CodecKind::kTurbo3, 64, 2, 4, 300, 1, kCenterScale);
  capped.params.softcap = 20.0f;
  capped.params.top_k = 3;
  int tested = 0;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    for (const Stored* stored : {&s, static_cast<const Stored*>(&capped)}) {
      ExpectMatches(stored->Attend({AttentionPath::kSimd}), stored->Reference(), stored->params.top_k, 5e-4, 1e-3,
                    hwy::TargetName(target));
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

// What the transform is for: keys with a large shared component lose most
// of their attention error to it.
TEST(TransformedAttentionTest, CutsTheErrorOnSharedComponentKeys) {
  for (CodecKind codec : {CodecKind::kTurbo3, CodecKind::kTurbo4, CodecKind::kQ8_0}) {
    const Stored plain = MakeStored(codec, CodecKind::kF16, 128, 2, 4, 2000, 0, {});
    const Stored transformed = MakeStored(codec, CodecKind::kF16, 128, 2, 4, 2000, 0, kCenterScale);
    const ReferenceResult exact = ReferenceAttention(plain.keys, plain.values, 2, 128, plain.q, plain.positions,
                                                     plain.params);
    const double before = RelativeL2(plain.Attend({}).out, exact.out);
    const double after = RelativeL2(transformed.Attend({}).out, exact.out);
    std::printf("%s keys with a shared component: attention error %.4f plain, %.4f transformed\n", CodecName(codec),
                before, after);
    EXPECT_LT(after, 0.5 * before) << CodecName(codec);
  }
}

// Without the transform's terms the result is wrong: the offsets and value
// means are really applied (a transform that did nothing would pass the
// exactness test trivially only if it were empty).
TEST(TransformedAttentionTest, LeavingTheTransformOutChangesTheResult) {
  const Stored s = MakeStored(CodecKind::kTurbo4, CodecKind::kTurbo4, 64, 2, 4, 300, 0, kEverything);
  Result with, without;
  const AttentionProblem p = s.Problem(&with), q = s.Problem(&without, false);
  ASSERT_TRUE(AttendCpu(AttentionBatch{&p, 1}, s.params).ok());
  ASSERT_TRUE(AttendCpu(AttentionBatch{&q, 1}, s.params).ok());
  EXPECT_GT(RelativeL2(without.out, with.out), 0.1);
  EXPECT_GT(std::fabs(without.lse[0] - with.lse[0]), 1.0);
}

// Queries before the first page token see only sinks; a query at a sink
// position sees sinks up to it; a window past the sinks sees none of them.
TEST(TransformedAttentionTest, SinksFollowPositionsAndWindows) {
  Stored s = MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo3, 64, 1, 2, 200, 4, kCenterScale);
  s.positions = {0, 2, 3, 4, 150};
  s.params.window = 3;
  s.params.top_k = 4;
  const ReferenceResult ref = s.Reference();
  const Result r = s.Attend({AttentionPath::kScalar});
  ExpectMatches(r, ref, 4, 2e-5, 1e-4, "sinks and window");
  // Position 0 sees token 0 only (a sink): its top-1 is token 0, then padding.
  EXPECT_EQ(r.top_tokens[0], 0);
  EXPECT_EQ(r.top_tokens[1], -1);
  // Position 150 with a window of 3 sees tokens 148-150 only.
  const size_t row = 4 * s.params.q_heads;
  for (int j = 0; j < 3; ++j) EXPECT_GE(r.top_tokens[row * 4 + j], 148);
}

TEST(TransformedAttentionTest, MismatchedSinksOrTransformAreRefused) {
  Stored s = MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo3, 64, 2, 2, 100, 4, kCenterScale);
  Result r;
  AttentionProblem p = s.Problem(&r);
  p.cache.first_token = 3;  // the sinks hold 4
  absl::Status status = AttendCpu(AttentionBatch{&p, 1}, s.params);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("sinks"), std::string::npos) << status;
  KeyTransform wrong = s.transform;
  wrong.kv_heads = 1;
  p = s.Problem(&r);
  p.transform = &wrong;
  status = AttendCpu(AttentionBatch{&p, 1}, s.params);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("key transform"), std::string::npos) << status;
}

// AttendFewCpu, which attends the sinks (any cache it takes, on AttendCpu's
// SIMD path), against the scan (AttendCpu's scalar path) on the same small
// cache: every plain codec, 1 to 64 tokens, queries that see all, some or
// none of them, tokens before first_token, more queries than a pass takes,
// window, softcap, logit offsets and top-k, on every SIMD target.
TEST(AttendFewTest, EqualsTheScanOnEveryTarget) {
  struct Case {
    CodecKind k, v;
    int d;
    int64_t tokens, first_token, extra_queries;
  };
  const Case cases[] = {{CodecKind::kF16, CodecKind::kF16, 128, 4, 0, 0},
                        {CodecKind::kF16, CodecKind::kF16, 64, 1, 0, 0},
                        {CodecKind::kQ8_0, CodecKind::kQ8_0, 128, 64, 0, 36},
                        {CodecKind::kQ4_0, CodecKind::kF16, 64, 13, 2, 0}};
  constexpr int kKvHeads = 2, kGroup = 3;
  int tested = 0;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    for (const Case& c : cases) {
      const CodecSpec key_spec{c.k, c.d, 0}, value_spec{c.v, c.d, 0};
      auto cache = *PagedCacheBuffer::Create(key_spec, value_spec, kKvHeads, static_cast<int>(c.tokens));
      const std::vector<float> keys = GaussianVectors(c.tokens * kKvHeads, c.d, 11);
      const std::vector<float> values = GaussianVectors(c.tokens * kKvHeads, c.d, 12);
      cache->Append(c.tokens, keys.data(), values.data());
      std::vector<int64_t> positions = {c.tokens - 1, 0, c.tokens / 2, c.tokens + 50};
      for (int64_t e = 0; e < c.extra_queries; ++e) positions.push_back(e % (c.tokens + 3));
      const int64_t n = static_cast<int64_t>(positions.size());
      const size_t rows = static_cast<size_t>(n) * kKvHeads * kGroup;
      std::vector<float> q = GaussianVectors(rows, c.d, 13);
      for (float& x : q) x *= 2.0f;
      std::vector<float> offsets(rows);
      for (size_t r = 0; r < rows; ++r) offsets[r] = 0.25f * static_cast<float>(r % 5) - 0.5f;
      for (int variant = 0; variant < 3; ++variant) {
        AttentionParams params;
        params.q_heads = kKvHeads * kGroup;
        if (variant == 1) {
          params.softcap = 5.0f;
          params.window = 3;
          params.top_k = 3;
        }
        if (variant == 2) {
          params.softmax_scale = 0.3f;
          params.top_k = 70;  // more than the cache holds: padded
        }
        const float* offset = variant == 1 ? offsets.data() : nullptr;
        Result few, simd, scan;
        for (Result* r : {&few, &simd, &scan}) {
          r->out.assign(rows * c.d, std::nanf(""));
          r->lse.assign(rows, std::nanf(""));
          r->top_tokens.assign(rows * params.top_k, -7);
          r->top_logits.assign(rows * params.top_k, std::nanf(""));
        }
        AttentionProblem p;
        p.cache = cache->descriptor();
        p.cache.first_token = c.first_token;
        p.queries = {n, q.data(), positions.data(), offset};
        p.output = {few.out.data(), few.lse.data(), few.top_tokens.data(), few.top_logits.data()};
        ASSERT_TRUE(FewTokensApply(p.cache));
        for (int h = 0; h < kKvHeads; ++h) AttendFewCpu(p, params, h, 0, n);
        p.output = {simd.out.data(), simd.lse.data(), simd.top_tokens.data(), simd.top_logits.data()};
        p.few_tokens = true;
        ASSERT_TRUE(AttendCpu(AttentionBatch{&p, 1}, params).ok());
        p.few_tokens = false;
        p.output = {scan.out.data(), scan.lse.data(), scan.top_tokens.data(), scan.top_logits.data()};
        ASSERT_TRUE(AttendCpu(AttentionBatch{&p, 1}, params, {AttentionPath::kScalar}).ok());
        const std::string what = std::string(hwy::TargetName(target)) + " " + CodecName(c.k) + "/" +
                                 CodecName(c.v) + " d=" + std::to_string(c.d) + " tokens=" +
                                 std::to_string(c.tokens) + " variant " + std::to_string(variant);
        // Equal where -inf (nothing seen, padding), else within float rounding.
        const auto expect_near = [&](const std::vector<float>& got, const std::vector<float>& want) {
          for (size_t i = 0; i < want.size(); ++i) {
            if (std::isinf(want[i])) {
              EXPECT_EQ(got[i], want[i]) << what << " at " << i;
            } else {
              EXPECT_NEAR(got[i], want[i], 1e-5f * std::max(1.0f, std::fabs(want[i]))) << what << " at " << i;
            }
          }
        };
        EXPECT_EQ(simd.out, few.out) << what << ": the SIMD path is AttendFewCpu when few_tokens";
        EXPECT_EQ(simd.top_tokens, few.top_tokens) << what;
        EXPECT_LT(RelativeL2(few.out, scan.out), 2e-6) << what;
        expect_near(few.lse, scan.lse);
        EXPECT_EQ(few.top_tokens, scan.top_tokens) << what;
        expect_near(few.top_logits, scan.top_logits);
      }
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

// few_tokens on a cache AttendFewCpu does not take is refused, naming it.
TEST(AttendFewTest, AMarkedCacheItCannotTakeIsRefused) {
  for (const bool turbo : {false, true}) {
    const int64_t tokens = turbo ? 4 : kMaxFewTokens + 1;
    const CodecSpec spec{turbo ? CodecKind::kTurbo4 : CodecKind::kF16, 64, 0};
    auto cache = *PagedCacheBuffer::Create(spec, spec, 1, kPage);
    const std::vector<float> kv = GaussianVectors(tokens, 64, 21);
    cache->Append(tokens, kv.data(), kv.data());
    const std::vector<float> q = GaussianVectors(2, 64, 22);
    const int64_t position = tokens - 1;
    std::vector<float> out(2 * 64), lse(2);
    AttentionProblem p;
    p.cache = cache->descriptor();
    p.queries = {1, q.data(), &position};
    p.output = {out.data(), lse.data()};
    p.few_tokens = true;
    AttentionParams params;
    params.q_heads = 2;
    const absl::Status status = AttendCpu(AttentionBatch{&p, 1}, params);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(std::string(status.message()).find("few_tokens"), std::string::npos) << status;
  }
}

// A device runs the pages and the CPU the sinks (PlainAttention callbacks):
// the same results, to the bit, as the CPU running both in one batch, where
// the transform and the f16 sinks are applied in the work items.
TEST(TransformedAttentionTest, PagesAndSinksApartGiveTheSameBits) {
  Stored b = MakeStored(CodecKind::kQ8_0, CodecKind::kTurbo3, 128, 2, 4, 90, 2, kCenterScale);
  for (float softcap : {0.0f, 25.0f}) {
    AttentionParams params = b.params;
    params.softcap = softcap;
    params.top_k = 3;
    Stored left = MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 2, 4, 500, 4, kEverything);
    Result together[2], apart[2];
    left.params = params;
    b.params = params;
    const AttentionProblem one[2] = {left.Problem(&together[0]), b.Problem(&together[1])};
    ASSERT_TRUE(AttendCpu(AttentionBatch{one, 2}, params).ok());
    const AttentionProblem two[2] = {left.Problem(&apart[0]), b.Problem(&apart[1])};
    int page_calls = 0, sink_calls = 0;
    ASSERT_TRUE(AttendTransformed(
                    AttentionBatch{two, 2}, params,
                    [&](const AttentionBatch& batch, const AttentionParams& p) {
                      ++page_calls;
                      for (int64_t i = 0; i < batch.count; ++i) {
                        EXPECT_EQ(batch.problems[i].transform, nullptr);
                        EXPECT_EQ(batch.problems[i].sinks.tokens, 0);
                        EXPECT_EQ(batch.problems[i].queries.logit_offset != nullptr, softcap > 0.0f);
                      }
                      return AttendCpu(batch, p);
                    },
                    [&](const AttentionBatch& batch, const AttentionParams& p) {
                      ++sink_calls;
                      EXPECT_EQ(batch.count, 2);
                      return AttendCpu(batch, p);
                    })
                    .ok());
    EXPECT_EQ(page_calls, 1);
    EXPECT_EQ(sink_calls, 1);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(apart[i].out, together[i].out) << softcap;
      EXPECT_EQ(apart[i].lse, together[i].lse) << softcap;
      EXPECT_EQ(apart[i].top_tokens, together[i].top_tokens) << softcap;
      EXPECT_EQ(apart[i].top_logits, together[i].top_logits) << softcap;
    }
  }
}

// A batch of many short layers (a Decode step of short sessions) puts each
// one's heads in one work item (kernels/cpu/attention.cc): every layer's
// results are the bits it has attended alone, on the pool and without it,
// and a long layer in the same batch (chunks of its own) keeps its bits too.
TEST(TransformedAttentionTest, ManyShortLayersInOneBatchGiveEachOnesBits) {
  constexpr int kLayers = 21;  // 20 short ones: past 8 items a thread of the pool's 2
  std::vector<Stored> layers;
  for (int i = 0; i + 1 < kLayers; ++i) {
    layers.push_back(MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, 90 + 7 * i, 4, kEverything));
  }
  layers.push_back(MakeStored(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 4, 2000, 4, kEverything));
  ThreadPool pool(2, /*background_from=*/16);  // the batch of 56 head items runs on the workers
  AttentionOptions on_pool;
  on_pool.pool = &pool;
  for (float softcap : {0.0f, 25.0f}) {
    std::vector<Result> together(kLayers);
    std::vector<AttentionProblem> batch;
    AttentionParams params = layers[0].params;
    params.softcap = softcap;
    params.top_k = 3;
    for (int i = 0; i < kLayers; ++i) {
      layers[i].params = params;
      batch.push_back(layers[i].Problem(&together[i]));
    }
    ASSERT_TRUE(AttendCpu(AttentionBatch{batch.data(), kLayers}, params, on_pool).ok());
    for (int i = 0; i < kLayers; ++i) {
      for (const AttentionOptions& options : {AttentionOptions(), on_pool}) {
        const Result alone = layers[i].Attend(options);
        EXPECT_EQ(alone.out, together[i].out) << "layer " << i << " softcap " << softcap;
        EXPECT_EQ(alone.lse, together[i].lse) << "layer " << i;
        EXPECT_EQ(alone.top_tokens, together[i].top_tokens) << "layer " << i;
        EXPECT_EQ(alone.top_logits, together[i].top_logits) << "layer " << i;
      }
    }
    // And the bits are right: the float reference over what each layer holds.
    for (int i = 0; i < kLayers; ++i) {
      ExpectMatches(together[i], layers[i].Reference(), params.top_k, 5e-4, 1e-3, "layer " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace turbokv
