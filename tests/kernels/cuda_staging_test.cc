// The host side of CudaStream's calls, on every machine: each call is staged
// with a second host buffer standing in for the device's, the copies in and
// back done with memcpy and the kernels' work done by the CPU over the staged
// descriptors. What comes out must be what the CPU computes from the
// caller's own arguments, to the bit.
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cuda/cuda_staging.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/codec_testing.h"
#include "tests/kernels/layer_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;

// A host buffer and the stand-in for the device's, sized from a layout.
struct Buffers {
  std::vector<uint8_t> host, device;
  explicit Buffers(const cuda::StagingLayout& layout) : host(layout.host_bytes, 0xee), device(layout.device_bytes, 0xdd) {
    EXPECT_LE(layout.up, layout.down_begin);
    EXPECT_LE(layout.down_begin, layout.down_end);
    EXPECT_EQ(layout.down_end, layout.host_bytes);
    EXPECT_LE(layout.host_bytes, layout.device_bytes);
  }
  void CopyIn(const cuda::StagingLayout& layout) { std::memcpy(device.data(), host.data(), layout.up); }
  void CopyBack(const cuda::StagingLayout& layout) {
    std::memcpy(host.data() + layout.down_begin, device.data() + layout.down_begin, layout.down_end - layout.down_begin);
  }
};

TEST(AttentionStagingTest, TheStagedBatchGivesTheCallersOwnResults) {
  constexpr int kKv = 2, kQ = 8, kDim = 128, kPage = 16;
  const std::pair<CodecKind, CodecKind> codecs[] = {{CodecKind::kTurbo3, CodecKind::kTurbo3},
                                                    {CodecKind::kQ8_0, CodecKind::kF16},
                                                    {CodecKind::kTurbo4, CodecKind::kTurbo2}};
  const int64_t tokens[] = {40, 3, 200};
  const int64_t queries[] = {2, 1, 3};
  std::vector<std::unique_ptr<PagedCacheBuffer>> caches;
  std::vector<std::vector<float>> q(3);
  std::vector<std::vector<int64_t>> positions(3);
  for (int i = 0; i < 3; ++i) {
    caches.push_back(*PagedCacheBuffer::Create({codecs[i].first, kDim, 10u + i}, {codecs[i].second, kDim, 20u + i},
                                               kKv, kPage));
    const auto k = GaussianVectors(tokens[i] * kKv, kDim, 30 + i), v = GaussianVectors(tokens[i] * kKv, kDim, 40 + i);
    caches[i]->Append(tokens[i], k.data(), v.data());
    q[i] = GaussianVectors(queries[i] * kQ, kDim, 50 + i);
    for (int64_t j = 0; j < queries[i]; ++j) positions[i].push_back(tokens[i] - 1 - j);
  }
  AttentionParams params;
  params.q_heads = kQ;
  params.top_k = 3;
  params.window = 25;
  // Outputs: [0] by the CPU from the caller's arguments, [1] through staging.
  std::vector<std::vector<float>> out[2], lse[2], top_logits[2];
  std::vector<std::vector<int64_t>> top_tokens[2];
  std::vector<AttentionProblem> problems[2];
  for (int side = 0; side < 2; ++side) {
    for (int i = 0; i < 3; ++i) {
      const size_t rows = static_cast<size_t>(queries[i]) * kQ;
      out[side].emplace_back(rows * kDim, std::nanf(""));
      lse[side].emplace_back(rows, std::nanf(""));
      top_logits[side].emplace_back(rows * params.top_k);
      top_tokens[side].emplace_back(rows * params.top_k);
      problems[side].push_back(AttentionProblem{
          caches[i]->descriptor(), {queries[i], q[i].data(), positions[i].data()},
          {out[side][i].data(), lse[side][i].data(), top_tokens[side][i].data(), top_logits[side][i].data()}});
    }
  }
  ASSERT_TRUE(AttendCpu(AttentionBatch{problems[0].data(), 3}, params).ok());

  cuda::AttentionStaging staging(problems[1].data(), 3, params);
  Buffers buffers(staging.layout());
  const std::vector<cuda::DeviceProblem>& described = staging.Fill(buffers.host.data(), buffers.device.data());
  buffers.CopyIn(staging.layout());
  // The descriptors went over with the inputs; the scratch follows the results.
  ASSERT_EQ(std::memcmp(staging.device_problems(buffers.device.data()), described.data(),
                        described.size() * sizeof(cuda::DeviceProblem)),
            0);
  EXPECT_GE(static_cast<uint8_t*>(staging.workspace(buffers.device.data())),
            buffers.device.data() + staging.layout().down_end);
  EXPECT_EQ(staging.layout().device_bytes,
            static_cast<size_t>(static_cast<uint8_t*>(staging.workspace(buffers.device.data())) - buffers.device.data()) +
                staging.plan().workspace_bytes(kDim));
  // The "kernels": the CPU over the staged descriptors, into the staged outputs.
  std::vector<AttentionProblem> staged;
  for (const cuda::DeviceProblem& p : described) {
    staged.push_back(
        AttentionProblem{p.cache, {p.n, p.q, p.positions, p.logit_offset}, {p.out, p.lse, p.topk_tokens, p.topk_logits}});
  }
  ASSERT_TRUE(AttendCpu(AttentionBatch{staged.data(), 3}, params).ok());
  buffers.CopyBack(staging.layout());
  staging.Deliver(buffers.host.data());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(out[1][i].data(), out[0][i].data(), out[0][i].size() * sizeof(float)), 0) << i;
    EXPECT_EQ(std::memcmp(lse[1][i].data(), lse[0][i].data(), lse[0][i].size() * sizeof(float)), 0) << i;
    EXPECT_EQ(top_tokens[1][i], top_tokens[0][i]) << i;
    EXPECT_EQ(std::memcmp(top_logits[1][i].data(), top_logits[0][i].data(), top_logits[0][i].size() * sizeof(float)), 0)
        << i;
  }
}

