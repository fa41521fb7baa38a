#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/half.h"
#include "kernels/key_transform.h"
#include "kernels/paged_cache.h"
#include "service/backend/cpu_backend.h"
#include "service/store/layer_cache.h"
#include "service/store/page_pool.h"
#include "service/store/session_store.h"
#include "service/store/snapshot.h"
#include "service/store/write_batch.h"
#include "tests/kernels/codec_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;

constexpr int kHeads = 2, kDim = 128, kPage = 64;

// The store's logic is the same for every backend: these tests keep pages
// in host memory.
CpuBackend host;

std::shared_ptr<const Codec> MakeCodec(CodecKind kind, uint64_t seed) {
  auto codec = MakeCpuCodec(CodecSpec{kind, kDim, seed});
  EXPECT_TRUE(codec.ok());
  return std::shared_ptr<const Codec>(*std::move(codec));
}

LayerCache MakeLayer(PagePool* pool) {
  return LayerCache(MakeCodec(CodecKind::kTurbo3, 1), MakeCodec(CodecKind::kTurbo4, 2), kHeads, kPage, pool);
}

// The key and value records of every token, for comparing layers.
std::vector<uint8_t> Records(const LayerCache& layer) {
  const PagedKvCache d = layer.Descriptor();
  std::vector<uint8_t> out;
  for (int64_t t = 0; t < d.tokens; ++t) {
    for (int h = 0; h < d.kv_heads; ++h) {
      out.insert(out.end(), d.key_record(h, t), d.key_record(h, t) + d.key_layout.code_size());
      out.insert(out.end(), d.value_record(h, t), d.value_record(h, t) + d.value_layout.code_size());
    }
  }
  return out;
}

struct Tokens {
  std::vector<float> k, v;
  explicit Tokens(int64_t n, uint64_t seed)
      : k(GaussianVectors(n * kHeads, kDim, seed)), v(GaussianVectors(n * kHeads, kDim, seed + 1)) {}
  const float* key(int64_t t) const { return k.data() + t * kHeads * kDim; }
  const float* value(int64_t t) const { return v.data() + t * kHeads * kDim; }
};

// The check values of RFC 3720 (iSCSI) and "123456789"; pieces chain.
TEST(Crc32cTest, MatchesTheStandardCheckValues) {
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  std::string long_text;
  for (int i = 0; i < 1000; ++i) long_text += static_cast<char>(i * 7 + 3);
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    const absl::string_view all(long_text);
    EXPECT_EQ(Crc32c(all.substr(cut), Crc32c(all.substr(0, cut))), Crc32c(all)) << cut;
  }
}

TEST(PagePoolTest, BudgetIsEnforcedAndReturned) {
  PagePool pool(&host, 1000);
  auto a = pool.Allocate(600);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.used_bytes(), 600u);
  auto b = pool.Allocate(500);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(b.status().message());
  EXPECT_NE(message.find("600 bytes used"), std::string::npos) << message;
  EXPECT_NE(message.find("500 needed"), std::string::npos) << message;
  EXPECT_NE(message.find("budget 1000"), std::string::npos) << message;
  a->reset();
  EXPECT_EQ(pool.used_bytes(), 0u);
  EXPECT_TRUE(pool.Allocate(1000).ok());
}

TEST(LayerCacheTest, AppendIsIdempotentByPositionAndRejectsGaps) {
  PagePool pool(&host, 1 << 26);
  const Tokens data(150, 3);
  LayerCache once = MakeLayer(&pool);
  ASSERT_EQ(*once.Append(0, 150, data.key(0), data.value(0)), 150);

  LayerCache pieces = MakeLayer(&pool);
  ASSERT_EQ(*pieces.Append(0, 70, data.key(0), data.value(0)), 70);
  ASSERT_EQ(*pieces.Append(50, 60, data.key(50), data.value(50)), 110);  // 50..69 repeated
  ASSERT_EQ(*pieces.Append(0, 30, data.key(0), data.value(0)), 110);     // all repeated
  const auto gap = pieces.Append(120, 10, data.key(120), data.value(120));
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(gap.status().message()).find("110 to 119 are missing"), std::string::npos)
      << gap.status();
  ASSERT_EQ(*pieces.Append(110, 40, data.key(110), data.value(110)), 150);
  EXPECT_EQ(Records(pieces), Records(once));
}

