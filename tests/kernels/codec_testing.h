// Helpers shared by the codec tests of every backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/block_math.h"
#include "kernels/codec.h"

namespace turbokv::testing {

// n vectors of dim i.i.d. N(0, 1) values.
inline std::vector<float> GaussianVectors(size_t n, int dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n * dim);
  for (float& v : x) v = normal(rng);
  return x;
}

// n random unit vectors (uniform on the sphere).
inline std::vector<float> UnitVectors(size_t n, int dim, uint64_t seed) {
  std::vector<float> x = GaussianVectors(n, dim, seed);
  for (size_t v = 0; v < n; ++v) {
    double sq = 0;
    for (int i = 0; i < dim; ++i) sq += double(x[v * dim + i]) * x[v * dim + i];
    const float inv = static_cast<float>(1.0 / std::sqrt(sq));
    for (int i = 0; i < dim; ++i) x[v * dim + i] *= inv;
  }
  return x;
}

// Keys like those of real models: a few channels 10-30x larger than the rest,
// plus a fixed per-channel offset.
inline std::vector<float> OutlierKeys(size_t n, int dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(10.0f, 30.0f);
  std::vector<float> gain(dim, 1.0f), offset(dim);
  for (int i = 0; i < dim; ++i) offset[i] = 0.5f * normal(rng);
  for (int k = 0; k < 4; ++k) gain[(k * 37 + 5) % dim] = uniform(rng);
  std::vector<float> x(n * dim);
  for (size_t v = 0; v < n; ++v) {
    for (int i = 0; i < dim; ++i) x[v * dim + i] = gain[i] * normal(rng) + offset[i];
  }
  return x;
}

// Vectors shaped like a Qwen model's keys: a component shared by every token
// (norm about `shared`) on top of channels of very different spread, a few
// of them outliers.
inline std::vector<float> SharedComponentVectors(int64_t n, int kv_heads, int d, float shared, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  const size_t row = static_cast<size_t>(kv_heads) * d;
  std::vector<float> bias(row), spread(row);
  for (size_t c = 0; c < row; ++c) {
    bias[c] = shared * normal(rng) / std::sqrt(static_cast<float>(d));
    spread[c] = c % 29 == 3 ? 12.0f : 0.3f + std::fabs(normal(rng));
  }
  std::vector<float> x(static_cast<size_t>(n) * row);
  for (int64_t t = 0; t < n; ++t) {
    for (size_t c = 0; c < row; ++c) x[t * row + c] = bias[c] + spread[c] * normal(rng);
  }
  return x;
}

// E ||x - y||^2 / ||x||^2 over vectors, as sum of errors over sum of norms.
inline double RelativeMse(const std::vector<float>& x, const std::vector<float>& y) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = double(x[i]) - y[i];
    err += e * e;
    norm += double(x[i]) * x[i];
  }
  return norm > 0 ? err / norm : err;
}

struct CodeComparison {
  size_t blocks = 0;
  size_t index_mismatches = 0;     // indices that differ
  size_t far_from_boundary = 0;    // ... of those, not within rounding of a boundary
  size_t scale_mismatches = 0;     // blocks with equal indices but different scales
  size_t byte_mismatches = 0;      // non-turbo codecs: bytes that differ
};

// Compares codes of the same input x from two implementations of one spec.
// Turbo codes may differ only in indices whose coordinate lies within
// floating-point rounding of a decision boundary; everything else must match.
inline CodeComparison CompareCodes(const CodecSpec& spec, const CodecLayout& layout,
                                   const float* x, size_t n, const uint8_t* expected,
                                   const uint8_t* actual) {
  CodeComparison c;
  const int bits = TurboBits(spec.kind);
  if (bits == 0) {
    for (size_t i = 0; i < n * layout.code_size(); ++i) c.byte_mismatches += expected[i] != actual[i];
    return c;
  }
  const int bv = layout.block_values;
  const Codebook* cb = FindCodebook(bv, bits);
  const HadamardRotation rotation(spec.head_dim, bv, spec.seed);
  for (size_t v = 0; v < n; ++v) {
    for (int b = 0; b < layout.blocks; ++b) {
      ++c.blocks;
      const size_t offset = v * layout.code_size() + b * layout.block_bytes;
      const uint8_t* e = expected + offset;
      const uint8_t* a = actual + offset;
      float z[128];
      bool computed = false;
      float inv = 0;
      size_t block_mismatches = 0;
      for (int i = 0; i < bv; ++i) {
        const int ei = TurboIndex(e + kTurboScaleBytes, bv, bits, i);
        const int ai = TurboIndex(a + kTurboScaleBytes, bv, bits, i);
        if (ei == ai) continue;
        ++block_mismatches;
        if (!computed) {
          for (int k = 0; k < bv; ++k) z[k] = x[v * spec.head_dim + b * bv + k];
          rotation.Forward(b, z);
          double sq = 0;
          for (int k = 0; k < bv; ++k) sq += double(z[k]) * z[k];
          inv = static_cast<float>(std::sqrt(double(bv) / sq));
          computed = true;
        }
        const float u = z[i] * inv;
        float nearest = 1e30f;
        for (int k = 0; k + 1 < (1 << bits); ++k) {
          nearest = std::fmin(nearest, std::fabs(u - cb->boundaries[k]));
        }
        if (nearest > 1e-5f || std::abs(ei - ai) > 1) ++c.far_from_boundary;
      }
      c.index_mismatches += block_mismatches;
      if (block_mismatches == 0 && LoadHalfBits(e) != LoadHalfBits(a)) ++c.scale_mismatches;
    }
  }
  return c;
}

// docs/ARCHITECTURE.md, "The method": relative MSE bars on 100,000 random unit vectors, d = 128.
struct FidelityBar {
  CodecKind kind;
  double max_rel_mse;
};
inline const FidelityBar kFidelityBars[] = {
    {CodecKind::kTurbo2, 0.1165}, {CodecKind::kTurbo3, 0.0342}, {CodecKind::kTurbo4, 0.0094}};
constexpr size_t kFidelityVectors = 100000;

inline const CodecKind kAllCodecs[] = {CodecKind::kF16,    CodecKind::kQ8_0,
                                       CodecKind::kQ4_0,   CodecKind::kTurbo2,
                                       CodecKind::kTurbo3, CodecKind::kTurbo4};

}  // namespace turbokv::testing
