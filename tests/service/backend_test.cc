// What the backends' host-side logic does, on every machine: the device
// arena's allocator, the choice of device and its errors, the CPU backend's
// pages.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "service/backend/arena.h"
#include "service/backend/cpu_backend.h"
#include "service/device.h"
#include "tests/kernels/codec_testing.h"
#include "tests/kernels/layer_testing.h"
#include "tests/service/backend_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;

TEST(ArenaAllocatorTest, RangesAreAlignedDisjointAndComeBackWhole) {
  ArenaAllocator arena(10000, 256);  // 39 ranges of 256 (9984 bytes)
  EXPECT_EQ(arena.usage().capacity, 9984u);
  const std::optional<size_t> a = arena.Allocate(1);
  const std::optional<size_t> b = arena.Allocate(300);  // 512
  const std::optional<size_t> c = arena.Allocate(256);
  ASSERT_TRUE(a && b && c);
  for (size_t offset : {*a, *b, *c}) EXPECT_EQ(offset % 256, 0u);
  EXPECT_EQ(arena.usage().used, 256u + 512 + 256);
  EXPECT_FALSE(arena.Allocate(9984 - 1024 + 1).has_value());  // one byte more than is left
  const std::optional<size_t> rest = arena.Allocate(9984 - 1024);
  ASSERT_TRUE(rest.has_value());
  EXPECT_FALSE(arena.Allocate(1).has_value());
  EXPECT_EQ(arena.usage().largest_free, 0u);
  // Freed in an order that leaves holes, then merged back into one range.
  arena.Free(*b, 300);
  EXPECT_EQ(arena.usage().free_ranges, 1u);
  EXPECT_EQ(arena.usage().largest_free, 512u);
  arena.Free(*rest, 9984 - 1024);
  EXPECT_EQ(arena.usage().free_ranges, 2u);
  arena.Free(*a, 1);
  arena.Free(*c, 256);
  const ArenaAllocator::Usage usage = arena.usage();
  EXPECT_EQ(usage.used, 0u);
  EXPECT_EQ(usage.free_ranges, 1u);
  EXPECT_EQ(usage.largest_free, 9984u);
}

TEST(ArenaAllocatorTest, BestFitKeepsTheLargeRangeForALargePage) {
  ArenaAllocator arena(64 << 10, 256);
  std::vector<size_t> small;
  for (int i = 0; i < 8; ++i) small.push_back(*arena.Allocate(1024));
  const size_t big = *arena.Allocate(16 << 10);
  arena.Free(small[1], 1024);  // a 1 KiB hole, and the big tail after `big`
  const size_t again = *arena.Allocate(1024);
  EXPECT_EQ(again, small[1]);  // the hole that fits, not the tail
  EXPECT_EQ(arena.usage().largest_free, (64u << 10) - 8 * 1024 - (16 << 10));
  arena.Free(big, 16 << 10);
}