TEST(LayerCacheTest, AChunkOverTheBudgetChangesNothing) {
  LayerCache probe = MakeLayer(nullptr);
  PagePool pool(&host, 2 * probe.page_bytes() + 10);
  LayerCache layer = MakeLayer(&pool);
  const Tokens data(200, 5);
  ASSERT_EQ(*layer.Append(0, 100, data.key(0), data.value(0)), 100);  // 2 pages
  const std::vector<uint8_t> before = Records(layer);
  const size_t used = pool.used_bytes();
  const auto over = layer.Append(100, 60, data.key(100), data.value(100));  // needs a third page
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(layer.tokens(), 100);
  EXPECT_EQ(pool.used_bytes(), used);
  EXPECT_EQ(Records(layer), before);
  ASSERT_EQ(*layer.Append(100, 28, data.key(100), data.value(100)), 128);  // fits the second page
}

TEST(LayerCacheTest, ForkSharesPagesAndDivergesOnAppend) {
  PagePool pool(&host, 1 << 26);
  LayerCache original = MakeLayer(&pool);
  const Tokens data(1001, 7), other(1, 99);
  ASSERT_EQ(*original.Append(0, 1000, data.key(0), data.value(0)), 1000);  // 15 full pages + 40
  const size_t used = pool.used_bytes();

  LayerCache fork = original.Fork(1000);
  EXPECT_EQ(pool.used_bytes(), used);  // nothing copied
  EXPECT_EQ(Records(fork), Records(original));

  // The first side to append copies the shared partial page, nothing else;
  // the page is then the other side's alone and takes its append in place.
  ASSERT_EQ(*fork.Append(1000, 1, other.key(0), other.value(0)), 1001);
  EXPECT_EQ(pool.used_bytes(), used + fork.page_bytes());
  ASSERT_EQ(*original.Append(1000, 1, data.key(1000), data.value(1000)), 1001);
  EXPECT_EQ(pool.used_bytes(), used + fork.page_bytes());

  const std::vector<uint8_t> a = Records(original), b = Records(fork);
  const size_t per_token = a.size() / 1001;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 1000 * per_token), 0);  // shared prefix intact
  EXPECT_NE(std::memcmp(a.data() + 1000 * per_token, b.data() + 1000 * per_token, per_token), 0);

  // A shorter fork shares only the pages of its prefix.
  LayerCache short_fork = original.Fork(100);
  EXPECT_EQ(short_fork.tokens(), 100);
  EXPECT_EQ(short_fork.bytes(), 2 * fork.page_bytes());
}

TEST(LayerCacheTest, TruncateReleasesPages) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeLayer(&pool);
  const Tokens data(300, 11);
  ASSERT_EQ(*layer.Append(0, 300, data.key(0), data.value(0)), 300);  // 5 pages
  layer.Truncate(70);
  EXPECT_EQ(layer.tokens(), 70);
  EXPECT_EQ(pool.used_bytes(), 2 * layer.page_bytes());
  // Appending again after a rollback rewrites the dropped positions.
  ASSERT_EQ(*layer.Append(70, 230, data.key(70), data.value(70)), 300);
  LayerCache fresh = MakeLayer(&pool);
  ASSERT_EQ(*fresh.Append(0, 300, data.key(0), data.value(0)), 300);
  EXPECT_EQ(Records(layer), Records(fresh));
}

TEST(LayerCacheTest, KernelsReadTheStoredPages) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeLayer(&pool);
  const Tokens data(500, 13);
  ASSERT_EQ(*layer.Append(0, 200, data.key(0), data.value(0)), 200);
  ASSERT_EQ(*layer.Append(200, 300, data.key(200), data.value(200)), 500);
  auto reference = PagedCacheBuffer::Create({CodecKind::kTurbo3, kDim, 1}, {CodecKind::kTurbo4, kDim, 2},
                                            kHeads, kPage);
  ASSERT_TRUE(reference.ok());
  (*reference)->Append(500, data.key(0), data.value(0));

  AttentionParams params;
  params.q_heads = 8;
  const std::vector<float> q = GaussianVectors(8, kDim, 17);
  const int64_t position = 499;
  std::vector<float> out_a(8 * kDim), lse_a(8), out_b(8 * kDim), lse_b(8);
  ASSERT_TRUE(AttendCpu(layer.Descriptor(), params, {1, q.data(), &position}, {out_a.data(), lse_a.data()}).ok());
  ASSERT_TRUE(AttendCpu((*reference)->descriptor(), params, {1, q.data(), &position},
                        {out_b.data(), lse_b.data()})
                  .ok());
  EXPECT_EQ(out_a, out_b);
  EXPECT_EQ(lse_a, lse_b);
}

