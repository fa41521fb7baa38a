#include "kernels/rotation.h"

namespace turbokv {

HadamardRotation::HadamardRotation(int head_dim, int block_values, uint64_t seed)
    : head_dim_(head_dim), block_values_(block_values), seed_(seed), signs_(head_dim) {
  for (int i = 0; i < head_dim; ++i) signs_[i] = RotationSignNegative(seed, i) ? -1.0f : 1.0f;
}

void HadamardRotation::Forward(int block, float* x) const {
  const float* s = signs_.data() + block * block_values_;
  for (int i = 0; i < block_values_; ++i) x[i] *= s[i];
  FastWalshHadamard(x, block_values_);
}

void HadamardRotation::Inverse(int block, float* x) const {
  FastWalshHadamard(x, block_values_);
  const float* s = signs_.data() + block * block_values_;
  for (int i = 0; i < block_values_; ++i) x[i] *= s[i];
}

}  // namespace turbokv
