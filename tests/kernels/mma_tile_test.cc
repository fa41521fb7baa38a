// The tensor-core decode kernel's arithmetic (kernels/mma_tile.h) in its
// host emulation (kernels/mma_emulation.h): the fragment maps cover their
// matrices, the dimension maps are permutations, and attention over caches
// in the token-group order agrees with the scalar reference over every codec
// pair, head dim 64, 128 and 256, GQA groups of 1 to 12, windows, softcap
// and the key transform's logit offsets, to the bound of the CPU's integer
// scan (fp16 queries and weights, split hi + lo, on the tensor cores).
#include "kernels/mma_emulation.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/page_layout.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::RelativeL2;

constexpr CodecKind kKinds[] = {CodecKind::kF16,    CodecKind::kQ8_0,   CodecKind::kQ4_0,
                                CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4};

TEST(MmaTileTest, FragmentSlotsCoverTheirMatrices) {
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane) {
    for (int e = 0; e < 8; ++e) EXPECT_TRUE(a.insert({mma::ARow(lane, e), mma::ACol(lane, e)}).second);
    for (int e = 0; e < 4; ++e) EXPECT_TRUE(b.insert({mma::BRow(lane, e), mma::BCol(lane)}).second);
    for (int e = 0; e < 4; ++e) EXPECT_TRUE(c.insert({mma::CRow(lane, e), mma::CCol(lane, e)}).second);
  }
  EXPECT_EQ(a.size(), 256u);
  EXPECT_EQ(b.size(), 128u);
  EXPECT_EQ(c.size(), 128u);
}

TEST(MmaTileTest, DimensionMapsArePermutations) {
  for (int d : {64, 128, 256}) {
    for (CodecKind kind : kKinds) {
      const CodecLayout layout = MakeCodecLayout(kind, d);
      std::set<int> keys, values;
      for (int k = 0; k < d / 16; ++k) {
        for (int i = 0; i < 16; ++i) {
          keys.insert(mma::KeyDim(layout, k, i));
          values.insert(mma::ValueDim(layout, k, i));
        }
      }
      EXPECT_EQ(keys.size(), static_cast<size_t>(d)) << CodecName(kind) << " d=" << d;
      EXPECT_EQ(values.size(), static_cast<size_t>(d)) << CodecName(kind) << " d=" << d;
      EXPECT_EQ(*keys.rbegin(), d - 1);
      EXPECT_EQ(*values.rbegin(), d - 1);
      // A chunk's key and value dimensions stay in one factor block (a
      // chunk's scores and values take one factor a token).
      const int per_block = d / mma::FactorBlocks(layout);
      for (int k = 0; k < d / 16; ++k) {
        for (int i = 0; i < 16; ++i) {
          EXPECT_EQ(mma::KeyDim(layout, k, i) / per_block, mma::KeyDim(layout, k, 0) / per_block);
          EXPECT_EQ(mma::ValueDim(layout, k, i) / per_block, mma::ValueDim(layout, k, 0) / per_block);
        }
      }
    }
  }
}

