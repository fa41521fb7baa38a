// The disk tier under the store, on real files: write-through, demotion and
// promotion bit-exact, restart from the segment log (with forks, truncation,
// deletion, torn records and another format version), the budgets.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "service/records/record_io.h"
#include "service/store/session_store.h"
#include "service/store/tiers/disk_tier.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/backend_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;

constexpr int kLayers = 2, kHeads = 2, kDim = 128, kPage = 64;

std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "spill-", name, "-", getpid());
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

std::vector<std::string> Segments(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      if (absl::EndsWith(entry->d_name, ".tkvl")) names.push_back(dir + "/" + entry->d_name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

struct Store {
  std::unique_ptr<SessionStore> store;
  TierScanReport scan;
};

// On each device: the store's pages in its memory, demoted from it and
// promoted back into it (the GPU skips, saying why, where it cannot serve).
class SpillTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = testing::TestBackend(GetParam(), nullptr, size_t{256} << 20);
    if (!backend.ok()) GTEST_SKIP() << GetParam() << " cannot serve here: " << backend.status().message();
    backend_ = *std::move(backend);
  }

  Store OpenStore(const std::string& dir, size_t budget = size_t{64} << 20, size_t spill_budget = size_t{1} << 30,
                  EvictionPolicy eviction = EvictionPolicy::kLru) {
    DiskTierOptions disk;
    disk.dir = dir;
    disk.budget_bytes = spill_budget;
    disk.page_tokens = kPage;
    disk.segment_bytes = size_t{1} << 20;
    auto tier = DiskTier::Open(disk);
    EXPECT_TRUE(tier.ok()) << tier.status();
    StoreOptions options;
    options.backend = backend_.get();
    options.budget_bytes = budget;
    options.eviction = eviction;
    options.page_tokens = kPage;
    Store out;
    out.store = std::make_unique<SessionStore>(options, *std::move(tier));
    auto scan = out.store->LoadTier(absl::Now());
    EXPECT_TRUE(scan.ok()) << scan.status();
    if (scan.ok()) out.scan = *std::move(scan);
    return out;
  }

  // A store that holds one session of 200 tokens, not two: `waiting`
  // demoted, `busy` resident; bringing `waiting` back takes busy's room.
  struct RoomHeld {
    Store s;
    std::shared_ptr<SessionCache> waiting, busy;
  };
  RoomHeld HoldTheRoom(const std::string& name);

  std::unique_ptr<Backend> backend_;
};

SessionConfig Config() {
  SessionConfig config;
  config.layers = kLayers;
  config.kv_heads = kHeads;
  config.q_heads = kHeads;
  config.head_dim = kDim;
  config.key_codec = CodecKind::kTurbo3;
  config.value_codec = CodecKind::kQ8_0;
  config.rotation_seed = 7;
  config.max_tokens = 1 << 20;
  return config;
}

// Appends n tokens to every layer of the session (locked here), as the
// handler does: the pages it seals are written through.
void Append(SessionStore& store, SessionCache& session, int64_t n, uint64_t seed) {
  std::lock_guard<std::mutex> lock(session.mutex());
  ASSERT_TRUE(store.residency().Promote(session, {&session}).ok());
  for (int l = 0; l < kLayers; ++l) {
    LayerCache& layer = session.layers()[l];
    const auto k = GaussianVectors(n * kHeads, kDim, seed + l), v = GaussianVectors(n * kHeads, kDim, seed + 10 + l);
    const SessionCache* held[] = {&session};
    ASSERT_TRUE(store.MakeRoom(layer.BytesToAppend(layer.tokens(), n), held).ok());
    auto appended = layer.Append(layer.tokens(), n, k.data(), v.data());
    ASSERT_TRUE(appended.ok()) << appended.status();
  }
  EXPECT_TRUE(store.residency().WriteThrough(session, false).ok());
}