TEST(EncodeStagingTest, TheStagedChunksWriteTheCpusBytesAndDeliverEachVectorsError) {
  constexpr int kKv = 3, kDim = 64, kPage = 16;
  struct Shape {
    CodecKind k, v;
    int64_t first, end;
  };
  const Shape shapes[] = {{CodecKind::kTurbo3, CodecKind::kTurbo3, 0, 40},
                          {CodecKind::kF16, CodecKind::kTurbo3, 17, 18},
                          {CodecKind::kTurbo3, CodecKind::kQ4_0, 33, 60},
                          {CodecKind::kTurbo3, CodecKind::kTurbo3, 20, 20}};  // nothing new: skipped
  std::vector<std::unique_ptr<testing::HostLayer>> cpu, staged;
  std::vector<std::vector<float>> k, v;
  std::vector<EncodeChunk> cpu_chunks, staged_chunks;
  std::vector<EncodeStats> stats(2 * 4);
  testing::HostLayer shared(CodecKind::kTurbo3, CodecKind::kQ4_0, kDim, kKv, kPage, kPage, 7);
  for (size_t i = 0; i < 4; ++i) {
    const Shape& s = shapes[i];
    cpu.push_back(std::make_unique<testing::HostLayer>(s.k, s.v, kDim, kKv, kPage, s.end, 100 + 2 * i));
    staged.push_back(std::make_unique<testing::HostLayer>(s.k, s.v, kDim, kKv, kPage, s.end, 100 + 2 * i));
    k.push_back(GaussianVectors((s.end - s.first) * kKv, kDim, 200 + i));
    v.push_back(GaussianVectors((s.end - s.first) * kKv, kDim, 300 + i));
    for (auto* side : {&cpu, &staged}) {
      EncodeChunk chunk;
      chunk.key_codec = (*side)[i]->keys.get();
      chunk.value_codec = (*side)[i]->values.get();
      chunk.cache = (*side)[i]->cache;
      chunk.first = s.first;
      chunk.keys = k[i].data();
      chunk.values = v[i].data();
      if (i == 2) chunk.copy_from = shared.table[0];  // starts in a page shared with a fork
      if (side == &staged) {
        chunk.key_errors = &stats[2 * i];
        chunk.value_errors = &stats[2 * i + 1];
      }
      (side == &cpu ? cpu_chunks : staged_chunks).push_back(chunk);
    }
  }
  for (size_t i = 0; i < 4; ++i) {
    cpu[i]->Zero(NewPages(cpu_chunks[i]));  // as the CPU backend gives new pages
    EncodeChunkCpu(cpu_chunks[i], nullptr);
  }

  cuda::EncodeStaging staging(staged_chunks);
  Buffers buffers(staging.layout());
  staging.Fill(buffers.host.data(), buffers.device.data());
  buffers.CopyIn(staging.layout());
  ASSERT_EQ(staging.copies().size(), 1u);
  for (const cuda::EncodeStaging::PageCopy& copy : staging.copies()) std::memcpy(copy.to, copy.from, copy.bytes);
  // The new pages, zeroed: layer 0's three, layer 1's none (token 17 is in
  // page 1, already begun), layer 2's page 3 (page 2 is the shared copy).
  ASSERT_EQ(staging.zero_count(), 4u);
  const ZeroedPage* zeroes = staging.zeroes(buffers.device.data());
  for (size_t z = 0; z < staging.zero_count(); ++z) {
    EXPECT_EQ(zeroes[z].bytes, staged[z < 3 ? 0 : 2]->cache.page_bytes()) << z;
    std::memset(zeroes[z].page, 0, zeroes[z].bytes);
  }
  EXPECT_EQ(zeroes[0].page, staged[0]->table[0]);
  EXPECT_EQ(zeroes[3].page, staged[2]->table[3]);
  // The "kernels": each located vector encoded by the CPU codec of its
  // layout and seed; each block's error set to a number that names it.
  std::map<std::pair<CodecKind, uint64_t>, std::unique_ptr<Codec>> codecs;
  double next_error = 1;
  EXPECT_EQ(staging.launches().size(), 3u);  // turbo3, f16, q4_0 (d = 64)
  for (const cuda::EncodeStaging::Launch& launch : staging.launches()) {
    for (size_t x = 0; x < launch.vectors; ++x) {
      const ChunkVector vector = LocateChunkVector(launch.chunks, launch.count, static_cast<int64_t>(x), kDim);
      std::unique_ptr<Codec>& codec = codecs[{launch.layout.kind, vector.seed}];
      if (codec == nullptr) codec = *MakeCpuCodec({launch.layout.kind, kDim, vector.seed}, CpuPath::kScalar);
      codec->Encode(1, vector.x, vector.record);
      for (int b = 0; b < launch.layout.blocks; ++b) {
        QuantizationError& error = launch.errors[x * launch.layout.blocks + b];
        error = QuantizationError();
        error.error_sq = next_error;
        error.norm_sq = 4 * next_error;  // e = 1/2 for every vector
        error.fields = 1;
        next_error += 1;
      }
    }
  }
  buffers.CopyBack(staging.layout());
  staging.Deliver(buffers.host.data());
  // A new page's slots past the chunk hold zeros; a begun page keeps its bytes.
  const PagedKvCache& layer0 = staged[0]->cache;
  for (int h = 0; h < kKv; ++h) {
    const uint8_t* page = staged[0]->table[2];
    for (size_t b = layer0.key_offset(h, 40 - 32); b < layer0.key_offset(h, kPage); ++b) ASSERT_EQ(page[b], 0) << h;
    for (size_t b = layer0.value_offset(h, 40 - 32); b < layer0.value_offset(h, kPage); ++b) ASSERT_EQ(page[b], 0) << h;
  }
  EXPECT_EQ(staged[1]->table[1][staged[1]->cache.key_offset(0, 0)], 1 * 37 + 1);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(staged[i]->pages, cpu[i]->pages) << "layer " << i;
    for (int part = 0; part < 2; ++part) {
      const EncodeStats& s = stats[2 * i + part];
      const CodecLayout& layout = part == 0 ? cpu[i]->cache.key_layout : cpu[i]->cache.value_layout;
      const uint64_t vectors = static_cast<uint64_t>(shapes[i].end - shapes[i].first) * kKv;
      EXPECT_EQ(s.vectors, vectors) << i << " " << part;
      EXPECT_EQ(s.fp16_fields, vectors * layout.blocks) << i << " " << part;
      EXPECT_NEAR(s.error_sum, 0.5 * vectors, 1e-9) << i << " " << part;
    }
  }
}

