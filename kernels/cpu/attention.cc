// CPU attention driver: validation, query rotation, splitting into work items
// (kv head x token chunk), merging partial softmax states, the final inverse
// rotation of the values; plus the scalar scan, the reference the SIMD scan
// is tested against.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/attention.h"
#include "kernels/block_math.h"
#include "kernels/codec.h"
#include "kernels/codebooks.h"
#include "kernels/half.h"
#include "kernels/key_transform.h"
#include "kernels/paged_cache.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/rotation.h"

namespace turbokv {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

// Decodes one record into the domain the kernel works in (turbo: rotated).
void DecodeRow(const CodecLayout& layout, const float* centroids, const uint8_t* in, float* out) {
  for (int b = 0; b < layout.blocks; ++b) {
    DecodeBlockToKernelDomain(layout, in + static_cast<size_t>(b) * layout.block_bytes, centroids,
                              out + b * layout.block_values);
  }
}

// Folds the state of a later chunk into `into` (same rows).
void MergeState(const ScanState& from, int head_dim, ScanState* into) {
  for (size_t r = 0; r < into->m.size(); ++r) {
    const float m = std::max(into->m[r], from.m[r]);
    if (m == -INFINITY) continue;
    const float a = std::exp(into->m[r] - m);
    const float b = std::exp(from.m[r] - m);
    float* acc = into->acc.data() + r * head_dim;
    const float* other = from.acc.data() + r * head_dim;
    for (int i = 0; i < head_dim; ++i) acc[i] = acc[i] * a + other[i] * b;
    into->l[r] = into->l[r] * a + from.l[r] * b;
    into->m[r] = m;
    for (const TopEntry& e : from.top[r].entries()) into->top[r].Push(e.logit, e.token);
  }
}

}  // namespace

void TopK::Push(float logit, int64_t token) {
  const TopEntry e{logit, token};
  if (static_cast<int>(heap_.size()) < k_) {
    heap_.push_back(e);
    std::push_heap(heap_.begin(), heap_.end(), Ranks);
  } else if (k_ > 0 && Ranks(e, heap_.front())) {
    std::pop_heap(heap_.begin(), heap_.end(), Ranks);
    heap_.back() = e;
    std::push_heap(heap_.begin(), heap_.end(), Ranks);
  }
}

void ScanScalar(const ScanTask& task, ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const int d = c.key_layout.head_dim;
  std::vector<float> k(d), v(d);
  const float* key_centroids = LayoutCentroids(c.key_layout);
  const float* value_centroids = LayoutCentroids(c.value_layout);
  for (int64_t t = task.begin; t < task.end; ++t) {
    DecodeRow(c.key_layout, key_centroids, c.key_record(task.head, t), k.data());
    DecodeRow(c.value_layout, value_centroids, c.value_record(task.head, t), v.data());
    for (int r = 0; r < task.rows; ++r) {
      const int query = r / task.group;
      if (t < task.first[query] || t > task.last[query]) continue;
      const float* q = task.q + static_cast<size_t>(r) * d;
      float score = 0.0f;
      for (int i = 0; i < d; ++i) score += q[i] * k[i];
      const float logit = Logit(score, task.scale, task.offset != nullptr ? task.offset[r] : 0.0f, task.softcap);
      state->top[r].Push(logit, t);
      float* acc = state->acc.data() + static_cast<size_t>(r) * d;
      if (logit > state->m[r]) {
        const float correction = std::exp(state->m[r] - logit);
        for (int i = 0; i < d; ++i) acc[i] *= correction;
        state->l[r] *= correction;
        state->m[r] = logit;
      }
      const float p = std::exp(logit - state->m[r]);
      state->l[r] += p;
      for (int i = 0; i < d; ++i) acc[i] += p * v[i];
    }
  }
}