// Pages of mixed sizes taken and given back from several threads at once:
// no two live ranges overlap, and the arena ends whole.
TEST(ArenaAllocatorTest, ManyThreadsNeverGetOverlappingRanges) {
  constexpr size_t kCapacity = size_t{8} << 20;
  ArenaAllocator arena(kCapacity, 256);
  std::vector<std::atomic<int>> owner(kCapacity / 256);
  for (auto& o : owner) o = -1;
  std::atomic<int> overlaps{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      std::vector<std::pair<size_t, size_t>> held;
      for (int i = 0; i < 5000; ++i) {
        if (!held.empty() && random() % 2 == 0) {
          const size_t k = random() % held.size();
          const auto [offset, bytes] = held[k];
          for (size_t u = offset / 256; u < (offset + bytes + 255) / 256; ++u) owner[u] = -1;
          arena.Free(offset, bytes);
          held.erase(held.begin() + static_cast<long>(k));
          continue;
        }
        const size_t bytes = 1 + random() % (64 << 10);
        const std::optional<size_t> offset = arena.Allocate(bytes);
        if (!offset.has_value()) {
          ++refused;
          continue;
        }
        for (size_t u = *offset / 256; u < (*offset + bytes + 255) / 256; ++u) {
          int free_unit = -1;
          if (!owner[u].compare_exchange_strong(free_unit, t)) ++overlaps;
        }
        held.emplace_back(*offset, bytes);
      }
      for (const auto& [offset, bytes] : held) {
        for (size_t u = offset / 256; u < (offset + bytes + 255) / 256; ++u) owner[u] = -1;
        arena.Free(offset, bytes);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(overlaps.load(), 0);
  const ArenaAllocator::Usage usage = arena.usage();
  EXPECT_EQ(usage.used, 0u);
  EXPECT_EQ(usage.free_ranges, 1u);
  EXPECT_EQ(usage.largest_free, kCapacity);
}

TEST(CpuBackendTest, PagesAreZeroedHostMemoryReadAndWrittenInPlace) {
  ThreadPool pool(2);
  CpuBackend backend(&pool);
  EXPECT_THAT(backend.name(), HasSubstr("cpu (simd:"));
  EXPECT_THAT(backend.name(), HasSubstr("2 threads"));
  EXPECT_EQ(backend.label(), "cpu");
  EXPECT_EQ(backend.capacity_bytes(), 0u);
  EXPECT_TRUE(backend.CheckHeadDim(kMaxHeadDim).ok());
  // Pages of f16 keys and values (512 bytes a token and head at d = 128):
  // under, at and over the size mapped on its own.
  for (int kv_heads : {1, static_cast<int>(CpuBackend::kMapThreshold / (16 * 512)), 40}) {
    const PageFormat format{MakeCodecLayout(CodecKind::kF16, 128), MakeCodecLayout(CodecKind::kF16, 128), kv_heads, 16,
                            PageOrder::kCanonical};
    const size_t bytes = format.page_bytes();
    absl::StatusOr<uint8_t*> page = backend.AllocatePage(bytes);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_TRUE(std::all_of(*page, *page + bytes, [](uint8_t b) { return b == 0; })) << bytes;
    ASSERT_TRUE(backend
                    .WritePage(format, *page,
                               [&](uint8_t* data, size_t n) {
                                 EXPECT_EQ(data, *page);  // in place: no copy on the CPU
                                 std::memset(data, 0x5a, n);
                                 return absl::OkStatus();
                               })
                    .ok());
    ASSERT_TRUE(backend
                    .ReadPage(format, *page,
                              [&](absl::string_view view) {
                                EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.data()), *page);
                                EXPECT_EQ(view, std::string(bytes, '\x5a'));
                                return absl::OkStatus();
                              })
                    .ok());
    // fill's error is the write's.
    EXPECT_EQ(backend.WritePage(format, *page, [](uint8_t*, size_t) { return absl::DataLossError("torn"); }).code(),
              absl::StatusCode::kDataLoss);
    backend.FreePage(*page, bytes);
  }
}

// A codec that encodes with another and notes the threads it encodes on.
class WatchedCodec : public Codec {
 public:
  struct Threads {
    std::mutex mutex;
    std::set<std::thread::id> ids;
  };
  WatchedCodec(const Codec& inner, Threads* threads)
      : Codec(inner.spec(), inner.layout()), inner_(inner), threads_(threads) {}
  void Encode(size_t n, const float* x, uint8_t* codes, EncodeStats* stats) const override {
    {
      std::lock_guard<std::mutex> lock(threads_->mutex);
      threads_->ids.insert(std::this_thread::get_id());
    }
    inner_.Encode(n, x, codes, stats);
  }
  void Decode(size_t n, const uint8_t* codes, float* x) const override { inner_.Decode(n, codes, x); }
  std::string implementation() const override { return inner_.implementation(); }

 private:
  const Codec& inner_;
  Threads* threads_;
};

// A Decode message's appends: a token or a few for each of many sessions.
// Together they are a large encode, which a daemon's pool runs on its
// background workers while the caller waits; a few chunks run on the
// caller. Either way each layer's pages are those its chunk writes alone.
TEST(CpuBackendTest, ManySmallChunksEncodeOnTheWorkersAndWriteWhatEachChunkWritesAlone) {
  constexpr int kKvHeads = 8, kPage = 16, kDim = 64;
  ThreadPool pool(2, /*background_from=*/64);
  CpuBackend backend(&pool);
  for (const int layers : {3, 40}) {  // 24 and 320 token x kv heads: below and past a large encode
    WatchedCodec::Threads threads;
    std::vector<std::unique_ptr<WatchedCodec>> watched;
    std::vector<std::unique_ptr<testing::HostLayer>> batched, alone;
    std::vector<std::vector<float>> keys, values;
    std::vector<EncodeChunk> chunks;
    for (int i = 0; i < layers; ++i) {
      const int64_t first = 4 + i;  // one new token, on a page of its own or not
      keys.push_back(testing::GaussianVectors(kKvHeads, kDim, 100 + i));
      values.push_back(testing::GaussianVectors(kKvHeads, kDim, 200 + i));
      for (auto* set : {&batched, &alone}) {
        set->push_back(std::make_unique<testing::HostLayer>(CodecKind::kTurbo3, CodecKind::kTurbo4, kDim, kKvHeads,
                                                            kPage, first + 1, 7 + i));
        EncodeChunk chunk;
        chunk.key_codec = (*set)[i]->keys.get();
        chunk.value_codec = (*set)[i]->values.get();
        chunk.cache = (*set)[i]->cache;
        chunk.first = first;
        chunk.keys = keys[i].data();
        chunk.values = values[i].data();
        if (set == &alone) {
          EncodeChunkCpu(chunk, nullptr);
        } else {
          watched.push_back(std::make_unique<WatchedCodec>(*chunk.key_codec, &threads));
          chunk.key_codec = watched.back().get();
          watched.push_back(std::make_unique<WatchedCodec>(*chunk.value_codec, &threads));
          chunk.value_codec = watched.back().get();
          chunks.push_back(chunk);
        }
      }
    }
    ASSERT_TRUE(backend.Encode(chunks).ok());
    for (int i = 0; i < layers; ++i) EXPECT_EQ(batched[i]->pages, alone[i]->pages) << layers << " layers, layer " << i;
    if (layers == 3) {
      EXPECT_EQ(threads.ids, std::set<std::thread::id>{std::this_thread::get_id()});
    } else {
      EXPECT_EQ(threads.ids.count(std::this_thread::get_id()), 0u);
    }
  }
}

