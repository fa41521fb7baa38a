// KeyTransform, and AttendTransformed (attention.h): attention over layers
// stored with a transform or with sink tokens, on any device's kernels.
#include "kernels/key_transform.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/attention.h"
#include "kernels/half.h"

namespace turbokv {
namespace {

// Floors every entry of x[d] at `fraction` of their mean (all zeros stay).
void FloorAtMeanFraction(float* x, int d, float fraction) {
  double mean = 0;
  for (int c = 0; c < d; ++c) mean += x[c];
  const float floor = static_cast<float>(fraction * mean / d);
  for (int c = 0; c < d; ++c) x[c] = std::max(x[c], floor);
}

}  // namespace

// Each part's loop on its own, so that the compiler makes vector code of it
// (with the tests inside, a Decode step's 32 sessions took 19 us of the
// caller's thread); each value gets the same operations in the same order.
void KeyTransform::Apply(int64_t n, float* keys, float* values) const {
  const size_t row = static_cast<size_t>(kv_heads) * head_dim;
  for (int64_t t = 0; t < n; ++t) {
    float* k = keys + t * row;
    float* v = values + t * row;
    if (!key_mean.empty()) {
      for (size_t i = 0; i < row; ++i) k[i] -= key_mean[i];
    }
    if (!key_scale.empty()) {
      for (size_t i = 0; i < row; ++i) k[i] /= key_scale[i];
    }
    if (!value_mean.empty()) {
      for (size_t i = 0; i < row; ++i) v[i] -= value_mean[i];
    }
  }
}

void KeyTransform::Invert(int64_t n, float* keys, float* values) const {
  const size_t row = static_cast<size_t>(kv_heads) * head_dim;
  for (int64_t t = 0; t < n; ++t) {
    float* k = keys + t * row;
    float* v = values + t * row;
    if (!key_scale.empty()) {
      for (size_t i = 0; i < row; ++i) k[i] *= key_scale[i];
    }
    if (!key_mean.empty()) {
      for (size_t i = 0; i < row; ++i) k[i] += key_mean[i];
    }
    if (!value_mean.empty()) {
      for (size_t i = 0; i < row; ++i) v[i] += value_mean[i];
    }
  }
}

absl::Status KeyTransform::CheckShape(int expected_kv_heads, int expected_head_dim) const {
  if (empty()) return absl::OkStatus();
  if (kv_heads != expected_kv_heads || head_dim != expected_head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("key transform of ", kv_heads, " kv heads x ", head_dim,
                                                   " for a layer of ", expected_kv_heads, " x ", expected_head_dim));
  }
  const size_t size = static_cast<size_t>(kv_heads) * head_dim;
  for (const auto& [name, v] : {std::make_pair("key_mean", &key_mean), std::make_pair("key_scale", &key_scale),
                                std::make_pair("value_mean", &value_mean)}) {
    if (!v->empty() && v->size() != size) {
      return absl::InvalidArgumentError(absl::StrCat("key transform: ", name, " holds ", v->size(), " values, not ", size));
    }
  }
  return absl::OkStatus();
}

absl::Status KeyTransform::Check(int expected_kv_heads, int expected_head_dim) const {
  if (absl::Status s = CheckShape(expected_kv_heads, expected_head_dim); !s.ok()) return s;
  for (const auto& [name, v] : {std::make_pair("key_mean", &key_mean), std::make_pair("key_scale", &key_scale),
                                std::make_pair("value_mean", &value_mean)}) {
    if (FirstNonFinite(v->data(), v->size()) < v->size()) {
      return absl::InvalidArgumentError(absl::StrCat("key transform: ", name, " is not finite"));
    }
  }
  if (!key_scale.empty() && *std::min_element(key_scale.begin(), key_scale.end()) <= 0.0f) {
    return absl::InvalidArgumentError("key transform: a key scale is not positive");
  }
  return absl::OkStatus();
}

