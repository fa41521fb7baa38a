// A per-channel affine map of one layer's keys (and values) applied before
// the codec, which attention undoes exactly (docs/ARCHITECTURE.md, "The method":
// keys made safe). Keys of many open models carry a large component shared by every
// token (Qwen's key biases: norms near 300 against deviations near 15); a
// codec's error scales with the whole vector while softmax sees only the
// differences between keys. Stored keys are therefore
//
//   k' = (k - m) / s        per kv head and channel,
//
// m the keys' mean and s a scale that evens out the channels' error weight,
// and attention computes, for a query q,
//
//   logit = scale * <q * s, k'> + scale * <q, m>,
//
// the second term the same for every token (softmax ignores it; the
// log-sum-exp and top-k logits carry it, and a softcap sees it). Values may
// be centered too (v' = v - m_v; the output gains m_v back, since the
// weights sum to one). The transform is fitted once per layer, from the
// first chunk of tokens it stores past its sink tokens, and fixed from then.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace turbokv {

// What is fitted (a session's choice, SessionConfig).
struct KeyTransformOptions {
  bool center_keys = false;
  bool scale_keys = false;  // with center_keys
  bool center_values = false;
  bool any() const { return center_keys || center_values; }
};

// Fewer tokens than this fit no transform (the layer is stored as given).
constexpr int64_t kMinTransformTokens = 16;

struct KeyTransform {
  int kv_heads = 0;
  int head_dim = 0;
  // Each [kv_heads][head_dim], or empty: none (scale: 1).
  std::vector<float> key_mean;
  std::vector<float> key_scale;
  std::vector<float> value_mean;

  bool empty() const { return key_mean.empty() && key_scale.empty() && value_mean.empty(); }
  // keys and values [n][kv_heads][head_dim], in place: to what is stored.
  void Apply(int64_t n, float* keys, float* values) const;
  // Back from what is stored.
  void Invert(int64_t n, float* keys, float* values) const;
  // INVALID_ARGUMENT naming what does not match the shape (or is not finite,
  // or a scale that is not positive): what a snapshot or tier record gives
  // is checked with it.
  absl::Status Check(int expected_kv_heads, int expected_head_dim) const;
  // The shape alone (AttendTransformed, on every call).
  absl::Status CheckShape(int expected_kv_heads, int expected_head_dim) const;
};

// Fits a transform from n tokens' keys and values [n][kv_heads][head_dim]
// and, when not null, queries [query_tokens][q_heads][head_dim] of the
// last query_tokens of them (q_heads a multiple of kv_heads; -1: all n):
// the means of the keys (values) over the tokens, and key scales
// s = sqrt(sigma / r) per channel (normalized to a mean square of one per
// kv head), sigma the keys' standard deviation and r the root mean square
// of the queries of the kv head's group (1 without queries), each floored
// at a tenth of its mean over the channels. Fewer than kMinTransformTokens
// tokens give an empty transform.
KeyTransform FitKeyTransform(const KeyTransformOptions& options, int64_t n, int kv_heads, int head_dim,
                             const float* keys, const float* values, int q_heads, const float* queries,
                             int64_t query_tokens = -1);

// sum a[i] * b[i] over [0, n), in double: SIMD on every target, two vectors
// of partial sums (kernels/cpu/simd_codec.cc). Every query row of a request
// passes through it (its norm, its key mean's logit offset).
double DotDouble(const float* a, const float* b, int n);

}  // namespace turbokv
