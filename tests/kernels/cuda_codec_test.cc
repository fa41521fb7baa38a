// The CUDA codecs against the scalar CPU reference. Skips, saying why, when no
// usable CUDA device is present.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/page_layout.h"
#include "kernels/paged_cache.h"
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

// One layer on both sides: host pages encoded by the CPU codecs, device
// pages by CudaStream::Encode, from the same starting bytes; the device's
// pages in `order` (the host's canonical bytes translated).
struct TwinLayer : testing::HostLayer {
  std::vector<const uint8_t*> device_table;
  PageOrder order;

  TwinLayer(CodecKind k, CodecKind v, int d, int kv_heads, int page_tokens, int64_t tokens, uint64_t seed,
            PageOrder order = PageOrder::kCanonical)
      : HostLayer(k, v, d, kv_heads, page_tokens, tokens, seed), order(order) {
    for (const std::vector<uint8_t>& bytes : pages) {
      void* page = nullptr;
      EXPECT_EQ(cudaMalloc(&page, cache.page_bytes()), cudaSuccess);
      device_table.push_back(static_cast<const uint8_t*>(page));
      Put(device_table.size() - 1, bytes);
    }
  }
  ~TwinLayer() {
    for (const uint8_t* page : device_table) cudaFree(const_cast<uint8_t*>(page));
  }
  PagedKvCache on_device() const {
    PagedKvCache d = cache;
    d.pages = device_table.data();
    d.order = order;
    return d;
  }
  // Device page i from canonical bytes.
  void Put(size_t i, const std::vector<uint8_t>& canonical) {
    std::vector<uint8_t> bytes(canonical.size());
    PageToOrder(on_device().format(), canonical.data(), bytes.data());
    EXPECT_EQ(cudaMemcpy(const_cast<uint8_t*>(device_table[i]), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  // Page i as the device holds it, in the canonical order.
  std::vector<uint8_t> DevicePage(size_t i) const {
    std::vector<uint8_t> bytes(cache.page_bytes()), canonical(cache.page_bytes());
    EXPECT_EQ(cudaMemcpy(bytes.data(), device_table[i], bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    PageToCanonical(on_device().format(), bytes.data(), canonical.data());
    return canonical;
  }
};

// The records of tokens [first, end) of one kv head, keys or values, in
// token order, from pages laid out as `cache`.
std::vector<uint8_t> Records(const PagedKvCache& cache, const std::vector<std::vector<uint8_t>>& pages, bool values,
                             int head, int64_t first, int64_t end) {
  std::vector<uint8_t> out;
  const size_t size = values ? cache.value_layout.code_size() : cache.key_layout.code_size();
  for (int64_t t = first; t < end; ++t) {
    const uint8_t* page = pages[t / cache.page_tokens].data();
    const size_t at = values ? cache.value_offset(head, t % cache.page_tokens) : cache.key_offset(head, t % cache.page_tokens);
    out.insert(out.end(), page + at, page + at + size);
  }
  return out;
}

// A Decode message's appends and a prefill's, in one encode: chunks of
// layers with different codecs, lengths and starting slots, one copying a
// shared page first, give the CPU's bytes and the CPU's quantization error,
// with the device's pages in either order.
class CudaChunksTest : public ::testing::TestWithParam<PageOrder> {};

TEST_P(CudaChunksTest, EncodeOfChunksMatchesTheCpuAndDecodeGivesItsFloats) {
  const PageOrder order = GetParam();
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  auto stream = cuda::CudaStream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  constexpr int kKvHeads = 3, kPage = 16;
  struct Shape {
    CodecKind k, v;
    int d;
    int64_t first, end;
  };
  const std::vector<Shape> shapes = {{CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 0, 100},
                                     {CodecKind::kTurbo4, CodecKind::kTurbo2, 128, 37, 38},
                                     {CodecKind::kF16, CodecKind::kQ8_0, 128, 5, 21},
                                     {CodecKind::kTurbo3, CodecKind::kQ4_0, 128, 16, 80},
                                     {CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 63, 64}};
  std::vector<std::unique_ptr<TwinLayer>> layers;
  std::vector<std::vector<float>> keys, values;
  std::vector<EncodeChunk> cpu_chunks, gpu_chunks;
  std::vector<EncodeStats> cpu_stats(2 * shapes.size()), gpu_stats(2 * shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    layers.push_back(std::make_unique<TwinLayer>(s.k, s.v, s.d, kKvHeads, kPage, s.end, 40 + i, order));
    keys.push_back(GaussianVectors((s.end - s.first) * kKvHeads, s.d, 70 + i));
    values.push_back(GaussianVectors((s.end - s.first) * kKvHeads, s.d, 90 + i));
    EncodeChunk chunk;
    chunk.key_codec = layers[i]->keys.get();
    chunk.value_codec = layers[i]->values.get();
    chunk.cache = layers[i]->cache;
    chunk.first = s.first;
    chunk.keys = keys[i].data();
    chunk.values = values[i].data();
    chunk.key_errors = &cpu_stats[2 * i];
    chunk.value_errors = &cpu_stats[2 * i + 1];
    cpu_chunks.push_back(chunk);
    chunk.cache = layers[i]->on_device();
    chunk.key_errors = &gpu_stats[2 * i];
    chunk.value_errors = &gpu_stats[2 * i + 1];
    gpu_chunks.push_back(chunk);
  }
  // The last chunk starts in a page shared with a fork: it is copied first.
  TwinLayer shared(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, kKvHeads, kPage, kPage, 40 + shapes.size() - 1, order);
  const size_t last = shapes.size() - 1;
  cpu_chunks[last].copy_from = shared.table[0];
  gpu_chunks[last].copy_from = shared.device_table[0];
  for (const EncodeChunk& chunk : cpu_chunks) EncodeChunkCpu(chunk, nullptr);
  const absl::Status encoded = (*stream)->Encode(gpu_chunks);
  ASSERT_TRUE(encoded.ok()) << encoded;

  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const TwinLayer& layer = *layers[i];
    std::vector<std::vector<uint8_t>> device_pages;
    for (size_t p = 0; p < layer.pages.size(); ++p) device_pages.push_back(layer.DevicePage(p));
    for (int h = 0; h < kKvHeads; ++h) {
      for (const bool v : {false, true}) {
        const CodecSpec spec{v ? s.v : s.k, s.d, v ? layer.cache.value_seed : layer.cache.key_seed};
        std::vector<float> x;
        const std::vector<float>& input = v ? values[i] : keys[i];
        for (int64_t t = s.first; t < s.end; ++t) {
          const float* row = input.data() + ((t - s.first) * kKvHeads + h) * s.d;
          x.insert(x.end(), row, row + s.d);
        }
        const std::vector<uint8_t> expected = Records(layer.cache, layer.pages, v, h, s.first, s.end);
        const std::vector<uint8_t> actual = Records(layer.cache, device_pages, v, h, s.first, s.end);
        const testing::CodeComparison c = testing::CompareCodes(
            spec, v ? layer.cache.value_layout : layer.cache.key_layout, x.data(), s.end - s.first, expected.data(),
            actual.data());
        EXPECT_EQ(c.far_from_boundary, 0u) << "chunk " << i << " head " << h << (v ? " values" : " keys");
        EXPECT_EQ(c.scale_mismatches, 0u) << "chunk " << i;
        EXPECT_EQ(c.byte_mismatches, 0u) << "chunk " << i;
        // Tokens before the chunk keep their bytes (or the shared page's).
        EXPECT_EQ(Records(layer.cache, layer.pages, v, h, 0, s.first), Records(layer.cache, device_pages, v, h, 0, s.first))
            << "chunk " << i;
      }
    }
  }
  for (size_t i = 0; i < cpu_stats.size(); ++i) {
    const EncodeStats& cpu = cpu_stats[i];
    const EncodeStats& gpu = gpu_stats[i];
    EXPECT_EQ(gpu.vectors, cpu.vectors) << i;
    EXPECT_EQ(gpu.zero_vectors, cpu.zero_vectors) << i;
    EXPECT_EQ(gpu.fp16_fields, cpu.fp16_fields) << i;
    EXPECT_EQ(gpu.saturated, cpu.saturated) << i;
    EXPECT_EQ(gpu.underflowed, cpu.underflowed) << i;
    EXPECT_NEAR(gpu.error_sum, cpu.error_sum, 1e-6 * cpu.error_sum + 1e-12) << i;
  }

  // Decoding a range of the GPU's pages gives the CPU's floats from the
  // CPU's pages, to the bit.
  TwinLayer& layer = *layers[0];
  for (size_t p = 0; p < layer.pages.size(); ++p) layer.Put(p, layer.pages[p]);
  const int64_t first = 13, n = 70;
  const size_t floats = static_cast<size_t>(n) * kKvHeads * 128;
  std::vector<float> cpu_k(floats), cpu_v(floats), gpu_k(floats, std::nanf("")), gpu_v(floats, std::nanf(""));
  DecodeCpu(*layer.keys, *layer.values, layer.cache, first, n, cpu_k.data(), cpu_v.data());
  ASSERT_TRUE((*stream)->Decode(layer.on_device(), first, n, gpu_k.data(), gpu_v.data()).ok());
  EXPECT_EQ(std::memcmp(cpu_k.data(), gpu_k.data(), floats * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(cpu_v.data(), gpu_v.data(), floats * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Orders, CudaChunksTest, ::testing::Values(PageOrder::kCanonical, PageOrder::kTokenGroups),
                         [](const auto& info) { return testing::PageOrderParamName(info.param); });

TEST(CudaDeviceTest, MissingDeviceIsReportedNotFatal) {
  const absl::Status status = cuda::CheckDevice(1 << 20);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(status.message().empty());
}

}  // namespace
}  // namespace turbokv