namespace {

// CheckAttention's checks of the cache, and of q_heads against its kv heads.
absl::Status CheckCache(const PagedKvCache& cache, const AttentionParams& params) {
  const int d = cache.key_layout.head_dim;
  for (const auto& [field, layout] : {std::make_pair("key_layout", &cache.key_layout),
                                      std::make_pair("value_layout", &cache.value_layout)}) {
    const absl::StatusOr<CodecLayout> expected = CheckCodecSpec(CodecSpec{layout->kind, layout->head_dim, 0});
    if (!expected.ok()) return Invalid(field, expected.status().message());
    if (expected->block_values != layout->block_values || expected->blocks != layout->blocks ||
        expected->block_bytes != layout->block_bytes) {
      return Invalid(field, "does not match its codec's layout (MakeCodecLayout)");
    }
  }
  if (cache.value_layout.head_dim != d) {
    return Invalid("value_layout", absl::StrCat("head_dim ", cache.value_layout.head_dim,
                                                " differs from the keys' ", d));
  }
  if (cache.kv_heads <= 0) return Invalid("kv_heads", "must be positive");
  if (cache.page_tokens <= 0) return Invalid("page_tokens", "must be positive");
  if (cache.tokens <= 0) return Invalid("tokens", "the cache holds no tokens");
  if (cache.first_token < 0 || cache.first_token > cache.tokens) {
    return Invalid("first_token", absl::StrCat(cache.first_token, " is not in [0, tokens = ", cache.tokens, "]"));
  }
  if (cache.pages == nullptr) return Invalid("pages", "missing");
  if (params.q_heads <= 0 || params.q_heads % cache.kv_heads != 0) {
    return Invalid("q_heads", absl::StrCat(params.q_heads, " is not a positive multiple of kv_heads ",
                                           cache.kv_heads));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAttention(const PagedKvCache& cache, const AttentionParams& params,
                            const AttentionQueries& queries, const AttentionOutput& output) {
  if (absl::Status s = CheckCache(cache, params); !s.ok()) return s;
  const int d = cache.key_layout.head_dim;
  if (!(params.softmax_scale >= 0.0f) || !std::isfinite(params.softmax_scale)) {
    return Invalid("softmax_scale", "must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  }
  if (!(params.softcap >= 0.0f) || !std::isfinite(params.softcap)) {
    return Invalid("softcap", "must be finite and >= 0 (0 means none)");
  }
  if (params.window < 0) return Invalid("window", "must be >= 0 (0 means no window)");
  if (params.top_k < 0) return Invalid("top_k", "must be >= 0");
  if (queries.n <= 0) return Invalid("queries", "no queries");
  if (queries.q == nullptr || queries.positions == nullptr) return Invalid("queries", "missing data");
  for (int64_t i = 0; i < queries.n; ++i) {
    if (queries.positions[i] < 0) {
      return Invalid("positions", absl::StrCat("query ", i, " is at position ", queries.positions[i]));
    }
  }
  const size_t values = static_cast<size_t>(queries.n) * params.q_heads * d;
  if (const size_t i = FirstNonFinite(queries.q, values); i < values) {
    return Invalid("queries", absl::StrCat("value ", i, " is not finite"));
  }
  const size_t rows = static_cast<size_t>(queries.n) * params.q_heads;
  if (queries.logit_offset != nullptr) {
    if (const size_t i = FirstNonFinite(queries.logit_offset, rows); i < rows) {
      return Invalid("logit_offset", absl::StrCat("value ", i, " is not finite"));
    }
  }
  if (output.out == nullptr || output.lse == nullptr) return Invalid("output", "missing buffers");
  if (params.top_k > 0 && (output.topk_tokens == nullptr || output.topk_logits == nullptr)) {
    return Invalid("output", "top_k > 0 needs top-k buffers");
  }
  return absl::OkStatus();
}

namespace {

// Queries per pass: bounds the per-item softmax state (rows x head_dim floats
// for every kv head x chunk) during long prefills.
constexpr int64_t kQueriesPerPass = 32;

// Tokens per work item by default: 1024, large enough that the per-item
// setup and the merge are noise; halved (down to 256) while the cache would
// give fewer than 64 items, so that short caches and few kv heads still keep
// 32 threads busy. It depends on the cache alone: a query's result is the
// same whatever else the batch holds.
int64_t DefaultChunkTokens(const PagedKvCache& cache) {
  int64_t chunk = 1024;
  while (chunk > 256 && cache.kv_heads * ((cache.tokens + chunk - 1) / chunk) < 64) chunk /= 2;
  return chunk;
}

// Work items a thread gets at least when the heads of a short cache's pass
// go in one item (Pass::heads_together).
constexpr int64_t kItemsPerThread = 8;

// Up to kQueriesPerPass queries of one problem, scanned together: each kv
// head's span is cut into chunks, one work item per (head, chunk), or one
// for all heads (heads_together).
struct Pass {
  const PagedKvCache* cache = nullptr;
  AttentionQueries queries;  // this pass's queries
  AttentionOutput output;    // and their rows of the problem's output
  int rows = 0;              // queries.n * group
  std::vector<int64_t> first, last;  // visible range of each query (first > last: none)
  int64_t begin = 0, end = 0;        // the span any query sees (end <= begin: none)
  int64_t chunk = 0;                 // tokens per chunk; chunk c covers [c * chunk, (c + 1) * chunk)
  int64_t first_chunk = 0, chunks = 0;
  int64_t first_item = 0;            // index of its first work item in the batch
  std::shared_ptr<const HadamardRotation> key_rotation, value_rotation;
  // A problem's transform and sinks, applied in its work items: queries
  // scaled and offset as each head's rows are taken, and each head's rows
  // finished, then merged with the head's sinks (AttendFewCpu), by the item
  // that finishes the head.
  const KeyTransform* transform = nullptr;
  const PagedKvCache* sinks = nullptr;
  bool heads_together = false;  // one chunk a head, and one work item for all heads
  // With more than one chunk: the chunks' states [kv_heads][chunks], and per
  // kv head its chunks not yet scanned (the item that scans the last one
  // finishes the head).
  std::vector<std::unique_ptr<ScanState>> states;
  std::unique_ptr<std::atomic<int64_t>[]> unscanned;
};

// rotation.Forward (inverse: Inverse) of `rows` vectors at x: SIMD, or the
// plain HadamardRotation on the reference path (the same bits either way).
void Rotate(const HadamardRotation& rotation, AttentionPath path, bool inverse, float* x, int64_t rows) {
  if (path == AttentionPath::kSimd) {
    RotateRowsSimd(rotation, inverse, x, rows);
    return;
  }
  const int b = rotation.block_values();
  for (int64_t r = 0; r < rows; ++r) {
    for (int block = 0; block < rotation.head_dim() / b; ++block) {
      float* v = x + r * rotation.head_dim() + block * b;
      inverse ? rotation.Inverse(block, v) : rotation.Forward(block, v);
    }
  }
}

// Asks for kv head h's key and value records of the cache (a layer's sinks:
// a few tokens, a page apart) to be brought into the cache. Always inlined:
// GCC takes a function of prefetches alone for one without effects and
// drops its calls.
__attribute__((always_inline)) inline void PrefetchRecords(const PagedKvCache& cache, int h) {
  constexpr size_t kLine = 64;
  for (int64_t t = cache.first_token; t < cache.tokens; ++t) {
    const uint8_t* key = cache.key_record(h, t);
    const uint8_t* value = cache.value_record(h, t);
    for (size_t b = 0; b < cache.key_layout.code_size(); b += kLine) __builtin_prefetch(key + b);
    for (size_t b = 0; b < cache.value_layout.code_size(); b += kLine) __builtin_prefetch(value + b);
  }
}

// A rotation, kept by the calling thread for its later calls: a Decode batch
// needs the same two per session for every layer, and each is 128 SplitMix64
// draws. At most kCachedRotations are kept (the cache is emptied past them).
constexpr size_t kCachedRotations = 1024;
std::shared_ptr<const HadamardRotation> CachedRotation(int head_dim, int block_values, uint64_t seed) {
  thread_local std::map<std::tuple<int, int, uint64_t>, std::shared_ptr<const HadamardRotation>> cache;
  const std::tuple<int, int, uint64_t> key{head_dim, block_values, seed};
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= kCachedRotations) cache.clear();
  auto rotation = std::make_shared<const HadamardRotation>(head_dim, block_values, seed);
  cache.emplace(key, rotation);
  return rotation;
}

// The visible ranges of the pass's queries and its rotations.
void PreparePass(const AttentionParams& params, Pass* pass) {
  const PagedKvCache& cache = *pass->cache;
  const int d = cache.key_layout.head_dim;
  const int group = params.q_heads / cache.kv_heads;
  const int64_t n = pass->queries.n;
  pass->rows = static_cast<int>(n) * group;
  pass->first.resize(n);
  pass->last.resize(n);
  pass->begin = cache.tokens;
  pass->end = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pass->queries.positions[i];
    pass->last[i] = std::min(p, cache.tokens - 1);
    pass->first[i] = std::max(cache.first_token, params.window > 0 ? p - params.window + 1 : 0);
    if (pass->first[i] > pass->last[i]) continue;  // sees nothing here
    pass->begin = std::min(pass->begin, pass->first[i]);
    pass->end = std::max(pass->end, pass->last[i] + 1);
  }
  // Scan from the start of a page, so that the scan's tiles (which never
  // cross a page) sit at the same positions whatever the other queries of
  // the pass see: each query's result is then the same, to the bit, alone or
  // batched with others. Tokens before a query's range are masked.
  pass->begin = pass->begin / cache.page_tokens * cache.page_tokens;
  if (TurboBits(cache.key_layout.kind) != 0) {
    pass->key_rotation = CachedRotation(d, cache.key_layout.block_values, cache.key_seed);
  }
  if (TurboBits(cache.value_layout.kind) != 0) {
    pass->value_rotation = CachedRotation(d, cache.value_layout.block_values, cache.value_seed);
  }
}

// Kv head h's query rows of the pass, rotated into the key domain, into q
// [rows][head_dim], and their logit offsets into offsets [rows] when the
// queries have some. Each work item makes its own: a head's rows are few, and
// the items then need no earlier phase of the pool.
void HeadQueries(const AttentionParams& params, AttentionPath path, const Pass& pass, int h,
                 std::vector<float>* q, std::vector<float>* offsets) {
  const int d = pass.cache->key_layout.head_dim;
  const int group = params.q_heads / pass.cache->kv_heads;
  const KeyTransform* t = pass.transform;
  const bool scaled = t != nullptr && !t->key_scale.empty();
  // With a softcap the key means' offsets go into the kernel (the cap sees
  // them); without, to the finished rows (FinishTransformedHead).
  const bool mean_offsets = t != nullptr && !t->key_mean.empty() && params.softcap > 0.0f;
  const float scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  q->resize(static_cast<size_t>(pass.rows) * d);
  offsets->resize(pass.queries.logit_offset != nullptr || mean_offsets ? pass.rows : 0);
  for (int r = 0; r < pass.rows; ++r) {
    const int64_t query = r / group;
    const int q_head = h * group + r % group;
    const size_t row = static_cast<size_t>(query) * params.q_heads + q_head;
    const float* given = pass.queries.q + row * d;
    if (scaled) {
      ScaleQueryRow(*t, h, given, q->data() + static_cast<size_t>(r) * d);
    } else {
      std::memcpy(q->data() + static_cast<size_t>(r) * d, given, d * sizeof(float));
    }
    const float offset = pass.queries.logit_offset != nullptr ? pass.queries.logit_offset[row] : 0.0f;
    if (mean_offsets) {
      (*offsets)[r] = KeyMeanOffset(*t, h, given, scale, offset);
    } else if (!offsets->empty()) {
      (*offsets)[r] = offset;
    }
  }
  if (pass.key_rotation) Rotate(*pass.key_rotation, path, /*inverse=*/false, q->data(), pass.rows);
}

// Kv head h's rows of the pass, finished as AttendTransformed finishes them:
// the key means' offsets (when the kernel did not have them) and the value
// means.
void FinishTransformedHead(const AttentionParams& params, const Pass& pass, int h) {
  const KeyTransform& t = *pass.transform;
  const int d = pass.cache->key_layout.head_dim;
  const int group = params.q_heads / pass.cache->kv_heads;
  const int k = params.top_k;
  const bool offsets = !t.key_mean.empty() && params.softcap <= 0.0f;
  const float scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  for (int r = 0; r < pass.rows; ++r) {
    const size_t o = static_cast<size_t>(r / group) * params.q_heads + h * group + r % group;
    const float offset =
        offsets ? KeyMeanOffset(t, h, pass.queries.q + o * d, scale,
                                pass.queries.logit_offset != nullptr ? pass.queries.logit_offset[o] : 0.0f)
                : 0.0f;
    FinishTransformedRow(&t, h, offsets ? &offset : nullptr, k, pass.output.out + o * d, pass.output.lse + o,
                         k ? pass.output.topk_tokens + o * k : nullptr, k ? pass.output.topk_logits + o * k : nullptr);
  }
}

// Kv head h's sinks attended (AttendFewCpu: the queries as given) and merged
// into the pass's finished rows of that head.
void MergeSinks(const AttentionParams& params, const Pass& pass, int h) {
  const int d = pass.cache->key_layout.head_dim;
  const int group = params.q_heads / pass.cache->kv_heads;
  const int k = params.top_k;
  const size_t rows = static_cast<size_t>(pass.queries.n) * params.q_heads;
  thread_local std::vector<float> out, lse, logits;
  thread_local std::vector<int64_t> tokens;
  out.resize(rows * d);
  lse.resize(rows);
  logits.resize(rows * k);
  tokens.resize(rows * k);
  AttentionProblem sinks;
  sinks.cache = *pass.sinks;
  sinks.queries = pass.queries;
  sinks.output = {out.data(), lse.data(), k ? tokens.data() : nullptr, k ? logits.data() : nullptr};
  sinks.few_tokens = true;
  AttendFewCpu(sinks, params, h, 0, pass.queries.n);
  for (int64_t i = 0; i < pass.queries.n; ++i) {
    const size_t o = static_cast<size_t>(i) * params.q_heads + h * group;
    MergeAttention(group, d, pass.output.out + o * d, pass.output.lse + o, out.data() + o * d, lse.data() + o);
    for (int g = 0; g < group && k > 0; ++g) {
      MergeTopK(k, pass.output.topk_tokens + (o + g) * k, pass.output.topk_logits + (o + g) * k,
                tokens.data() + (o + g) * k, logits.data() + (o + g) * k);
    }
  }
}

// Merges kv head h's chunks in order, normalizes, rotates the values back and
// writes the pass's output rows of that head. `only`: the head's one chunk's
// state, which a pass of one chunk a head must give (it has no
// pass.states); else the chunks' states in pass.states, or none (a pass
// whose queries see nothing here: empty rows).
void FinishHead(const AttentionParams& params, AttentionPath path, Pass& pass, int h, ScanState* only = nullptr) {
  const PagedKvCache& cache = *pass.cache;
  const int d = cache.key_layout.head_dim;
  const int group = params.q_heads / cache.kv_heads;
  std::unique_ptr<ScanState> empty;  // a pass whose queries see nothing here
  if (pass.chunks == 0) empty = std::make_unique<ScanState>(pass.rows, d, params.top_k);
  ScanState& total = only != nullptr      ? *only
                     : pass.chunks > 0 ? *pass.states[static_cast<size_t>(h) * pass.chunks]
                                       : *empty;
  for (int64_t c = 1; c < pass.chunks; ++c) MergeState(*pass.states[h * pass.chunks + c], d, &total);
  for (int r = 0; r < pass.rows; ++r) {
    const int64_t query = r / group;
    const int q_head = h * group + r % group;
    const size_t o = static_cast<size_t>(query) * params.q_heads + q_head;
    float* out = pass.output.out + o * d;
    const float* acc = total.acc.data() + static_cast<size_t>(r) * d;
    const float inv = total.l[r] > 0.0f ? 1.0f / total.l[r] : 0.0f;
    for (int i = 0; i < d; ++i) out[i] = acc[i] * inv;
    // A query's rows of the head are adjacent: rotated back together.
    if (pass.value_rotation && r % group == group - 1) {
      Rotate(*pass.value_rotation, path, /*inverse=*/true, out - static_cast<size_t>(group - 1) * d, group);
    }
    pass.output.lse[o] = total.l[r] > 0.0f ? total.m[r] + std::log(total.l[r]) : -INFINITY;
    if (params.top_k > 0) {
      std::vector<TopEntry> top = total.top[r].entries();
      std::sort(top.begin(), top.end(), Ranks);
      for (int k = 0; k < params.top_k; ++k) {
        const bool have = k < static_cast<int>(top.size());
        pass.output.topk_tokens[o * params.top_k + k] = have ? top[k].token : -1;
        pass.output.topk_logits[o * params.top_k + k] = have ? top[k].logit : -INFINITY;
      }
    }
  }
  // The chunks' states are merged: their memory goes now, not with the batch.
  if (only == nullptr) {
    for (int64_t c = 0; c < pass.chunks; ++c) pass.states[h * pass.chunks + c].reset();
  }
  if (pass.transform != nullptr) FinishTransformedHead(params, pass, h);
  if (pass.sinks != nullptr) MergeSinks(params, pass, h);
}

// fn(i) for i in [0, n), on the pool when there is one (`heavy` as
// ThreadPool::ParallelFor's).
void ForEach(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn, bool heavy = false) {
  if (pool != nullptr) {
    pool->ParallelFor(n, fn, heavy);
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

}  // namespace

namespace {

// A batch of problems, their transforms and sinks applied in the work items
// (sinks only those AttendFewCpu takes, on the SIMD path: AttendCpu).
absl::Status AttendItemsCpu(const AttentionBatch& batch, const AttentionParams& params,
                            const AttentionOptions& options) {
  for (int64_t i = 0; i < batch.count; ++i) {
    const AttentionProblem& p = batch.problems[i];
    if (p.transform == nullptr && p.sinks.tokens == 0) continue;
    if (absl::Status s = CheckTransformAndSinks(p, i); !s.ok()) return s;
    if (p.cache.kv_heads <= 0 || params.q_heads % p.cache.kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("problem ", i, ": q_heads ", params.q_heads,
                                                     " is not a multiple of kv_heads ", p.cache.kv_heads));
    }
    if (p.sinks.tokens == 0) continue;
    // The sinks' queries and outputs are the problem's, checked with it below.
    if (absl::Status s = CheckCache(p.sinks, params); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("problem ", i, ", its sinks: ", s.message()));
    }
  }
  for (int64_t i = 0; i < batch.count; ++i) {
    const AttentionProblem& p = batch.problems[i];
    absl::Status s = CheckAttention(p.cache, params, p.queries, p.output);
    if (s.ok() && p.few_tokens && !FewTokensApply(p.cache)) {
      s = Invalid("few_tokens", absl::StrCat("the cache holds ", p.cache.tokens, " tokens in ",
                                             CodecName(p.cache.key_layout.kind), "/",
                                             CodecName(p.cache.value_layout.kind), "; AttendFewCpu takes at most ",
                                             kMaxFewTokens, " in f16, q8_0 or q4_0"));
    }
    if (!s.ok()) {
      return batch.count == 1 ? s : absl::Status(s.code(), absl::StrCat("problem ", i, ": ", s.message()));
    }
  }

  // Every problem cut into passes of at most kQueriesPerPass queries. Those
  // marked few_tokens are attended, on the SIMD path, by AttendFewCpu: a work
  // item per kv head and pass, numbered before the scan's.
  struct FewItem {
    const AttentionProblem* problem;
    int head;
    int64_t first_query, queries;
  };
  std::vector<FewItem> few;
  std::vector<Pass> passes;
  for (int64_t i = 0; i < batch.count; ++i) {
    const AttentionProblem& p = batch.problems[i];
    if (options.path == AttentionPath::kSimd && p.few_tokens) {
      for (int64_t first = 0; first < p.queries.n; first += kQueriesPerPass) {
        for (int h = 0; h < p.cache.kv_heads; ++h) {
          few.push_back({&p, h, first, std::min(kQueriesPerPass, p.queries.n - first)});
        }
      }
      continue;
    }
    const size_t d = p.cache.key_layout.head_dim;
    const size_t q_heads = params.q_heads;
    const size_t k = params.top_k;
    for (int64_t first = 0; first < p.queries.n; first += kQueriesPerPass) {
      Pass pass;
      pass.cache = &p.cache;
      pass.transform = p.transform != nullptr && !p.transform->empty() ? p.transform : nullptr;
      if (p.sinks.tokens > 0) pass.sinks = &p.sinks;
      const size_t row = static_cast<size_t>(first) * q_heads;
      pass.queries = {std::min(kQueriesPerPass, p.queries.n - first), p.queries.q + row * d,
                      p.queries.positions + first,
                      p.queries.logit_offset != nullptr ? p.queries.logit_offset + row : nullptr};
      pass.output = {p.output.out + row * d, p.output.lse + row, k ? p.output.topk_tokens + row * k : nullptr,
                     k ? p.output.topk_logits + row * k : nullptr};
      passes.push_back(std::move(pass));
    }
  }
  for (Pass& pass : passes) PreparePass(params, &pass);

  // Work items: (pass, kv head, chunk), or (pass) for all its heads, all in
  // one call of the pool (each of its phases costs every thread a wake-up).
  // Chunks sit on a grid fixed by position, so that how a query's tokens are
  // cut (and merged) depends on neither the pool size nor the other queries
  // of the batch.
  int64_t items = static_cast<int64_t>(few.size());
  int64_t one_chunk = 0;
  int64_t head_items = 0;  // the items with every head a work item of its own
  for (Pass& pass : passes) {
    const int64_t chunk = options.chunk_tokens > 0 ? options.chunk_tokens : DefaultChunkTokens(*pass.cache);
    pass.chunk = chunk;
    pass.first_chunk = pass.begin / chunk;
    pass.chunks = pass.end > pass.begin ? (pass.end - 1) / chunk - pass.first_chunk + 1 : 0;
    one_chunk += pass.chunks == 1 ? 1 : 0;
    head_items += static_cast<int64_t>(pass.cache->kv_heads) * pass.chunks;
  }
  // Short caches in a batch that gives every thread many of them (a Decode
  // step of many short sessions): each one's heads go in one item, so that
  // the pool's dispatch is paid once a session, not once a kv head. Each
  // head is computed as alone: the same bits either way.
  const int threads = options.pool != nullptr ? options.pool->size() : 1;
  const bool heads_together = one_chunk >= kItemsPerThread * threads;
  // Fewer, larger items make as large a call of the pool as the same work a
  // head an item would, no larger: a call small enough for its caller (a
  // short Decode) stays on it.
  const bool large_call =
      options.large_encode ||
      (options.pool != nullptr && options.pool->Large(static_cast<int64_t>(options.encode_first.size()) +
                                                      static_cast<int64_t>(few.size()) + head_items));
  for (Pass& pass : passes) {
    pass.heads_together = heads_together && pass.chunks == 1;
    if (pass.chunks > 1) {  // one chunk: its item finishes the head alone
      pass.states.resize(static_cast<size_t>(pass.cache->kv_heads) * pass.chunks);
      pass.unscanned = std::make_unique<std::atomic<int64_t>[]>(pass.cache->kv_heads);
      for (int h = 0; h < pass.cache->kv_heads; ++h) pass.unscanned[h].store(pass.chunks, std::memory_order_relaxed);
    }
    pass.first_item = items;
    items += pass.heads_together ? 1 : static_cast<int64_t>(pass.cache->kv_heads) * pass.chunks;
    if (pass.chunks == 0) {  // no item: its outputs are empty
      for (int h = 0; h < pass.cache->kv_heads; ++h) FinishHead(params, options.path, pass, h);
    }
  }
  // One kv head's chunk `local` (head local / chunks) of a pass.
  const auto attend_chunk = [&](Pass& pass, int64_t local) {
    const int d = pass.cache->key_layout.head_dim;
    thread_local std::vector<float> q, offsets;
    ScanTask task;
    task.cache = pass.cache;
    task.head = static_cast<int>(local / pass.chunks);
    // The item that scans a head's one chunk finishes it: the head's sinks,
    // read then, are fetched while it scans (a short session's sinks would
    // otherwise cost their misses one after another).
    if (pass.sinks != nullptr && pass.chunks == 1) PrefetchRecords(*pass.sinks, task.head);
    HeadQueries(params, options.path, pass, task.head, &q, &offsets);
    const int64_t grid = (pass.first_chunk + local % pass.chunks) * pass.chunk;
    task.begin = std::max(pass.begin, grid);
    task.end = std::min(pass.end, grid + pass.chunk);
    task.rows = pass.rows;
    task.group = params.q_heads / pass.cache->kv_heads;
    task.q = q.data();
    task.first = pass.first.data();
    task.last = pass.last.data();
    if (!offsets.empty()) task.offset = offsets.data();
    task.scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
    task.softcap = params.softcap;
    task.top_k = params.top_k;
    task.integer_dot_products = options.integer_dot_products;
    const auto scan = [&](ScanState* state) {
      if (options.path == AttentionPath::kScalar) {
        ScanScalar(task, state);
      } else {
        ScanSimd(task, state);
      }
    };
    if (pass.chunks == 1) {
      // The head's only chunk: finished from this thread's state, with no
      // state of the pass's to allocate, merge or free.
      thread_local ScanState state(0, 0, 0);
      state.Reset(pass.rows, d, params.top_k);
      scan(&state);
      FinishHead(params, options.path, pass, task.head, &state);
      return;
    }
    auto state = std::make_unique<ScanState>(pass.rows, d, params.top_k);
    scan(state.get());
    pass.states[local] = std::move(state);
    // The last of the head's chunks to finish merges them (acq_rel: it sees
    // every other chunk's state).
    if (pass.unscanned[task.head].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      FinishHead(params, options.path, pass, task.head);
    }
  };
  const auto attend_item = [&](int64_t item) {
    if (item < static_cast<int64_t>(few.size())) {
      const FewItem& f = few[static_cast<size_t>(item)];
      AttendFewCpu(*f.problem, params, f.head, f.first_query, f.queries);
      return;
    }
    auto next = std::upper_bound(passes.begin(), passes.end(), item,
                                 [](int64_t i, const Pass& p) { return i < p.first_item; });
    Pass& pass = *std::prev(next);
    const int64_t local = item - pass.first_item;
    if (!pass.heads_together) {
      attend_chunk(pass, local);
      return;
    }
    for (int h = 0; h < pass.cache->kv_heads; ++h) attend_chunk(pass, h);
  };
  // The new tokens first: indices are claimed in order, so by the time a
  // thread claims a work item every chunk is taken, and it waits at most for
  // the ones other threads are still storing (a few microseconds each; it
  // sleeps if one of them is held up).
  const int64_t encodes = static_cast<int64_t>(options.encode_first.size());
  std::atomic<int64_t> stored{0};
  std::mutex stored_mutex;
  std::condition_variable all_stored;
  ForEach(
      options.pool, encodes + items,
      [&](int64_t index) {
        if (index < encodes) {
          EncodeChunkCpu(options.encode_first[static_cast<size_t>(index)], nullptr);
          if (stored.fetch_add(1, std::memory_order_acq_rel) + 1 == encodes) {
            std::lock_guard<std::mutex> lock(stored_mutex);
            all_stored.notify_all();
          }
          return;
        }
        for (int spin = 0; stored.load(std::memory_order_acquire) < encodes; ++spin) {
          if (spin < 64) {
            std::this_thread::yield();
          } else {
            std::unique_lock<std::mutex> lock(stored_mutex);
            all_stored.wait(lock, [&] { return stored.load(std::memory_order_acquire) == encodes; });
          }
        }
        attend_item(index - encodes);
      },
      large_call);
  return absl::OkStatus();
}

}  // namespace

absl::Status AttendCpu(const AttentionBatch& batch, const AttentionParams& params,
                       const AttentionOptions& options) {
  if (batch.count < 0 || (batch.count > 0 && batch.problems == nullptr)) {
    return Invalid("batch", "missing problems");
  }
  // On the SIMD path, sinks that AttendFewCpu takes (the layers' own, f16 by
  // default) are attended by the item finishing their head: a Decode batch
  // of 32 sessions then has no problems of 4 tokens of its own, and no
  // per-session preparation on the caller's thread. Else the sinks are
  // problems of their own (AttendTransformed).
  const bool within_items =
      std::all_of(batch.problems, batch.problems + batch.count, [&](const AttentionProblem& p) {
        return p.sinks.tokens == 0 || (options.path == AttentionPath::kSimd && FewTokensApply(p.sinks));
      });
  if (within_items) return AttendItemsCpu(batch, params, options);
  return AttendTransformed(
      batch, params, [&](const AttentionBatch& b, const AttentionParams& p) { return AttendItemsCpu(b, p, options); },
      nullptr);
}

bool FewTokensApply(const PagedKvCache& cache) {
  return cache.tokens <= kMaxFewTokens && TurboBits(cache.key_layout.kind) == 0 &&
         TurboBits(cache.value_layout.kind) == 0;
}

void MergeAttention(size_t count, int head_dim, float* out_a, float* lse_a, const float* out_b,
                    const float* lse_b) {
  for (size_t i = 0; i < count; ++i) {
    const float m = std::max(lse_a[i], lse_b[i]);
    if (m == -INFINITY) continue;
    const float wa = std::exp(lse_a[i] - m);
    const float wb = std::exp(lse_b[i] - m);
    const float inv = 1.0f / (wa + wb);
    float* a = out_a + i * head_dim;
    const float* b = out_b + i * head_dim;
    for (int k = 0; k < head_dim; ++k) a[k] = (a[k] * wa + b[k] * wb) * inv;
    lse_a[i] = m + std::log(wa + wb);
  }
}

}  // namespace turbokv