// A layer with a key transform to fit, 4 sinks in f16, holding its first
// page's tokens exact until a chunk takes it past them.
constexpr int kSinks = 4;
constexpr KeyTransformOptions kCenterScale{true, true, false};

LayerCache MakeHoldingLayer(PagePool* pool) {
  return LayerCache(MakeCodec(CodecKind::kTurbo3, 1), MakeCodec(CodecKind::kTurbo4, 2), kHeads, kPage, pool,
                    LayerStorage{kCenterScale, kSinks, HoldTokens(kCenterScale, kPage, kSinks),
                                 MakeCodec(CodecKind::kF16, 0)});
}

// Keys with a large component every token shares (what garbles keys stored
// as given), rounded to f16 so that the sink page holds them exactly.
struct SharedTokens {
  std::vector<float> k, v;
  explicit SharedTokens(int64_t n, uint64_t seed)
      : k(::turbokv::testing::SharedComponentVectors(n, kHeads, kDim, 300.0f, seed)),
        v(GaussianVectors(n * kHeads, kDim, seed + 1)) {
    for (std::vector<float>* x : {&k, &v}) {
      for (float& f : *x) f = HalfBitsToFloat(FloatToHalfBits(f));
    }
  }
  const float* key(int64_t t) const { return k.data() + t * kHeads * kDim; }
  const float* value(int64_t t) const { return v.data() + t * kHeads * kDim; }
};

TEST(LayerCacheTest, HoldTokensIsTheFirstPageButItsLastToken) {
  EXPECT_EQ(HoldTokens(kCenterScale, 64, 4), 63);
  EXPECT_EQ(HoldTokens(kCenterScale, 256, 4), kMaxFewTokens);
  EXPECT_EQ(HoldTokens({}, 64, 4), 0);                  // nothing to fit: nothing held
  EXPECT_EQ(HoldTokens(kCenterScale, 16, 4), 0);        // a fit on fewer than 16 past the sinks
  EXPECT_EQ(HoldTokens(kCenterScale, 64, 47), 63);
  EXPECT_EQ(HoldTokens(kCenterScale, 64, 48), 0);
}

