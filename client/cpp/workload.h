// Synthetic model-shaped keys, values and queries, and float attention over
// them: what `turbokv demo` drives through the daemon and `turbokv-bench
// quality` measures the codecs on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace turbokv {

struct WorkloadShape {
  int layers = 32;
  int kv_heads = 8;
  int q_heads = 32;
  int head_dim = 128;
  uint64_t seed = 1;
};

// Deterministic normal samples (xorshift64* + Box-Muller).
class Normal {
 public:
  explicit Normal(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (Next() >> 11) * 0x1.0p-53 + 0x1.0p-54, u2 = (Next() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(6.283185307179586 * u2));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t Next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545F4914F6CDD1Dull;
  }
  uint64_t state_;
  float spare_ = 0;
  bool has_spare_ = false;
};

// Synthetic keys and values shaped like a model's: keys carry a per-head
// channel offset and a few outlier channels (x6), values a per-head shared
// direction plus per-token noise. The noise of token t of layer l is a slice
// of one table of normal samples at an offset hashed from (l, t), so any
// token can be made again, fast.
class Workload {
 public:
  explicit Workload(const WorkloadShape& o) : o_(o), noise_(size_t{1} << 22) {
    Normal normal(o.seed);
    const size_t per_layer = static_cast<size_t>(o.kv_heads) * o.head_dim;
    key_offset_.resize(per_layer * o.layers);
    value_mean_.resize(per_layer * o.layers);
    for (float& x : key_offset_) x = 0.5f * normal();
    for (float& x : value_mean_) x = normal();
    for (float& x : noise_) x = normal();
  }

  // Token t of layer l: kv_heads x head_dim keys and values.
  void Token(int l, int64_t t, float* key, float* value) const {
    const size_t n = static_cast<size_t>(o_.kv_heads) * o_.head_dim;
    const float* key_noise = Slice(l, t, 1, n);
    const float* value_noise = Slice(l, t, 2, n);
    const float* offset = &key_offset_[l * n];
    const float* mean = &value_mean_[l * n];
    for (size_t i = 0; i < n; ++i) {
      key[i] = offset[i] + key_noise[i] * (i % o_.head_dim < 4 ? 6.0f : 1.0f);
      value[i] = mean[i] + value_noise[i];
    }
  }

  // A query for layer l at step s: q_heads x head_dim, leaning toward the
  // key of an earlier token so attention is peaked, as in a model.
  void Query(int l, int64_t s, int64_t visible, float* query) const {
    const size_t n = static_cast<size_t>(o_.kv_heads) * o_.head_dim;
    std::vector<float> key(n), value(n);
    const int group = o_.q_heads / o_.kv_heads;
    const float* noise = Slice(l, s, 3, static_cast<size_t>(o_.q_heads) * o_.head_dim);
    for (int h = 0; h < o_.q_heads; ++h) {
      const int64_t target = static_cast<int64_t>(Hash(l, s * 1000 + h, 4) % static_cast<uint64_t>(visible));
      Token(l, target, key.data(), value.data());
      const float* k = &key[static_cast<size_t>(h / group) * o_.head_dim];
      for (int i = 0; i < o_.head_dim; ++i) {
        query[h * o_.head_dim + i] = 0.25f * k[i] + noise[h * o_.head_dim + i];
      }
    }
  }

 private:
  uint64_t Hash(int l, int64_t t, uint64_t stream) const {
    uint64_t z = o_.seed ^ (static_cast<uint64_t>(l) << 48) ^ (static_cast<uint64_t>(t) << 8) ^ stream;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  const float* Slice(int l, int64_t t, uint64_t stream, size_t n) const {
    return &noise_[Hash(l, t, stream) % (noise_.size() - n)];
  }

  WorkloadShape o_;
  std::vector<float> noise_;
  std::vector<float> key_offset_;
  std::vector<float> value_mean_;
};

// Softmax attention in double over the original vectors: the reference.
inline void ReferenceAttention(const WorkloadShape& o, const std::vector<float>& keys, const std::vector<float>& values,
                        int64_t visible, const float* query, std::vector<double>* out) {
  const int group = o.q_heads / o.kv_heads;
  const size_t token_stride = static_cast<size_t>(o.kv_heads) * o.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  out->assign(static_cast<size_t>(o.q_heads) * o.head_dim, 0.0);
  std::vector<double> logits(visible);
  for (int h = 0; h < o.q_heads; ++h) {
    const size_t head = static_cast<size_t>(h / group) * o.head_dim;
    const float* q = query + static_cast<size_t>(h) * o.head_dim;
    double max = -INFINITY;
    for (int64_t t = 0; t < visible; ++t) {
      const float* k = &keys[t * token_stride + head];
      float dot = 0;
      for (int i = 0; i < o.head_dim; ++i) dot += q[i] * k[i];
      logits[t] = dot * scale;
      max = std::max(max, logits[t]);
    }
    double sum = 0;
    double* acc = &(*out)[static_cast<size_t>(h) * o.head_dim];
    for (int64_t t = 0; t < visible; ++t) {
      const double p = std::exp(logits[t] - max);
      sum += p;
      const float* v = &values[t * token_stride + head];
      for (int i = 0; i < o.head_dim; ++i) acc[i] += p * v[i];
    }
    for (int i = 0; i < o.head_dim; ++i) acc[i] /= sum;
  }
}

}  // namespace turbokv