SpillTest::RoomHeld SpillTest::HoldTheRoom(const std::string& name) {
  size_t one = 0;  // what one session of 200 tokens holds
  {
    Store probe = OpenStore(FreshDir(name + "-probe"));
    auto session = probe.store->Create(Config(), "tenant", absl::Now());
    EXPECT_TRUE(session.ok());
    Append(*probe.store, **session, 200, 1);
    one = probe.store->pool().used_bytes();
  }
  RoomHeld r{OpenStore(FreshDir(name), one + one / 2), nullptr, nullptr};
  auto waiting = r.s.store->Create(Config(), "tenant", absl::Now());
  EXPECT_TRUE(waiting.ok());
  r.waiting = *waiting;
  Append(*r.s.store, *r.waiting, 200, 1);
  {
    std::lock_guard<std::mutex> lock(r.waiting->mutex());
    EXPECT_TRUE(r.s.store->residency().Demote(*r.waiting).ok());
  }
  auto busy = r.s.store->Create(Config(), "tenant", absl::Now());
  EXPECT_TRUE(busy.ok());
  r.busy = *busy;
  Append(*r.s.store, *r.busy, 200, 2);
  return r;
}

// Every layer's keys and values as decoded, after promoting the session.
std::vector<float> Contents(SessionStore& store, SessionCache& session) {
  std::lock_guard<std::mutex> lock(session.mutex());
  const SessionCache* held[] = {&session};
  const absl::Status promoted = store.residency().Promote(session, held);
  EXPECT_TRUE(promoted.ok()) << promoted;
  std::vector<float> out;
  if (!promoted.ok()) return out;
  for (const LayerCache& layer : session.layers()) {
    std::vector<float> k(static_cast<size_t>(layer.tokens()) * kHeads * kDim), v(k.size());
    EXPECT_TRUE(layer.Read(0, layer.tokens(), k.data(), v.data()).ok());
    out.insert(out.end(), k.begin(), k.end());
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::vector<int64_t> LayerTokens(SessionCache& session) {
  std::lock_guard<std::mutex> lock(session.mutex());
  std::vector<int64_t> tokens;
  for (int l = 0; l < session.config().layers; ++l) tokens.push_back(session.layer_tokens(l));
  return tokens;
}

TEST_P(SpillTest, DemotionDropsMemoryAndPromotionBringsItBackBitExact) {
  const std::string dir = FreshDir("roundtrip");
  Store s = OpenStore(dir);
  auto session = s.store->Create(Config(), "tenant", absl::Now());
  ASSERT_TRUE(session.ok());
  Append(*s.store, **session, 200, 1);  // three sealed pages and a tail of 8
  const std::vector<float> before = Contents(*s.store, **session);
  const size_t used = s.store->pool().used_bytes();
  {
    std::lock_guard<std::mutex> lock((*session)->mutex());
    ASSERT_TRUE(s.store->residency().Demote(**session).ok());
    EXPECT_FALSE((*session)->resident());
    EXPECT_EQ((*session)->bytes_used(), 0u);
    EXPECT_EQ((*session)->tokens(), 2 * 200);
    EXPECT_GT(s.store->residency().TierBytes(**session), 0u);
  }
  EXPECT_LT(s.store->pool().used_bytes(), used / 10);
  EXPECT_EQ(Contents(*s.store, **session), before);
  const StoreSnapshot snapshot = s.store->Snapshot();
  EXPECT_EQ(snapshot.demotions, 1);
  EXPECT_EQ(snapshot.promotions, 1);
  // It goes on where it was.
  Append(*s.store, **session, 10, 5);
  EXPECT_EQ(LayerTokens(**session), (std::vector<int64_t>{210, 210}));
}

TEST_P(SpillTest, NamedBlocksOutliveADemotionAndARestart) {
  const std::string dir = FreshDir("named");
  const std::vector<std::string> hashes = {"block 0", "block 1", "block 2"};
  std::vector<float> prefix;
  {
    Store s = OpenStore(dir);
    auto storer = s.store->Create(Config(), "tenant", absl::Now());
    ASSERT_TRUE(storer.ok());
    Append(*s.store, **storer, 2 * kPage, 1);
    Append(*s.store, **storer, 10, 2);
    {
      std::lock_guard<std::mutex> lock((*storer)->mutex());
      ASSERT_TRUE(s.store->NameBlocks(**storer, 0, absl::MakeConstSpan(hashes).subspan(0, 2)).ok());
      ASSERT_TRUE(s.store->residency().Demote(**storer).ok());
    }
    // The demoted holder is promoted for the attach.
    auto attached = s.store->Attach(Config(), true, "tenant", hashes, absl::Now());
    ASSERT_TRUE(attached.ok()) << attached.status();
    EXPECT_EQ(attached->tokens, 2 * kPage);
    prefix = Contents(*s.store, *attached->session);
    EXPECT_EQ(prefix.size(), 2u * kLayers * 2 * kPage * kHeads * kDim);
    ASSERT_TRUE(s.store->residency().Flush(absl::Now() + absl::Seconds(30)).ok());
  }
  Store s = OpenStore(dir);
  EXPECT_EQ(s.store->prefix_index().blocks(), 2u);
  // Another tenant's or another seed's lookup finds nothing.
  EXPECT_EQ(s.store->Attach(Config(), true, "another", hashes, absl::Now())->tokens, 0);
  SessionConfig seeded = Config();
  seeded.rotation_seed = 8;
  EXPECT_EQ(s.store->Attach(seeded, true, "tenant", hashes, absl::Now())->tokens, 0);
  auto attached = s.store->Attach(Config(), true, "tenant", hashes, absl::Now());
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->tokens, 2 * kPage);
  EXPECT_EQ(Contents(*s.store, *attached->session), prefix);
}

TEST_P(SpillTest, ARestartFindsEverySealedPageAndAFlushedTail) {
  const std::string dir = FreshDir("restart");
  std::string kept, flushed, forked, truncated, deleted;
  std::vector<float> kept_sealed, flushed_all, fork_all, truncated_all;
  {
    Store s = OpenStore(dir);
    auto a = s.store->Create(Config(), "t1", absl::Now());
    auto b = s.store->Create(Config(), "t2", absl::Now());
    auto c = s.store->Create(Config(), "t1", absl::Now());
    auto d = s.store->Create(Config(), "t1", absl::Now());
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
    Append(*s.store, **a, 130, 1);  // two sealed pages, a tail of 2
    Append(*s.store, **b, 70, 2);
    Append(*s.store, **c, 256, 3);
    Append(*s.store, **d, 64, 4);
    kept = (*a)->id();
    flushed = (*b)->id();
    truncated = (*c)->id();
    deleted = (*d)->id();
    {
      std::lock_guard<std::mutex> lock((*a)->mutex());
      auto fork = s.store->Fork(**a, 100, absl::Now());
      ASSERT_TRUE(fork.ok());
      forked = (*fork)->id();
    }
    {
      std::lock_guard<std::mutex> lock((*c)->mutex());
      ASSERT_TRUE(s.store->Truncate(**c, 150).ok());  // two sealed pages kept, the third cut to 22 tokens
    }
    ASSERT_TRUE(s.store->Delete(deleted, "t1").ok());
    kept_sealed = Contents(*s.store, **a);
    truncated_all = Contents(*s.store, **c);
    flushed_all = Contents(*s.store, **b);
    {
      // b's tail is written (as the drain does for all).
      std::lock_guard<std::mutex> lock((*b)->mutex());
      ASSERT_TRUE(s.store->residency().Demote(**b).ok());
    }
    ASSERT_TRUE(s.store->residency().tier()->Sync().ok());
  }  // no drain: a crash, as far as the tails of a and c go
  Store s = OpenStore(dir);
  EXPECT_EQ(s.scan.loaded, 4);
  EXPECT_EQ(s.scan.torn, 0);
  EXPECT_TRUE(s.scan.damaged.empty());
  auto a = s.store->Find(kept, "t1", absl::Now());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(LayerTokens(**a), (std::vector<int64_t>{128, 128}));  // the unsealed tail is lost
  std::vector<float> a_now = Contents(*s.store, **a);
  const size_t layer_values = size_t{128} * kHeads * kDim;
  // Layer 0's keys: the first 128 tokens as they were.
  EXPECT_TRUE(std::equal(a_now.begin(), a_now.begin() + layer_values, kept_sealed.begin()));
  auto b = s.store->Find(flushed, "t2", absl::Now());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(LayerTokens(**b), (std::vector<int64_t>{70, 70}));
  EXPECT_EQ(Contents(*s.store, **b), flushed_all);
  EXPECT_FALSE(s.store->Find(flushed, "t1", absl::Now()).ok()) << "another tenant's session";
  auto fork = s.store->Find(forked, "t1", absl::Now());
  ASSERT_TRUE(fork.ok());
  EXPECT_EQ(LayerTokens(**fork), (std::vector<int64_t>{64, 64}));  // its sealed pages (shared with a)
  auto c = s.store->Find(truncated, "t1", absl::Now());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(LayerTokens(**c), (std::vector<int64_t>{128, 128}));
  std::vector<float> c_now = Contents(*s.store, **c);
  EXPECT_TRUE(std::equal(c_now.begin(), c_now.begin() + layer_values, truncated_all.begin()));
  EXPECT_FALSE(s.store->Find(deleted, "t1", absl::Now()).ok()) << "a deleted session stays deleted";
}

TEST_P(SpillTest, TornAndForeignRecordsAreSkippedAndFailOnlyTheirSession) {
  const std::string dir = FreshDir("torn");
  std::string good, other;
  {
    Store s = OpenStore(dir);
    auto a = s.store->Create(Config(), "", absl::Now());
    auto b = s.store->Create(Config(), "", absl::Now());
    ASSERT_TRUE(a.ok() && b.ok());
    Append(*s.store, **a, 128, 1);
    Append(*s.store, **b, 128, 2);
    good = (*a)->id();
    other = (*b)->id();
    ASSERT_TRUE(s.store->residency().tier()->Sync().ok());
  }
  const std::vector<std::string> segments = Segments(dir);
  ASSERT_FALSE(segments.empty());
  // A torn tail: half a record at the end of the last segment.
  {
    std::ofstream out(segments.back(), std::ios::binary | std::ios::app);
    const std::string half = std::string("TKVR\x01\x00\x01\x00", 8) + std::string(40, '\x7f');
    out.write(half.data(), static_cast<std::streamsize>(half.size()));
  }
  // A record of b in another format version: b's manifest is rewritten so.
  {
    std::fstream file(segments.front(), std::ios::binary | std::ios::in | std::ios::out);
    std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    // Find b's id in a record header, step back to its frame.
    const size_t at = bytes.find(other);
    ASSERT_NE(at, std::string::npos);
    const size_t frame = bytes.rfind("TKVR", at);
    ASSERT_NE(frame, std::string::npos);
    bytes[frame + 4] = 9;  // version 9
    // The CRC still has to hold for the record to be read as a record.
    uint32_t header = 0, payload = 0;
    std::memcpy(&header, bytes.data() + frame + 16, 4);
    std::memcpy(&payload, bytes.data() + frame + 20, 4);
    const size_t body = 24 + header + payload;
    const uint32_t crc = Crc32c(absl::string_view(bytes.data() + frame, body));
    std::memcpy(bytes.data() + frame + body, &crc, 4);
    file.seekp(0);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  Store s = OpenStore(dir);
  EXPECT_EQ(s.scan.torn, 1);
  auto a = s.store->Find(good, "", absl::Now());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(LayerTokens(**a), (std::vector<int64_t>{128, 128}));
  auto b = s.store->Find(other, "", absl::Now());
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDataLoss) << b.status();
  EXPECT_TRUE(absl::StrContains(b.status().message(), "spill format version 9")) << b.status();
}

// A manifest naming a page record that is gone (here: the first page of layer 0,
// damaged on disk) cuts that layer there; the layers after it still come
// back whole.
TEST_P(SpillTest, AMissingPageCutsOnlyItsLayer) {
  const std::string dir = FreshDir("missing");
  std::string id;
  {
    Store s = OpenStore(dir);
    auto session = s.store->Create(Config(), "", absl::Now());
    ASSERT_TRUE(session.ok());
    Append(*s.store, **session, 130, 1);
    id = (*session)->id();
    std::lock_guard<std::mutex> lock((*session)->mutex());
    ASSERT_TRUE(s.store->residency().Demote(**session).ok());  // the tails (2 tokens) are written now
    ASSERT_TRUE(s.store->residency().tier()->Sync().ok());
  }
  // Walk the records: the page record of layer 0, index 0 gets a flipped byte.
  bool damaged = false;
  for (const std::string& path : Segments(dir)) {
    std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
    std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    for (size_t at = 0; at + 28 <= bytes.size() && !damaged;) {
      uint32_t header = 0, payload = 0;
      std::memcpy(&header, bytes.data() + at + 16, 4);
      std::memcpy(&payload, bytes.data() + at + 20, 4);
      Reader in(absl::string_view(bytes).substr(at + 24, header));
      in.GetString();
      in.GetString();
      const int32_t layer = in.Get<int32_t>(), index = in.Get<int32_t>();
      if (bytes[at + 6] == 1 && layer == 0 && index == 0) {
        bytes[at + 24 + header] ^= 1;
        file.seekp(0);
        file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        damaged = true;
      }
      at += 24 + header + payload + 4;
    }
  }
  ASSERT_TRUE(damaged);
  Store s = OpenStore(dir);
  EXPECT_EQ(s.scan.torn, 1);
  EXPECT_TRUE(s.scan.damaged.empty());
  auto session = s.store->Find(id, "", absl::Now());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(LayerTokens(**session), (std::vector<int64_t>{0, 130}));
}

TEST_P(SpillTest, AFullBudgetDemotesInsteadOfEvictingAndNothingIsLost) {
  const std::string dir = FreshDir("lru");
  // Pages of 64 tokens x 2 heads x (52 + 136) bytes: ~24 KiB; 16 sessions
  // of 2 layers x 4 pages take ~3 MiB against a 1 MiB budget.
  Store s = OpenStore(dir, size_t{1} << 20);
  std::vector<std::shared_ptr<SessionCache>> sessions;
  std::vector<std::vector<float>> contents;
  for (int i = 0; i < 16; ++i) {
    auto session = s.store->Create(Config(), "", absl::Now());
    ASSERT_TRUE(session.ok()) << session.status();
    Append(*s.store, **session, 250, 100 + i);
    contents.push_back(Contents(*s.store, **session));
    sessions.push_back(*session);
  }
  EXPECT_LE(s.store->pool().used_bytes(), size_t{1} << 20);
  EXPECT_GT(s.store->Snapshot().demotions, 8);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(Contents(*s.store, *sessions[i]), contents[i]) << "session " << i;
  EXPECT_EQ(s.store->Snapshot().lru_evictions, 0);
}

TEST_P(SpillTest, APinnedSessionIsNeverDemoted) {
  const std::string dir = FreshDir("pinned");
  Store s = OpenStore(dir, size_t{1} << 20);
  SessionConfig pinned_config = Config();
  pinned_config.pinned = true;
  auto pinned = s.store->Create(pinned_config, "", absl::Now());
  ASSERT_TRUE(pinned.ok());
  Append(*s.store, **pinned, 250, 1);
  for (int i = 0; i < 12; ++i) {
    auto session = s.store->Create(Config(), "", absl::Now());
    ASSERT_TRUE(session.ok());
    Append(*s.store, **session, 250, 10 + i);
  }
  s.store->Rebalance();
  EXPECT_GT(s.store->Snapshot().demotions, 4);
  std::lock_guard<std::mutex> lock((*pinned)->mutex());
  EXPECT_TRUE((*pinned)->resident());
}

// A promotion whose room is held by a session in a call waits for the call
// to end, then demotes it and comes back (before: RESOURCE_EXHAUSTED at once).
TEST_P(SpillTest, APromotionWaitsForTheCallHoldingItsRoom) {
  RoomHeld r = HoldTheRoom("wait");
  Store& s = r.s;
  std::shared_ptr<SessionCache>* waiting = &r.waiting;
  std::shared_ptr<SessionCache>* busy = &r.busy;
  std::unique_lock<std::mutex> call((*busy)->mutex());  // a call on it
  std::thread ends([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    call.unlock();
  });
  const absl::Time start = absl::Now();
  {
    std::lock_guard<std::mutex> lock((*waiting)->mutex());
    const SessionCache* held[] = {waiting->get()};
    const absl::Status promoted = s.store->residency().Promote(**waiting, held);
    EXPECT_TRUE(promoted.ok()) << promoted;
    EXPECT_TRUE((*waiting)->resident());
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  ends.join();
  std::lock_guard<std::mutex> lock((*busy)->mutex());
  EXPECT_FALSE((*busy)->resident());
}

// A promotion waits for room until its call's deadline, not a fixed
// patience (issue 58 item 8): one whose deadline comes first fails then,
// saying how long it waited; one with time left comes back once the call
// holding the room ends.
TEST_P(SpillTest, APromotionWaitsForRoomUntilItsCallsDeadline) {
  RoomHeld r = HoldTheRoom("deadline");
  Store& s = r.s;
  std::shared_ptr<SessionCache>* waiting = &r.waiting;
  std::shared_ptr<SessionCache>* busy = &r.busy;
  std::unique_lock<std::mutex> call((*busy)->mutex());  // a call on it, for 1.5 s
  std::thread ends([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    call.unlock();
  });
  std::lock_guard<std::mutex> lock((*waiting)->mutex());
  const SessionCache* held[] = {waiting->get()};
  absl::Time start = absl::Now();
  const absl::Status hurried = s.store->residency().Promote(**waiting, held, nullptr, start + absl::Milliseconds(200));
  EXPECT_EQ(hurried.code(), absl::StatusCode::kResourceExhausted) << hurried;
  EXPECT_TRUE(absl::StrContains(hurried.message(), "for the calls holding memory to end")) << hurried;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  start = absl::Now();
  const absl::Status patient = s.store->residency().Promote(**waiting, held, nullptr, start + absl::Seconds(30));
  EXPECT_TRUE(patient.ok()) << patient;
  EXPECT_TRUE((*waiting)->resident());
  ends.join();
}

TEST_P(SpillTest, BothTiersFullIsResourceExhaustedNamingBoth) {
  const std::string dir = FreshDir("full");
  Store s = OpenStore(dir, size_t{1} << 20, size_t{1} << 20);
  absl::Status last;
  for (int i = 0; i < 16 && last.ok(); ++i) {
    auto session = s.store->Create(Config(), "", absl::Now());
    if (!session.ok()) {
      last = session.status();
      break;
    }
    std::lock_guard<std::mutex> lock((*session)->mutex());
    LayerCache& layer = (*session)->layers()[0];
    const auto k = GaussianVectors(250 * kHeads, kDim, i);
    const SessionCache* held[] = {session->get()};
    last = s.store->MakeRoom(layer.BytesToAppend(0, 250), held);
    if (last.ok()) last = layer.Append(0, 250, k.data(), k.data()).status();
    s.store->residency().WriteThrough(**session, false).IgnoreError();
  }
  ASSERT_FALSE(last.ok());
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_TRUE(absl::StrContains(last.message(), "memory budget")) << last;
  EXPECT_TRUE(absl::StrContains(last.message(), "spill")) << last;
}

TEST_P(SpillTest, TheBackgroundPassDemotesAboveTheWatermarkAndDropsTheOldestOnDisk) {
  const std::string dir = FreshDir("watermarks");
  const size_t page = size_t{kHeads} * kPage *
                      (MakeCodecLayout(CodecKind::kTurbo3, kDim).code_size() +
                       MakeCodecLayout(CodecKind::kQ8_0, kDim).code_size());
  // 10 sessions of 2 layers x 500 tokens: 160 pages in memory at most, 140
  // sealed ones written through.
  const size_t memory = 150 * page, disk = 160 * page;
  Store s = OpenStore(dir, memory, disk);
  std::vector<std::shared_ptr<SessionCache>> sessions;
  for (int i = 0; i < 10; ++i) {
    auto session = s.store->Create(Config(), "", absl::Now());
    ASSERT_TRUE(session.ok());
    Append(*s.store, **session, 500, 300 + i);
    sessions.push_back(*session);
  }
  ASSERT_GT(static_cast<double>(s.store->pool().used_bytes()), 0.9 * memory);
  // One pass: idle sessions are demoted below the memory low watermark;
  // then the tier, past its high watermark with their tails, drops the
  // oldest sessions on disk only, whole, below its low one.
  const SessionStore::RebalanceReport report = s.store->Rebalance();
  EXPECT_TRUE(report.error.ok()) << report.error;
  EXPECT_GT(report.demoted, 0);
  EXPECT_LE(static_cast<double>(s.store->pool().used_bytes()), 0.8 * memory);
  ASSERT_FALSE(report.dropped.empty());
  EXPECT_EQ(report.dropped.front(), sessions.front()->id());
  const TierStats stats = s.store->residency().TierUse();
  EXPECT_LE(static_cast<double>(stats.live_bytes + stats.queued_bytes), 0.8 * disk);
  auto gone = s.store->Find(sessions.front()->id(), "", absl::Now());
  ASSERT_FALSE(gone.ok());
  EXPECT_TRUE(absl::StrContains(gone.status().message(), "the disk tier was over its high watermark (--spill-budget)"))
      << gone.status();
  EXPECT_EQ(s.store->Snapshot().disk_drops, static_cast<int64_t>(report.dropped.size()));
}

// Deleted sessions leave dead records in segments that a live one still
// uses: the writer copies the live records forward and the files shrink back
// to about what is live; the kept sessions read back as before and survive a
// restart.
TEST_P(SpillTest, SegmentsOfMostlyDeadRecordsAreCompacted) {
  const std::string dir = FreshDir("compact");
  std::vector<std::string> kept;
  std::vector<std::vector<float>> contents;
  {
    Store s = OpenStore(dir);  // 1 MiB segments
    std::vector<std::shared_ptr<SessionCache>> sessions;
    for (int i = 0; i < 24; ++i) {
      auto session = s.store->Create(Config(), "", absl::Now());
      ASSERT_TRUE(session.ok());
      sessions.push_back(*session);
    }
    // Interleaved appends: every segment holds pages of every session.
    for (int round = 0; round < 4; ++round) {
      for (int i = 0; i < 24; ++i) Append(*s.store, *sessions[i], 64, 1000 * round + i);
    }
    for (int i = 0; i < 24; ++i) {
      if (i % 6 == 0) {
        kept.push_back(sessions[i]->id());
        contents.push_back(Contents(*s.store, *sessions[i]));
      } else {
        ASSERT_TRUE(s.store->Delete(sessions[i]->id(), "").ok());
      }
    }
    TierStats stats = s.store->residency().TierUse();
    for (absl::Time until = absl::Now() + absl::Seconds(10);
         stats.bytes * 3 > stats.live_bytes * 4 + 3 * (2 << 20) && absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(20))) {
      stats = s.store->residency().TierUse();
    }
    EXPECT_GT(stats.compactions, 0);
    // 4/3 of the live records, plus two segments: the active one (its dead
    // records wait until it is full) and one closed below the threshold.
    EXPECT_LE(stats.bytes * 3, stats.live_bytes * 4 + 3 * (2 << 20))
        << stats.bytes << " bytes of files, " << stats.live_bytes << " live";
    for (size_t k = 0; k < kept.size(); ++k) {
      auto session = s.store->Find(kept[k], "", absl::Now());
      ASSERT_TRUE(session.ok());
      {
        std::lock_guard<std::mutex> lock((*session)->mutex());
        ASSERT_TRUE(s.store->residency().Demote(**session).ok());
      }
      EXPECT_EQ(Contents(*s.store, **session), contents[k]);
    }
  }
  Store s = OpenStore(dir);
  EXPECT_EQ(s.scan.loaded, static_cast<int64_t>(kept.size()));
  EXPECT_EQ(s.scan.torn, 0);
  for (size_t k = 0; k < kept.size(); ++k) {
    auto session = s.store->Find(kept[k], "", absl::Now());
    ASSERT_TRUE(session.ok());
    EXPECT_EQ(Contents(*s.store, **session), contents[k]);
  }
}

TEST_P(SpillTest, ADirectoryThatCannotBeWrittenIsRefusedNamingIt) {
  if (geteuid() == 0) {
    // root writes anywhere: a path under a regular file cannot be created.
    const std::string file = FreshDir("file");
    std::ofstream(file) << "x";
    auto tier = DiskTier::Open(DiskTierOptions{file + "/spill"});
    ASSERT_FALSE(tier.ok());
    EXPECT_TRUE(absl::StrContains(tier.status().message(), file + "/spill")) << tier.status();
    return;
  }
  const std::string dir = FreshDir("readonly");
  ASSERT_EQ(mkdir(dir.c_str(), 0500), 0);
  auto tier = DiskTier::Open(DiskTierOptions{dir});
  ASSERT_FALSE(tier.ok());
  EXPECT_TRUE(absl::StrContains(tier.status().message(), dir)) << tier.status();
}

INSTANTIATE_TEST_SUITE_P(Devices, SpillTest, ::testing::ValuesIn(testing::TestBackends()), testing::DeviceTestName);

}  // namespace
}  // namespace turbokv
