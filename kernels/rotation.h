// The randomized Hadamard rotation of TurboQuant (docs/ARCHITECTURE.md, "The method"): the
// orthogonal map y = H * S * x / sqrt(B) per block of B values, where
// S = diag(+-1) is drawn from a 64-bit seed and H is the B x B Walsh-Hadamard
// matrix in Sylvester order, applied with the fast transform. The code keeps
// it unnormalized (H * S * x) and folds the 1 / sqrt(B) factors into scales.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/hd.h"

namespace turbokv {

TURBOKV_HD uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Independent seeds for the keys and the values of one session.
enum class RotationStream : uint64_t { kKeys = 0x6b657973ull, kValues = 0x76616c73ull };

TURBOKV_HD uint64_t DeriveRotationSeed(uint64_t session_seed, RotationStream stream) {
  return SplitMix64(session_seed ^ SplitMix64(static_cast<uint64_t>(stream)));
}

// True when S flips coordinate i (0 <= i < head_dim) of every vector.
TURBOKV_HD bool RotationSignNegative(uint64_t seed, int i) {
  return (SplitMix64(seed + static_cast<uint64_t>(i)) >> 63) != 0;
}

// In-place unnormalized fast Walsh-Hadamard transform of n values (n a power of
// two): x <- H x. Stage h pairs x[j] and x[j + h]; every implementation (SIMD,
// CUDA) computes exactly these butterflies, (a + b, a - b), so all agree to the
// bit.
TURBOKV_HD void FastWalshHadamard(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// The rotation of one vector space: head_dim values cut into blocks of B.
// Forward(x) = H S x (unnormalized: divide by sqrt(B) for the orthogonal map);
// Inverse(y) = S H y (divide by B to undo Forward).
class HadamardRotation {
 public:
  HadamardRotation(int head_dim, int block_values, uint64_t seed);

  int head_dim() const { return head_dim_; }
  int block_values() const { return block_values_; }
  uint64_t seed() const { return seed_; }
  // +1 or -1 per coordinate of a vector (the diagonal of S).
  const float* signs() const { return signs_.data(); }

  // Block `block` of one vector: x holds B values, rotated in place.
  void Forward(int block, float* x) const;
  void Inverse(int block, float* x) const;

 private:
  int head_dim_;
  int block_values_;
  uint64_t seed_;
  std::vector<float> signs_;
};

}  // namespace turbokv