// Tokens decoded one at a time from an empty layer stay exact until the
// layer would pass its first page but one; the chunk that takes it past
// them fits the transform on every token past the sinks and encodes them:
// the same pages as one chunk of those tokens (fitted from its keys alone).
TEST(LayerCacheTest, HeldTokensStayExactUntilAChunkFitsTheTransformOnThemAll) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeHoldingLayer(&pool);
  const SharedTokens data(100, 21);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  const size_t pages_only = pool.used_bytes();
  for (int64_t t = 0; t < 63; ++t) {
    ASSERT_EQ(*layer.Append(t, 1, data.key(t), data.value(t)), t + 1);
    ASSERT_FALSE(layer.transformed());
    ASSERT_EQ(layer.exact_tokens(), t + 1);
  }
  // The sink page widened to 63 slots, its growth charged.
  const size_t slot = static_cast<size_t>(MakeCodec(CodecKind::kF16, 0)->code_size());
  EXPECT_EQ(pool.used_bytes(), pages_only + layer.page_bytes() + kHeads * 2 * slot * (63 - kSinks));
  std::vector<float> k(63 * row), v(63 * row);
  ASSERT_TRUE(layer.Read(0, 63, k.data(), v.data()).ok());
  EXPECT_EQ(k, std::vector<float>(data.k.begin(), data.k.begin() + 63 * row));
  EXPECT_EQ(v, std::vector<float>(data.v.begin(), data.v.begin() + 63 * row));

  ASSERT_EQ(*layer.Append(63, 2, data.key(63), data.value(63)), 65);
  EXPECT_TRUE(layer.transformed());
  EXPECT_EQ(layer.exact_tokens(), kSinks);
  EXPECT_EQ(layer.transform_end(), 65);
  EXPECT_EQ(pool.used_bytes(), pages_only + 2 * layer.page_bytes());  // the wide sink page's charge went
  LayerCache whole = MakeHoldingLayer(&pool);
  ASSERT_EQ(*whole.Append(0, 65, data.key(0), data.value(0)), 65);
  EXPECT_EQ(Records(layer), Records(whole));
  EXPECT_EQ(layer.Extras().sinks, whole.Extras().sinks);
  EXPECT_EQ(layer.Extras().transform.key_scale, whole.Extras().transform.key_scale);

  // Attention over the held tokens reads them exact: a float reference.
  LayerCache held = MakeHoldingLayer(&pool);
  ASSERT_EQ(*held.Append(0, 40, data.key(0), data.value(0)), 40);
  AttentionParams params;
  params.q_heads = 4;
  const std::vector<float> q = GaussianVectors(4, kDim, 23);
  const int64_t position = 39;
  std::vector<float> out(4 * kDim), lse(4);
  const AttentionProblem problem = held.Attention({1, q.data(), &position}, {out.data(), lse.data()});
  ASSERT_TRUE(AttendCpu(AttentionBatch{&problem, 1}, params).ok());
  for (int h = 0; h < 4; ++h) {
    const int kv = h / 2;
    std::vector<double> logits(40);
    double top = -1e30;
    for (int t = 0; t < 40; ++t) {
      double dot = 0;
      for (int c = 0; c < kDim; ++c) dot += q[h * kDim + c] * data.key(t)[kv * kDim + c];
      logits[t] = dot / std::sqrt(static_cast<double>(kDim));
      top = std::max(top, logits[t]);
    }
    double sum = 0;
    std::vector<double> expected(kDim, 0.0);
    for (int t = 0; t < 40; ++t) {
      const double p = std::exp(logits[t] - top);
      sum += p;
      for (int c = 0; c < kDim; ++c) expected[c] += p * data.value(t)[kv * kDim + c];
    }
    for (int c = 0; c < kDim; ++c) EXPECT_NEAR(out[h * kDim + c], expected[c] / sum, 1e-3) << "head " << h;
    EXPECT_NEAR(lse[h], top + std::log(sum), 1e-3);
  }
}