// The fast codecs' fragments, from whole plane words, are the bits of the
// value-by-value ones for every lane and chunk of random groups.
template <CodecKind K, int D>
void ExpectFastFragmentsAreOneByOnes() {
  const CodecLayout layout = MakeCodecLayout(K, D);
  std::vector<uint8_t> bytes(mma::kTile * layout.code_size());
  uint64_t x = 0x9e3779b97f4a7c15ull + D;
  for (uint8_t& b : bytes) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<uint8_t>(x >> 56);
  }
  if (K == CodecKind::kF16) {
    // Finite fp16 (no NaN: its bits would still compare, but keep it plain).
    for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x7b;
  }
  mma::UnitTable table;
  const float centroids[16] = {-2.7f, -2.1f, -1.6f, -1.2f, -0.9f, -0.6f, -0.3f, -0.1f,
                               0.1f,  0.3f,  0.6f,  0.9f,  1.2f,  1.6f,  2.1f,  2.7f};
  mma::MakeUnitTable(centroids, 16, &table);
  const mma::Group<K, D> group{bytes.data(), layout};
  for (int lane = 0; lane < 32; ++lane) {
    for (int k = 0; k < D / 16; ++k) {
      uint32_t fast[4], slow[4], fast_lo[4] = {}, slow_lo[4] = {};
      mma::KeyFragment(group, table, lane, k, fast, fast_lo);
      mma::KeyFragmentOneByOne(group, table, lane, k, slow, slow_lo);
      for (int r = 0; r < 4; ++r) {
        ASSERT_EQ(fast[r], slow[r]) << CodecName(K) << " d=" << D << " keys lane " << lane << " chunk " << k << " reg " << r;
        if (group.HasLo()) {
          ASSERT_EQ(fast_lo[r], slow_lo[r]) << CodecName(K) << " d=" << D << " key part 1, lane " << lane;
        }
      }
      mma::ValueFragment(group, table, lane, k, fast);
      mma::ValueFragmentOneByOne(group, table, lane, k, slow);
      for (int r = 0; r < 4; ++r) ASSERT_EQ(fast[r], slow[r]) << CodecName(K) << " d=" << D << " values lane " << lane << " chunk " << k << " reg " << r;
    }
  }
}

TEST(MmaTileTest, FastFragmentsAreTheOneByOneBits) {
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo4, 64>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo4, 128>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo4, 256>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo3, 64>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo3, 128>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo3, 256>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo2, 64>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kTurbo2, 128>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kF16, 64>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kF16, 128>();
  ExpectFastFragmentsAreOneByOnes<CodecKind::kF16, 256>();
}

// A cache of `tokens` Gaussian keys and values, its pages also in the
// token-group order.
struct GroupedCache {
  std::unique_ptr<PagedCacheBuffer> canonical;
  std::vector<std::vector<uint8_t>> pages;
  std::vector<const uint8_t*> table;
  PagedKvCache grouped;

  GroupedCache(CodecKind keys, CodecKind values, int d, int kv_heads, int64_t tokens, uint64_t seed) {
    auto made = PagedCacheBuffer::Create({keys, d, seed}, {values, d, seed + 1}, kv_heads, 64);
    EXPECT_TRUE(made.ok()) << made.status();
    canonical = *std::move(made);
    const std::vector<float> k = GaussianVectors(tokens * kv_heads, d, seed + 2);
    const std::vector<float> v = GaussianVectors(tokens * kv_heads, d, seed + 3);
    canonical->Append(tokens, k.data(), v.data());
    grouped = canonical->descriptor();
    grouped.order = PageOrder::kTokenGroups;
    const PageFormat format = grouped.format();
    for (int64_t p = 0; p * grouped.page_tokens < tokens; ++p) {
      pages.emplace_back(format.page_bytes());
      PageToOrder(format, grouped.pages[p], pages.back().data());
      table.push_back(pages.back().data());
    }
    grouped.pages = table.data();
  }
};

struct Case {
  CodecKind keys, values;
  int d, group;
  int64_t tokens;
  int64_t window = 0;
  float softcap = 0.0f;
  bool offsets = false;
  int64_t first_token = 0;
};

std::string Describe(const Case& c) {
  return std::string(CodecName(c.keys)) + "/" + CodecName(c.values) + " d=" + std::to_string(c.d) +
         " group=" + std::to_string(c.group) + " tokens=" + std::to_string(c.tokens) +
         (c.window ? " window" : "") + (c.softcap > 0 ? " softcap" : "") + (c.offsets ? " offsets" : "") +
         (c.first_token ? " sinks" : "");
}