TEST(CpuBackendTest, AFreedMappedPageIsReusedZeroedUntilTwoTrimsPass) {
  CpuBackend backend;
  const size_t bytes = CpuBackend::kMapThreshold * 2;
  auto written = [&](uint8_t* page) {
    std::memset(page, 0x5a, bytes);
    backend.FreePage(page, bytes);
    return page;
  };
  // Freed, then asked for again: the same memory, zeroed again.
  uint8_t* first = written(*backend.AllocatePage(bytes));
  absl::StatusOr<uint8_t*> again = backend.AllocatePage(bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, first);
  EXPECT_TRUE(std::all_of(*again, *again + bytes, [](uint8_t b) { return b == 0; }));
  // Another size does not take it.
  absl::StatusOr<uint8_t*> other = backend.AllocatePage(bytes + 4096);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*other, *again);
  backend.FreePage(*other, bytes + 4096);
  // Kept through one pass, given back at the second.
  written(*again);
  backend.Trim();
  absl::StatusOr<uint8_t*> kept = backend.AllocatePage(bytes);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, first);
  written(*kept);
  backend.Trim();
  backend.Trim();
  absl::StatusOr<uint8_t*> fresh = backend.AllocatePage(bytes);
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(std::all_of(*fresh, *fresh + bytes, [](uint8_t b) { return b == 0; }));
  backend.FreePage(*fresh, bytes);
}

TEST(DeviceChoiceTest, CpuAutoAndCudaSayWhatTheyChoseAndWhy) {
  ThreadPool pool(2);
  absl::StatusOr<DeviceChoice> cpu = ChooseDevice("cpu", &pool, 0, 2);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->backend->label(), "cpu");
  EXPECT_EQ(cpu->why, "--device=cpu");

  for (const char* bad : {"gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CPU"}) {
    absl::StatusOr<DeviceChoice> refused = ChooseDevice(bad, &pool, 0, 2);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("expected auto, cpu or cuda:N")) << bad;
  }

  absl::StatusOr<DeviceChoice> gpu = ChooseDevice("cuda:0", &pool, size_t{64} << 20, 2);
  absl::StatusOr<DeviceChoice> automatic = ChooseDevice("auto", &pool, size_t{64} << 20, 2);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  if (gpu.ok()) {
    EXPECT_EQ(gpu->backend->label(), "cuda:0");
    EXPECT_EQ(gpu->backend->capacity_bytes(), size_t{64} << 20);
    EXPECT_THAT(gpu->backend->name(), HasSubstr("page arena 0.1 GiB"));
    EXPECT_EQ(automatic->backend->label(), "cuda:0");
    EXPECT_EQ(automatic->why, "--device=auto: CUDA device 0 can serve");
    // A GPU that cannot hold the arena says so, with its numbers.
    absl::StatusOr<DeviceChoice> huge = ChooseDevice("cuda:0", &pool, size_t{1} << 50, 2);
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(huge.status().message()), HasSubstr("does not fit"));
    return;
  }
  // No GPU here: cuda:0 is refused saying why; auto takes the CPU, saying why.
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(gpu.status().message()), HasSubstr("--device=cuda:0: "));
  EXPECT_THAT(std::string(gpu.status().message()), HasSubstr("use --device=cpu, or auto to fall back to it"));
  EXPECT_EQ(automatic->backend->label(), "cpu");
  EXPECT_THAT(automatic->why, HasSubstr("--device=auto: no GPU ("));
  EXPECT_THAT(automatic->why, HasSubstr("sessions in host memory, kernels on the CPU"));
  // A GPU other than 0 is named in its own refusal.
  absl::StatusOr<DeviceChoice> third = ChooseDevice("cuda:3", &pool, 0, 2);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("cuda:3"));
}

}  // namespace
}  // namespace turbokv
