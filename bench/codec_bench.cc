// Google Benchmark cases for the codecs: encode (with and without EncodeStats),
// decode and the rotation.
// Run: build/bench/codec_bench (or `make bench`).
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/codec.h"

namespace turbokv {
namespace {

constexpr size_t kVectors = 4096;  // 2 MiB of f32 input at d = 128: stays in L2/L3

std::vector<float> Gaussian(size_t count) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> x(count);
  for (float& v : x) v = normal(rng);
  return x;
}

std::unique_ptr<Codec> MakeOrDie(benchmark::State& state) {
  const auto kind = static_cast<CodecKind>(state.range(0));
  const auto path = state.range(2) ? CpuPath::kSimd : CpuPath::kScalar;
  auto codec = MakeCpuCodec(CodecSpec{kind, static_cast<int>(state.range(1)), 3}, path);
  if (!codec.ok()) state.SkipWithError(std::string(codec.status().message()).c_str());
  state.SetLabel(std::string(CodecName(kind)) + " " + (codec.ok() ? (*codec)->implementation() : ""));
  return codec.ok() ? *std::move(codec) : nullptr;
}

void BM_Encode(benchmark::State& state) {
  const auto codec = MakeOrDie(state);
  if (!codec) return;
  const int d = codec->layout().head_dim;
  const std::vector<float> x = Gaussian(kVectors * d);
  std::vector<uint8_t> codes(kVectors * codec->code_size());
  for (auto _ : state) {
    codec->Encode(kVectors, x.data(), codes.data());
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * kVectors);
  state.SetBytesProcessed(state.iterations() * kVectors * d * sizeof(float));
}

// Encode with EncodeStats: what measuring the quantization error costs.
void BM_EncodeWithStats(benchmark::State& state) {
  const auto codec = MakeOrDie(state);
  if (!codec) return;
  const int d = codec->layout().head_dim;
  const std::vector<float> x = Gaussian(kVectors * d);
  std::vector<uint8_t> codes(kVectors * codec->code_size());
  EncodeStats stats;
  for (auto _ : state) {
    codec->Encode(kVectors, x.data(), codes.data(), &stats);
    benchmark::DoNotOptimize(codes.data());
    benchmark::DoNotOptimize(&stats);
  }
  state.SetItemsProcessed(state.iterations() * kVectors);
  state.SetBytesProcessed(state.iterations() * kVectors * d * sizeof(float));
}

void BM_Decode(benchmark::State& state) {
  const auto codec = MakeOrDie(state);
  if (!codec) return;
  const int d = codec->layout().head_dim;
  const std::vector<float> x = Gaussian(kVectors * d);
  std::vector<uint8_t> codes(kVectors * codec->code_size());
  codec->Encode(kVectors, x.data(), codes.data());
  std::vector<float> out(x.size());
  for (auto _ : state) {
    codec->Decode(kVectors, codes.data(), out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * kVectors);
  state.SetBytesProcessed(state.iterations() * kVectors * d * sizeof(float));
}

// Arguments: codec kind, head dim, SIMD (1) or scalar (0).
void CodecArgs(benchmark::internal::Benchmark* b) {
  for (CodecKind kind : {CodecKind::kF16, CodecKind::kQ8_0, CodecKind::kQ4_0, CodecKind::kTurbo2,
                         CodecKind::kTurbo3, CodecKind::kTurbo4}) {
    for (int simd : {0, 1}) b->Args({static_cast<int>(kind), 128, simd});
  }
  b->Args({static_cast<int>(CodecKind::kTurbo3), 64, 1});
  b->Args({static_cast<int>(CodecKind::kTurbo3), 576, 1});
}

BENCHMARK(BM_Encode)->Apply(CodecArgs);
BENCHMARK(BM_EncodeWithStats)->Apply(CodecArgs);
BENCHMARK(BM_Decode)->Apply(CodecArgs);

// The scalar randomized Hadamard rotation of one block (the SIMD one runs
// inside the turbo codecs above).
void BM_Rotation(benchmark::State& state) {
  const int bv = static_cast<int>(state.range(0));
  const HadamardRotation rotation(bv, bv, 5);
  std::vector<float> x = Gaussian(bv);
  for (auto _ : state) {
    rotation.Forward(0, x.data());
    rotation.Inverse(0, x.data());
    for (float& v : x) v *= 1.0f / bv;
    benchmark::DoNotOptimize(x.data());
  }
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_Rotation)->Arg(64)->Arg(128);

}  // namespace
}  // namespace turbokv