KeyTransform FitKeyTransform(const KeyTransformOptions& options, int64_t n, int kv_heads, int head_dim,
                             const float* keys, const float* values, int q_heads, const float* queries,
                             int64_t query_tokens) {
  KeyTransform t;
  if (!options.any() || n < kMinTransformTokens) return t;
  if (query_tokens < 0) query_tokens = n;
  if (query_tokens == 0) queries = nullptr;
  t.kv_heads = kv_heads;
  t.head_dim = head_dim;
  const size_t row = static_cast<size_t>(kv_heads) * head_dim;
  auto mean_of = [&](const float* x) {
    std::vector<double> sum(row, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (size_t c = 0; c < row; ++c) sum[c] += x[i * row + c];
    }
    std::vector<float> mean(row);
    for (size_t c = 0; c < row; ++c) mean[c] = static_cast<float>(sum[c] / n);
    return mean;
  };
  if (options.center_values) t.value_mean = mean_of(values);
  if (!options.center_keys) return t;
  t.key_mean = mean_of(keys);
  if (!options.scale_keys) return t;

  std::vector<double> var(row, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (size_t c = 0; c < row; ++c) {
      const double x = keys[i * row + c] - t.key_mean[c];
      var[c] += x * x;
    }
  }
  std::vector<double> q_square(row, 0.0);
  const int group = q_heads / kv_heads;
  if (queries != nullptr) {
    for (int64_t i = 0; i < query_tokens; ++i) {
      for (int qh = 0; qh < q_heads; ++qh) {
        const float* q = queries + (static_cast<size_t>(i) * q_heads + qh) * head_dim;
        double* sum = q_square.data() + static_cast<size_t>(qh / group) * head_dim;
        for (int c = 0; c < head_dim; ++c) sum[c] += static_cast<double>(q[c]) * q[c];
      }
    }
  }
  t.key_scale.assign(row, 1.0f);
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<float> sigma(head_dim), r(head_dim, 1.0f);
    for (int c = 0; c < head_dim; ++c) {
      sigma[c] = static_cast<float>(std::sqrt(var[h * head_dim + c] / n));
      if (queries != nullptr) r[c] = static_cast<float>(std::sqrt(q_square[h * head_dim + c] / (query_tokens * group)));
    }
    FloorAtMeanFraction(sigma.data(), head_dim, 0.1f);
    FloorAtMeanFraction(r.data(), head_dim, 0.1f);
    float* s = t.key_scale.data() + static_cast<size_t>(h) * head_dim;
    double square = 0;
    for (int c = 0; c < head_dim; ++c) {
      s[c] = sigma[c] > 0.0f && r[c] > 0.0f ? std::sqrt(sigma[c] / r[c]) : 1.0f;
      square += static_cast<double>(s[c]) * s[c];
    }
    const float norm = static_cast<float>(1.0 / std::sqrt(square / head_dim));
    for (int c = 0; c < head_dim; ++c) s[c] *= norm;
  }
  // Scales Check refuses (not finite or not positive: sigma / r underflows
  // for keys almost alike and huge queries) leave the keys unscaled; the
  // means of finite tokens always pass. AttendTransformed checks no values.
  if (!t.Check(kv_heads, head_dim).ok()) t.key_scale.clear();
  return t;
}

namespace {

// Higher logit first; the earlier token among equal logits (as TopK).
bool RanksBefore(float logit_a, int64_t token_a, float logit_b, int64_t token_b) {
  return logit_a > logit_b || (logit_a == logit_b && token_a < token_b);
}

// What AttendTransformed keeps for one problem with a transform or sinks.
struct Prepared {
  std::unique_ptr<float[]> q;  // [n][q_heads][head_dim] scaled queries, or none
  std::vector<float> offsets;  // [n][q_heads] logit offsets of the key means, or empty
  bool offsets_in_kernel = false;
  // The sinks' results, merged into the problem's after. Not zeroed: the
  // sinks' attention writes every row (512 KiB of memset a Decode step of 32
  // sessions otherwise, on the caller's thread).
  std::unique_ptr<float[]> sink_out, sink_lse, sink_logits;
  std::unique_ptr<int64_t[]> sink_tokens;
};

}  // namespace

