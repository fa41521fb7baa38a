// Float reference attention for the tests: naive softmax attention in double
// over plain key/value arrays (decoded or original).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/paged_cache.h"

namespace turbokv::testing {

struct ReferenceResult {
  std::vector<double> out;  // [n][q_heads][d]
  std::vector<double> lse;  // [n][q_heads]
  std::vector<std::vector<std::pair<double, int64_t>>> logits;  // per (query, head), descending
};

// keys, values: [tokens][kv_heads][d]; q: [n][q_heads][d]. A query sees the
// tokens of [first_token, tokens) within its window; offsets ([n][q_heads],
// or empty) are added to its logits before the softcap. A query that sees
// nothing gets zeros and lse -inf.
inline ReferenceResult ReferenceAttention(const std::vector<float>& keys,
                                          const std::vector<float>& values, int kv_heads, int d,
                                          const std::vector<float>& q,
                                          const std::vector<int64_t>& positions,
                                          const AttentionParams& params, int64_t first_token = 0,
                                          const std::vector<float>& offsets = {}) {
  const int64_t tokens = static_cast<int64_t>(keys.size()) / (int64_t{kv_heads} * d);
  const int64_t n = static_cast<int64_t>(positions.size());
  const int group = params.q_heads / kv_heads;
  const double scale = params.softmax_scale > 0 ? params.softmax_scale : 1.0 / std::sqrt(double(d));
  ReferenceResult r;
  r.out.assign(static_cast<size_t>(n) * params.q_heads * d, 0.0);
  r.lse.assign(static_cast<size_t>(n) * params.q_heads, 0.0);
  r.logits.resize(static_cast<size_t>(n) * params.q_heads);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t last = std::min(positions[i], tokens - 1);
    const int64_t first =
        std::max(first_token, params.window > 0 ? std::max<int64_t>(0, positions[i] - params.window + 1) : 0);
    for (int h = 0; h < params.q_heads; ++h) {
      const int kv = h / group;
      const float* qv = q.data() + (i * params.q_heads + h) * d;
      std::vector<std::pair<double, int64_t>>& logits = r.logits[i * params.q_heads + h];
      double m = -INFINITY;
      for (int64_t t = first; t <= last; ++t) {
        const float* k = keys.data() + (t * kv_heads + kv) * d;
        double s = 0;
        for (int x = 0; x < d; ++x) s += double(qv[x]) * k[x];
        s = s * scale + (offsets.empty() ? 0.0 : offsets[i * params.q_heads + h]);
        if (params.softcap > 0) s = params.softcap * std::tanh(s / params.softcap);
        logits.push_back({s, t});
        m = std::max(m, s);
      }
      double l = 0;
      double* out = r.out.data() + (i * params.q_heads + h) * d;
      for (const auto& [s, t] : logits) {
        const double p = std::exp(s - m);
        l += p;
        const float* v = values.data() + (t * kv_heads + kv) * d;
        for (int x = 0; x < d; ++x) out[x] += p * v[x];
      }
      for (int x = 0; x < d && l > 0; ++x) out[x] /= l;
      r.lse[i * params.q_heads + h] = l > 0 ? m + std::log(l) : -INFINITY;
      std::sort(logits.begin(), logits.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
    }
  }
  return r;
}

// ||a - b|| / ||b|| over whole arrays.
template <class A, class B>
double RelativeL2(const A& a, const B& b) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    err += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    norm += double(b[i]) * double(b[i]);
  }
  return std::sqrt(err / norm);
}

// What a codec stores for each vector, decoded back to plain floats:
// [tokens][kv_heads][d] in and out.
inline std::vector<float> DecodedThroughCodec(const CodecSpec& spec, const std::vector<float>& x) {
  auto codec = MakeCpuCodec(spec, CpuPath::kScalar);
  const size_t n = x.size() / spec.head_dim;
  std::vector<uint8_t> codes(n * (*codec)->code_size());
  std::vector<float> y(x.size());
  (*codec)->Encode(n, x.data(), codes.data());
  (*codec)->Decode(n, codes.data(), y.data());
  return y;
}

}  // namespace turbokv::testing