// A layer holding tokens exact: forks share its sink page and its charge,
// truncation within them keeps the rest, into the sinks narrows the page,
// and Extras() / LoadPages bring it back whole.
TEST(LayerCacheTest, HeldTokensSurviveForkTruncateAndLoad) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeHoldingLayer(&pool);
  const SharedTokens data(100, 31);
  const size_t row = static_cast<size_t>(kHeads) * kDim;
  ASSERT_EQ(*layer.Append(0, 30, data.key(0), data.value(0)), 30);
  const size_t used = pool.used_bytes();
  LayerCache fork = layer.Fork(20);
  EXPECT_EQ(pool.used_bytes(), used);
  EXPECT_EQ(fork.exact_tokens(), 20);
  // The fork's next token makes its own wide page, charged apart.
  ASSERT_EQ(*fork.Append(20, 1, data.key(50), data.value(50)), 21);
  const size_t slot = static_cast<size_t>(MakeCodec(CodecKind::kF16, 0)->code_size());
  EXPECT_EQ(pool.used_bytes(), used + layer.page_bytes() + kHeads * 2 * slot * (63 - kSinks));
  std::vector<float> k(21 * row), v(21 * row);
  ASSERT_TRUE(fork.Read(0, 21, k.data(), v.data()).ok());
  EXPECT_TRUE(std::equal(k.begin(), k.begin() + 20 * row, data.k.begin()));
  EXPECT_TRUE(std::equal(k.begin() + 20 * row, k.end(), data.key(50)));

  // Extras hold the tokens and zeros past them; a layer loads them back.
  layer.Truncate(25);
  EXPECT_EQ(layer.exact_tokens(), 25);
  const LayerExtras extras = layer.Extras();
  EXPECT_EQ(extras.sink_tokens, 25);
  LayerCache fresh = MakeHoldingLayer(&pool);
  ASSERT_EQ(*fresh.Append(0, 25, data.key(0), data.value(0)), 25);
  EXPECT_EQ(extras.sinks, fresh.Extras().sinks);
  LayerCache loaded = MakeHoldingLayer(&pool);
  const std::vector<std::shared_ptr<Page>>& pages = layer.pages();
  size_t next = 0;
  ASSERT_TRUE(loaded
                  .LoadPages(25, extras,
                             [&](uint8_t* out, size_t bytes) {
                               std::memcpy(out, pages[next++]->data, bytes);
                               return absl::OkStatus();
                             })
                  .ok());
  EXPECT_EQ(loaded.exact_tokens(), 25);
  ASSERT_EQ(*loaded.Append(25, 75, data.key(25), data.value(25)), 100);
  ASSERT_EQ(*fresh.Append(25, 75, data.key(25), data.value(25)), 100);
  EXPECT_EQ(Records(loaded), Records(fresh));

  // Extras that do not fit the layer: DATA_LOSS.
  LayerExtras wrong = extras;
  wrong.sink_tokens = 24;
  LayerCache refused = MakeHoldingLayer(&pool);
  next = 0;
  const absl::Status status = refused.LoadPages(25, wrong, [&](uint8_t* out, size_t bytes) {
    std::memcpy(out, pages[next++]->data, bytes);
    return absl::OkStatus();
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;

  // Cut back into the sinks: a narrow page with zeros past the tokens.
  layer.Truncate(2);
  EXPECT_EQ(layer.exact_tokens(), 2);
  LayerCache two = MakeHoldingLayer(&pool);
  ASSERT_EQ(*two.Append(0, 2, data.key(0), data.value(0)), 2);
  EXPECT_EQ(layer.Extras().sinks, two.Extras().sinks);
}

// A refit or a widening over the budget changes nothing.
TEST(LayerCacheTest, AHeldChunkOverTheBudgetChangesNothing) {
  const SharedTokens data(80, 41);
  PagePool probe_pool(&host, 1 << 26);
  LayerCache probe = MakeHoldingLayer(&probe_pool);
  ASSERT_EQ(*probe.Append(0, 4, data.key(0), data.value(0)), 4);
  const size_t one_page = probe_pool.used_bytes();
  PagePool pool(&host, one_page + 100);  // no room for the wide sink page
  LayerCache layer = MakeHoldingLayer(&pool);
  ASSERT_EQ(*layer.Append(0, 4, data.key(0), data.value(0)), 4);
  const auto wide = layer.Append(4, 1, data.key(4), data.value(4));
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kResourceExhausted) << wide.status();
  EXPECT_EQ(layer.tokens(), 4);
  EXPECT_EQ(pool.used_bytes(), one_page);

  PagePool roomy(&host, 1 << 26);
  LayerCache held = MakeHoldingLayer(&roomy);
  ASSERT_EQ(*held.Append(0, 50, data.key(0), data.value(0)), 50);
  const LayerExtras before = held.Extras();
  const std::vector<uint8_t> records = Records(held);
  PagePool tight(&host, roomy.used_bytes() + 100);  // the refit's copy of the first page does not fit
  LayerCache moved = MakeHoldingLayer(&tight);
  size_t next = 0;
  ASSERT_TRUE(moved
                  .LoadPages(50, before,
                             [&](uint8_t* out, size_t bytes) {
                               std::memcpy(out, held.pages()[next++]->data, bytes);
                               return absl::OkStatus();
                             })
                  .ok());
  const auto refit = moved.Append(50, 20, data.key(50), data.value(50));
  EXPECT_EQ(refit.status().code(), absl::StatusCode::kResourceExhausted) << refit.status();
  EXPECT_EQ(moved.tokens(), 50);
  EXPECT_FALSE(moved.transformed());
  EXPECT_EQ(moved.Extras().sinks, before.sinks);
  EXPECT_EQ(Records(moved), records);
}

// What an append asks the budget for (BytesToAppend, for MakeRoom) is what
// Prepare takes: pages, the refit's copy of the first page, the widened
// sink page's charge, token by token from an empty layer past the hold.
TEST(LayerCacheTest, BytesToAppendIsWhatPrepareTakes) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeHoldingLayer(&pool);
  const SharedTokens data(80, 51);
  for (int64_t t = 0; t < 80; ++t) {
    const size_t used = pool.used_bytes();
    {
      absl::StatusOr<LayerCache::PendingAppend> pending = layer.Prepare(t, 1);
      ASSERT_TRUE(pending.ok()) << pending.status();
      ASSERT_EQ(pool.used_bytes() - used, layer.BytesToAppend(t, 1)) << "token " << t;
    }
    ASSERT_EQ(pool.used_bytes(), used);
    ASSERT_EQ(*layer.Append(t, 1, data.key(t), data.value(t)), t + 1);
  }
}