absl::Status CheckTransformAndSinks(const AttentionProblem& p, int64_t index) {
  const auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("problem ", index, ": ", what));
  };
  const PagedKvCache& c = p.cache;
  if (p.transform != nullptr) {
    // Its shape only: its values were checked where it was made (fitted
    // from checked tokens, or loaded from a snapshot or tier). Checking a
    // Decode step's 32 transforms again cost the caller's thread about 30 us.
    if (absl::Status s = p.transform->CheckShape(c.kv_heads, c.key_layout.head_dim); !s.ok()) {
      return invalid(std::string(s.message()));
    }
  }
  if (p.sinks.tokens != c.first_token) {
    return invalid(absl::StrCat("sinks hold ", p.sinks.tokens, " tokens, the pages start at token ", c.first_token));
  }
  if (p.sinks.tokens > 0 && (p.sinks.kv_heads != c.kv_heads || p.sinks.key_layout.head_dim != c.key_layout.head_dim ||
                             p.sinks.value_layout.head_dim != c.key_layout.head_dim)) {
    return invalid("sinks do not have the pages' kv heads and head_dim");
  }
  return absl::OkStatus();
}


void ScaleQueryRow(const KeyTransform& transform, int kv_head, const float* q, float* out) {
  const int d = transform.head_dim;
  const float* s = transform.key_scale.data() + static_cast<size_t>(kv_head) * d;
  for (int c = 0; c < d; ++c) out[c] = q[c] * s[c];
}

float KeyMeanOffset(const KeyTransform& transform, int kv_head, const float* q, float scale, float given) {
  const int d = transform.head_dim;
  const float* m = transform.key_mean.data() + static_cast<size_t>(kv_head) * d;
  return static_cast<float>(scale * DotDouble(q, m, d)) + given;
}

void FinishTransformedRow(const KeyTransform* transform, int kv_head, const float* offset, int top_k, float* out,
                          float* lse, const int64_t* topk_tokens, float* topk_logits) {
  if (*lse == -INFINITY) return;  // the pages held nothing this row sees
  if (offset != nullptr) {
    *lse += *offset;
    for (int j = 0; j < top_k; ++j) {
      if (topk_tokens[j] >= 0) topk_logits[j] += *offset;
    }
  }
  if (transform != nullptr && !transform->value_mean.empty()) {
    const int d = transform->head_dim;
    const float* m = transform->value_mean.data() + static_cast<size_t>(kv_head) * d;
    for (int c = 0; c < d; ++c) out[c] += m[c];
  }
}

void MergeTopK(int k, int64_t* tokens, float* logits, const int64_t* sink_tokens, const float* sink_logits) {
  thread_local std::vector<int64_t> merged_tokens;
  thread_local std::vector<float> merged_logits;
  merged_tokens.resize(static_cast<size_t>(k));
  merged_logits.resize(static_cast<size_t>(k));
  int a = 0, b = 0;
  for (int j = 0; j < k; ++j) {
    const bool have_a = a < k && tokens[a] >= 0;
    const bool have_b = b < k && sink_tokens[b] >= 0;
    if (have_a && (!have_b || RanksBefore(logits[a], tokens[a], sink_logits[b], sink_tokens[b]))) {
      merged_tokens[j] = tokens[a];
      merged_logits[j] = logits[a++];
    } else if (have_b) {
      merged_tokens[j] = sink_tokens[b];
      merged_logits[j] = sink_logits[b++];
    } else {
      merged_tokens[j] = -1;
      merged_logits[j] = -INFINITY;
    }
  }
  std::copy(merged_tokens.begin(), merged_tokens.end(), tokens);
  std::copy(merged_logits.begin(), merged_logits.end(), logits);
}