// Relative L2 of the outputs and the largest lse difference against the
// scalar path.
void ExpectAgrees(const Case& c, const mma::EmulatedLaunch& launch = {}) {
  constexpr int kKvHeads = 2;
  GroupedCache cache(c.keys, c.values, c.d, kKvHeads, c.tokens, 0x51 + c.tokens + c.d);
  cache.grouped.first_token = c.first_token;
  PagedKvCache canonical = cache.canonical->descriptor();
  canonical.first_token = c.first_token;
  AttentionParams params;
  params.q_heads = kKvHeads * c.group;
  params.window = c.window;
  params.softcap = c.softcap;
  const std::vector<int64_t> positions = {c.tokens - 1, (c.tokens - 1) / 2, 0};
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<float> q = GaussianVectors(n * params.q_heads, c.d, 0x77 + c.d);
  for (float& x : q) x *= 2.0f;
  std::vector<float> offsets = GaussianVectors(1, n * params.q_heads, 0x78);
  const AttentionQueries queries{n, q.data(), positions.data(), c.offsets ? offsets.data() : nullptr};
  const size_t rows = static_cast<size_t>(n) * params.q_heads;
  std::vector<float> ref_out(rows * c.d), ref_lse(rows), out(rows * c.d, std::nanf("")), lse(rows, std::nanf(""));
  ASSERT_TRUE(AttendCpu(canonical, params, queries, {ref_out.data(), ref_lse.data()}, {AttentionPath::kScalar}).ok());
  mma::EmulateTensorCoreAttention(cache.grouped, params, queries, {out.data(), lse.data()}, launch);
  const std::string what = Describe(c);
  EXPECT_LT(RelativeL2(out, ref_out), 5e-4) << what;
  for (size_t i = 0; i < rows; ++i) {
    if (std::isinf(ref_lse[i])) {
      EXPECT_EQ(lse[i], ref_lse[i]) << what << " row " << i;
      continue;
    }
    ASSERT_NEAR(lse[i], ref_lse[i], 1e-3 * std::max(1.0f, std::fabs(ref_lse[i]))) << what << " row " << i;
  }
}

TEST(MmaTileTest, EveryCodecPairAndHeadDimAgreesWithTheScalarPath) {
  for (int d : {64, 128, 256}) {
    for (CodecKind keys : kKinds) {
      for (CodecKind values : kKinds) {
        ExpectAgrees({keys, values, d, 4, 200});
        ExpectAgrees({keys, values, d, 4, 200}, mma::EmulatedLaunch{4, 512, false});
      }
    }
  }
}

TEST(MmaTileTest, GroupsLengthsAndOptionsAgreeWithTheScalarPath) {
  for (int d : {64, 128, 256}) {
    for (const auto& [keys, values] : {std::make_pair(CodecKind::kTurbo3, CodecKind::kTurbo3),
                                       std::make_pair(CodecKind::kTurbo4, CodecKind::kTurbo4),
                                       std::make_pair(CodecKind::kQ8_0, CodecKind::kTurbo4),
                                       std::make_pair(CodecKind::kF16, CodecKind::kF16)}) {
      for (int group : {1, 7, 12}) {
        for (int64_t tokens : {int64_t{1}, int64_t{15}, int64_t{65}, int64_t{1500}}) {
          ExpectAgrees({keys, values, d, group, tokens});
        }
      }
      ExpectAgrees({keys, values, d, 4, 700, 37, 4.0f, true});
      ExpectAgrees({keys, values, d, 4, 700, 0, 0.0f, true, 4});
    }
  }
}

// The cut of the work changes nothing but float rounding: one warp or
// eight, splits of 512 tokens or of 64.
TEST(MmaTileTest, WarpsAndSplitsChangeOnlyRounding) {
  for (const mma::EmulatedLaunch& launch :
       {mma::EmulatedLaunch{1, 512}, mma::EmulatedLaunch{8, 512}, mma::EmulatedLaunch{4, 64}}) {
    ExpectAgrees({CodecKind::kTurbo3, CodecKind::kTurbo4, 128, 4, 1200}, launch);
  }
}

}  // namespace
}  // namespace turbokv