// A chunk applied and then refused (its tier would not hold it) is taken
// back by Restore exactly: a refit's held tokens exact again, its first page
// and sink page as they were, its charges given back.
TEST(LayerCacheTest, RestoreTakesARefitBackExactly) {
  PagePool pool(&host, 1 << 26);
  LayerCache layer = MakeHoldingLayer(&pool);
  const SharedTokens data(80, 61);
  ASSERT_EQ(*layer.Append(0, 50, data.key(0), data.value(0)), 50);
  const LayerExtras extras = layer.Extras();
  const std::vector<uint8_t> records = Records(layer);
  const uint64_t version = layer.extras_version();
  const size_t used = pool.used_bytes();
  absl::StatusOr<LayerCache::PendingAppend> pending = layer.Prepare(50, 20);
  ASSERT_TRUE(pending.ok());
  std::vector<const uint8_t*> table;
  const EncodeChunk chunk = layer.Chunk(&*pending, data.key(50), data.value(50), nullptr, 0, &table);
  EncodeChunkCpu(chunk, nullptr);
  LayerCache::Undo undo;
  ASSERT_EQ(layer.Apply(*std::move(pending), &undo), 70);
  ASSERT_TRUE(layer.transformed());
  layer.Restore(std::move(undo));
  EXPECT_EQ(layer.tokens(), 50);
  EXPECT_FALSE(layer.transformed());
  EXPECT_EQ(layer.exact_tokens(), 50);
  EXPECT_EQ(layer.transform_end(), 0);
  EXPECT_EQ(layer.Extras().sinks, extras.sinks);
  EXPECT_EQ(Records(layer), records);
  EXPECT_GT(layer.extras_version(), version);  // a tier's manifest is written again
  EXPECT_EQ(pool.used_bytes(), used);
  // And the same chunk again fits as it would have.
  ASSERT_EQ(*layer.Append(50, 20, data.key(50), data.value(50)), 70);
  LayerCache whole = MakeHoldingLayer(&pool);
  ASSERT_EQ(*whole.Append(0, 50, data.key(0), data.value(0)), 50);
  ASSERT_EQ(*whole.Append(50, 20, data.key(50), data.value(50)), 70);
  EXPECT_EQ(Records(layer), Records(whole));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(SnapshotTest, RoundTripsAndRefusesDamageWithDataLoss) {
  StoreOptions options;
  options.page_tokens = kPage;
  SessionStore store(options);
  SessionConfig config;
  config.layers = 2;
  config.kv_heads = kHeads;
  config.q_heads = 2 * kHeads;
  config.head_dim = kDim;
  config.key_codec = CodecKind::kF16;
  config.value_codec = CodecKind::kTurbo3;
  config.rotation_seed = 7;
  config.max_tokens = 1000;
  auto session = store.Create(config, "tenant", absl::Now());
  ASSERT_TRUE(session.ok());
  Tokens data(100, 1);
  ASSERT_TRUE((*session)->layers()[1].Append(0, 100, data.key(0), data.value(0)).ok());
  const std::string dir = ::testing::TempDir();
  auto written = WriteSnapshot(dir, **session, (*session)->layers(), NamedBlocks(), kPage, store.backend());
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string path = dir + "/" + (*session)->id() + kSnapshotSuffix;
  const std::string bytes = ReadAll(path);

  // Read back into a second store: the header and every record.
  SessionStore other(options);
  SnapshotHeader seen;
  auto make = [&](const SnapshotHeader& header) -> absl::StatusOr<std::shared_ptr<SessionCache>> {
    seen = header;
    auto built = other.Create(header.config, header.tenant, header.created);
    if (!built.ok()) return built.status();
    return *built;
  };
  uint32_t crc = 0;
  auto loaded = ReadSnapshot(path, kPage, make, &crc);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(crc, *written);
  EXPECT_EQ(seen.id, (*session)->id());
  EXPECT_EQ(seen.tenant, "tenant");
  EXPECT_EQ(seen.tokens, (std::vector<int64_t>{0, 100}));
  EXPECT_EQ(seen.config.rotation_seed, 7u);
  EXPECT_EQ(Records((*loaded)->layers()[1]), Records((*session)->layers()[1]));

  // Every single-byte change and every truncation is caught.
  const std::string damaged = dir + "/damaged" + kSnapshotSuffix;
  for (size_t at : {size_t{0}, size_t{9}, size_t{20}, bytes.size() / 2, bytes.size() - 1}) {
    std::string bad = bytes;
    bad[at] ^= 0x40;
    WriteAll(damaged, bad);
    EXPECT_EQ(ReadSnapshot(damaged, kPage, make, &crc).status().code(), absl::StatusCode::kDataLoss) << at;
  }
  for (size_t keep : {size_t{0}, size_t{10}, bytes.size() - 5}) {
    WriteAll(damaged, bytes.substr(0, keep));
    EXPECT_EQ(ReadSnapshot(damaged, kPage, make, &crc).status().code(), absl::StatusCode::kDataLoss) << keep;
  }
  EXPECT_EQ(ReadSnapshot(path, kPage * 2, make, &crc).status().code(), absl::StatusCode::kDataLoss);

  // A forged header with a valid checksum: token counts whose page bytes
  // would wrap around size_t, and a huge max_tokens. Refused before any
  // session is made.
  const size_t header = 16;
  const size_t max_tokens_at = header + 2 + (*session)->id().size() + 2 + 6 + 16 + 2 + 8;
  const size_t tokens_at = max_tokens_at + 8 + 8 + 8 + 4 + 8;  // layer 1's count
  std::string forged = bytes.substr(0, bytes.size() - 4);
  const int64_t huge_max = INT64_MAX, huge_tokens = (int64_t{1} << 50) * kPage + 1;
  std::memcpy(&forged[max_tokens_at], &huge_max, 8);
  std::memcpy(&forged[tokens_at], &huge_tokens, 8);
  const uint32_t forged_crc = Crc32c(forged);
  forged.append(reinterpret_cast<const char*>(&forged_crc), 4);
  WriteAll(damaged, forged);
  bool made = false;
  auto refused = ReadSnapshot(damaged, kPage, [&](const SnapshotHeader& h) { made = true; return make(h); }, &crc);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_FALSE(made);
}

// A session of two layers of kHeads heads.
SessionConfig TwoLayers() {
  SessionConfig config;
  config.layers = 2;
  config.kv_heads = kHeads;
  config.q_heads = kHeads;
  config.head_dim = kDim;
  config.rotation_seed = 7;
  config.max_tokens = 1000;
  return config;
}

TEST(SnapshotTest, NamedBlocksComeBackAndOnlyThenIsTheNewVersionWritten) {
  StoreOptions options;
  options.page_tokens = kPage;
  options.snapshot_dir = ::testing::TempDir() + "named-" + std::to_string(getpid());
  mkdir(options.snapshot_dir.c_str(), 0755);
  const SessionConfig config = TwoLayers();
  std::string named_id, plain_id;
  {
    SessionStore store(options);
    auto named = store.Create(config, "tenant", absl::Now());
    auto plain = store.Create(config, "tenant", absl::Now());
    ASSERT_TRUE(named.ok() && plain.ok());
    named_id = (*named)->id();
    plain_id = (*plain)->id();
    Tokens data(kPage + 3, 1);
    for (LayerCache& layer : (*named)->layers()) {
      ASSERT_TRUE(layer.Append(0, kPage, data.key(0), data.value(0)).ok());  // the transform's chunk
      ASSERT_TRUE(layer.Append(kPage, 3, data.key(kPage), data.value(kPage)).ok());
    }
    const std::string hash = "first block";
    ASSERT_TRUE(store.NameBlocks(**named, 0, absl::MakeConstSpan(&hash, 1)).ok());
    auto saved = store.SaveSnapshots();
    ASSERT_TRUE(saved.ok() && saved->failed.empty());
  }
  auto version = [&](const std::string& id) {
    const std::string bytes = ReadAll(options.snapshot_dir + "/" + id + kSnapshotSuffix);
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + 8, 4);
    return v;
  };
  EXPECT_EQ(version(named_id), 4u);
  EXPECT_EQ(version(plain_id), 3u);  // what a turbokvd of before reads
  SessionStore store(options);
  auto loaded = store.LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok() && loaded->failed.empty());
  EXPECT_EQ(store.prefix_index().named(named_id), 1u);
  EXPECT_EQ(store.prefix_index().named(plain_id), 0u);
  const std::string hash = "first block";
  auto attached = store.Attach(config, true, "tenant", absl::MakeConstSpan(&hash, 1), absl::Now());
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->tokens, kPage);
}