TEST(DecodeStagingTest, TheStagedRangeDecodesToTheCpusFloats) {
  constexpr int kKv = 2, kDim = 128, kPage = 16;
  auto cache = PagedCacheBuffer::Create({CodecKind::kTurbo4, kDim, 5}, {CodecKind::kQ8_0, kDim, 6}, kKv, kPage);
  ASSERT_TRUE(cache.ok());
  const auto k = GaussianVectors(100 * kKv, kDim, 1), v = GaussianVectors(100 * kKv, kDim, 2);
  (*cache)->Append(100, k.data(), v.data());
  auto keys = *MakeCpuCodec({CodecKind::kTurbo4, kDim, 5}, CpuPath::kScalar);
  auto values = *MakeCpuCodec({CodecKind::kQ8_0, kDim, 6}, CpuPath::kScalar);
  const int64_t first = 37, n = 41;  // pages 2 to 4 of 7
  const size_t floats = static_cast<size_t>(n) * kKv * kDim;
  std::vector<float> cpu_k(floats), cpu_v(floats), staged_k(floats, std::nanf("")), staged_v(floats, std::nanf(""));
  DecodeCpu(*keys, *values, (*cache)->descriptor(), first, n, cpu_k.data(), cpu_v.data());

  cuda::DecodeStaging staging((*cache)->descriptor(), first, n, staged_k.data(), staged_v.data());
  Buffers buffers(staging.layout());
  const VectorChunk* chunks = staging.Fill(buffers.host.data(), buffers.device.data());
  buffers.CopyIn(staging.layout());
  // Only the range's pages' table is staged: from page 2 on.
  EXPECT_EQ(chunks[0].first_page, 2);
  EXPECT_EQ(chunks[0].pages[0], (*cache)->descriptor().pages[2]);
  EXPECT_EQ(chunks[1].pages[2], (*cache)->descriptor().pages[4]);
  for (int part = 0; part < 2; ++part) {
    const Codec& codec = part == 0 ? *keys : *values;
    for (size_t x = 0; x < staging.vectors(); ++x) {
      const ChunkVector vector = LocateChunkVector(chunks + part, 1, static_cast<int64_t>(x), kDim);
      codec.Decode(1, vector.record, vector.x);
    }
  }
  buffers.CopyBack(staging.layout());
  staging.Deliver(buffers.host.data());
  EXPECT_EQ(std::memcmp(staged_k.data(), cpu_k.data(), floats * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(staged_v.data(), cpu_v.data(), floats * sizeof(float)), 0);
}

}  // namespace
}  // namespace turbokv