absl::Status AttendTransformed(const AttentionBatch& batch, const AttentionParams& params,
                               const PlainAttention& pages, const PlainAttention& sinks) {
  std::vector<AttentionProblem> plain(batch.problems, batch.problems + batch.count);
  std::vector<AttentionProblem> sink_problems;
  std::vector<Prepared> prepared(static_cast<size_t>(batch.count));
  const int q_heads = params.q_heads;
  for (int64_t i = 0; i < batch.count; ++i) {
    const AttentionProblem& p = batch.problems[i];
    if (p.transform == nullptr && p.sinks.tokens == 0) continue;
    if (absl::Status s = CheckTransformAndSinks(p, i); !s.ok()) return s;
    if (p.cache.kv_heads <= 0 || q_heads % p.cache.kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("problem ", i, ": q_heads ", q_heads,
                                                     " is not a multiple of kv_heads ", p.cache.kv_heads));
    }
    Prepared& prep = prepared[static_cast<size_t>(i)];
    AttentionProblem& out = plain[static_cast<size_t>(i)];
    out.transform = nullptr;
    out.sinks = PagedKvCache();
    const int d = p.cache.key_layout.head_dim;
    const int group = q_heads / p.cache.kv_heads;
    const size_t rows = static_cast<size_t>(p.queries.n) * q_heads;
    const float scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
    const KeyTransform* t = p.transform;
    if (t != nullptr && !t->key_scale.empty()) {
      // Written once, not copied and then scaled: a Decode batch scales
      // every session's queries on the caller's thread.
      prep.q.reset(new float[rows * d]);
      for (size_t r = 0; r < rows; ++r) {
        ScaleQueryRow(*t, static_cast<int>(r % q_heads / group), p.queries.q + r * d, prep.q.get() + r * d);
      }
      out.queries.q = prep.q.get();
    }
    if (t != nullptr && !t->key_mean.empty()) {
      prep.offsets.resize(rows);
      for (size_t r = 0; r < rows; ++r) {
        prep.offsets[r] = KeyMeanOffset(*t, static_cast<int>(r % q_heads / group), p.queries.q + r * d, scale,
                                        p.queries.logit_offset != nullptr ? p.queries.logit_offset[r] : 0.0f);
      }
      // Without a softcap the offset only shifts every logit of a row: it
      // goes to the results after, keeping the kernels' logits small.
      prep.offsets_in_kernel = params.softcap > 0.0f;
      if (prep.offsets_in_kernel) out.queries.logit_offset = prep.offsets.data();
    }
    if (p.sinks.tokens > 0) {
      prep.sink_out.reset(new float[rows * d]);
      prep.sink_lse.reset(new float[rows]);
      if (params.top_k > 0) {
        prep.sink_tokens.reset(new int64_t[rows * params.top_k]);
        prep.sink_logits.reset(new float[rows * params.top_k]);
      }
      AttentionProblem s;
      s.cache = p.sinks;
      s.queries = p.queries;  // the sinks are stored as given: the caller's queries and offsets
      s.few_tokens = FewTokensApply(p.sinks);
      s.output = {prep.sink_out.get(), prep.sink_lse.get(), prep.sink_tokens.get(), prep.sink_logits.get()};
      sink_problems.push_back(s);
    }
  }

  if (sinks == nullptr) {
    const size_t page_count = plain.size();
    plain.insert(plain.end(), sink_problems.begin(), sink_problems.end());
    if (absl::Status s = pages(AttentionBatch{plain.data(), static_cast<int64_t>(plain.size())}, params); !s.ok()) {
      return s;
    }
    plain.resize(page_count);
  } else {
    if (absl::Status s = pages(AttentionBatch{plain.data(), static_cast<int64_t>(plain.size())}, params); !s.ok()) {
      return s;
    }
    if (!sink_problems.empty()) {
      absl::Status s = sinks(AttentionBatch{sink_problems.data(), static_cast<int64_t>(sink_problems.size())}, params);
      if (!s.ok()) return s;
    }
  }

  for (int64_t i = 0; i < batch.count; ++i) {
    const AttentionProblem& p = batch.problems[i];
    if (p.transform == nullptr && p.sinks.tokens == 0) continue;
    const Prepared& prep = prepared[static_cast<size_t>(i)];
    const int d = p.cache.key_layout.head_dim;
    const int group = q_heads / p.cache.kv_heads;
    const size_t rows = static_cast<size_t>(p.queries.n) * q_heads;
    const int k = params.top_k;
    for (size_t r = 0; r < rows; ++r) {
      const bool offset = !prep.offsets.empty() && !prep.offsets_in_kernel;
      FinishTransformedRow(p.transform, static_cast<int>(r % q_heads / group), offset ? &prep.offsets[r] : nullptr, k,
                           p.output.out + r * d, p.output.lse + r, k ? p.output.topk_tokens + r * k : nullptr,
                           k ? p.output.topk_logits + r * k : nullptr);
    }
    if (p.sinks.tokens == 0) continue;
    MergeAttention(rows, d, p.output.out, p.output.lse, prep.sink_out.get(), prep.sink_lse.get());
    for (size_t r = 0; r < rows && k > 0; ++r) {
      MergeTopK(k, p.output.topk_tokens + r * k, p.output.topk_logits + r * k, prep.sink_tokens.get() + r * k,
                prep.sink_logits.get() + r * k);
    }
  }
  return absl::OkStatus();
}

}  // namespace turbokv