TEST(StoreTest, EvictionCountsEachSessionsSharedMetadataOnItsOwn) {
  SessionConfig config = TwoLayers();
  config.sink_tokens = 4;
  const size_t meta = SessionMetadataBytes(config), shared = SessionSharedMetadataBytes(config);
  ASSERT_GT(shared, 0u);
  StoreOptions options;
  options.page_tokens = kPage;
  options.eviction = EvictionPolicy::kLru;
  options.budget_bytes = 2 * meta;
  SessionStore store(options);
  ASSERT_TRUE(store.Create(config, "tenant", absl::Now()).ok());
  ASSERT_TRUE(store.Create(config, "tenant", absl::Now()).ok());
  // Room that only both sessions' whole metadata frees, the shared parts
  // of each counted.
  const absl::Status room = store.MakeRoom(2 * meta - shared / 2, {});
  EXPECT_TRUE(room.ok()) << room;
  EXPECT_EQ(store.pool().used_bytes(), 0u);
  EXPECT_EQ(store.session_count(), 0u);
}

// The store's write transaction: a batch dropped before Apply changes
// nothing and gives its pages back; Undo takes an Apply back; Commit
// answers for every write.
TEST(WriteBatchTest, NothingChangesUntilApplyAndUndoTakesItBack) {
  StoreOptions options;
  options.page_tokens = kPage;
  SessionStore store(options);
  const SessionConfig config = TwoLayers();
  absl::StatusOr<std::shared_ptr<SessionCache>> session = store.Create(config, "tenant", absl::Now());
  ASSERT_TRUE(session.ok()) << session.status();
  SessionCache& s = **session;
  std::lock_guard<std::mutex> lock(s.mutex());
  const SessionCache* held[] = {&s};
  const Tokens first(2 * 70, 11), second(2 * 10, 12);
  const size_t empty = store.pool().used_bytes();
  {
    WriteBatch batch(store, held);
    absl::StatusOr<size_t> write = batch.Add(s, {0, 1}, 0, 70, first.k.data(), first.v.data(), nullptr);
    ASSERT_TRUE(write.ok()) << write.status();
    EXPECT_EQ(*write, 0u);
    EXPECT_GT(store.pool().used_bytes(), empty);
    ASSERT_EQ(batch.Jobs().size(), 2u);
    ASSERT_TRUE(store.backend().Encode(batch.Jobs()).ok());
  }
  EXPECT_EQ(store.pool().used_bytes(), empty);
  EXPECT_EQ(s.layers()[0].tokens(), 0);
  EXPECT_EQ(s.layers()[1].tokens(), 0);

  WriteBatch batch(store, held);
  const absl::StatusOr<size_t> gap = batch.Add(s, {0}, 1, 10, second.k.data(), second.v.data(), nullptr);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition) << gap.status();
  ASSERT_TRUE(batch.Add(s, {0, 1}, 0, 70, first.k.data(), first.v.data(), nullptr).ok());
  ASSERT_EQ(batch.writes().size(), 2u);
  ASSERT_TRUE(store.backend().Encode(batch.Jobs()).ok());
  batch.Apply();
  EXPECT_EQ(s.layers()[0].tokens(), 70);
  EXPECT_EQ(s.layers()[1].tokens(), 70);
  EXPECT_EQ(batch.writes()[1].before, 0);
  EXPECT_EQ(batch.writes()[1].after, 70);
  EXPECT_GT(s.errors()[1].keys.vectors, 0u);
  const std::vector<uint8_t> applied = Records(s.layers()[1]);
  const std::vector<absl::Status> committed = batch.Commit();
  ASSERT_EQ(committed.size(), 2u);
  EXPECT_TRUE(committed[0].ok() && committed[1].ok());

  WriteBatch more(store, held);
  ASSERT_TRUE(more.Add(s, {1}, 70, 10, second.k.data(), second.v.data(), nullptr).ok());
  ASSERT_TRUE(store.backend().Encode(more.Jobs()).ok());
  more.Apply();
  EXPECT_EQ(s.layers()[1].tokens(), 80);
  more.Undo();
  EXPECT_EQ(s.layers()[1].tokens(), 70);
  EXPECT_EQ(Records(s.layers()[1]), applied);
}

}  // namespace
}  // namespace turbokv
