// Attention computed directly on a compressed, paged KV cache (docs/
// ARCHITECTURE.md, "The method": attention without decoding back). Keys and values are never
// expanded to fp16: turbo keys are scored against the query rotated once into
// the key domain, values accumulate in the value-rotated domain, and each
// output is rotated back once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/layout.h"
#include "kernels/page_layout.h"

namespace turbokv {

class ThreadPool;
struct EncodeChunk;

// One layer's paged cache, as the kernels read it (docs/FORMAT.md, "Pages";
// kernels/page_layout.h, the layout's owner).
//
// Tokens live in pages of `page_tokens` tokens; page p holds tokens
// [p * page_tokens, (p + 1) * page_tokens). Inside a page, kv head by kv head,
// in the canonical order:
//
//   head h region, at h * page_tokens * (K + V) bytes:
//     keys    page_tokens records of K = key_layout.code_size() bytes, token-major
//     values  page_tokens records of V = value_layout.code_size() bytes
//
// so the key of token t (t < page_tokens) of head h starts at
//   h * page_tokens * (K + V) + t * K
// and its value at
//   h * page_tokens * (K + V) + page_tokens * K + t * V.
// Records are the codec format of docs/FORMAT.md. A page is
// kv_heads * page_tokens * (K + V) bytes; the last page may be partly filled.
// A backend may keep its pages in a native order instead (`order`,
// page_layout.h): the same regions, each record's bytes elsewhere in its
// region; the record accessors below are for the canonical order, which the
// CPU kernels read.
// Tokens before first_token are in the pages (as zeros) but never attended
// here: a layer's sink tokens, kept apart at higher precision
// (AttentionProblem::sinks).
struct PagedKvCache {
  CodecLayout key_layout;
  CodecLayout value_layout;
  uint64_t key_seed = 0;    // rotation seeds (turbo codecs)
  uint64_t value_seed = 0;
  int kv_heads = 0;
  int page_tokens = 0;
  int64_t tokens = 0;                  // tokens stored
  int64_t first_token = 0;             // the first attended token, <= tokens
  const uint8_t* const* pages = nullptr;  // ceil(tokens / page_tokens) pages
  PageOrder order = PageOrder::kCanonical;

  TURBOKV_HD SlotShape slots() const {
    return SlotShape{kv_heads, page_tokens, static_cast<int32_t>(key_layout.code_size()),
                     static_cast<int32_t>(value_layout.code_size())};
  }
  PageFormat format() const { return PageFormat{key_layout, value_layout, kv_heads, page_tokens, order}; }
  TURBOKV_HD size_t page_bytes() const { return slots().page_bytes(); }
  // Offsets inside a page of the records of slot s (token page * page_tokens + s).
  TURBOKV_HD size_t key_offset(int head, int64_t slot) const {
    return CanonicalKeyOffset(head, slot, page_tokens, key_layout.code_size(), value_layout.code_size());
  }
  TURBOKV_HD size_t value_offset(int head, int64_t slot) const {
    return CanonicalValueOffset(head, slot, page_tokens, key_layout.code_size(), value_layout.code_size());
  }
  TURBOKV_HD const uint8_t* key_record(int head, int64_t t) const {
    return pages[t / page_tokens] + key_offset(head, t % page_tokens);
  }
  TURBOKV_HD const uint8_t* value_record(int head, int64_t t) const {
    return pages[t / page_tokens] + value_offset(head, t % page_tokens);
  }
};

struct AttentionParams {
  int q_heads = 0;            // a multiple of kv_heads; q head h reads kv head h / (q_heads / kv_heads)
  float softmax_scale = 0.0f; // 0: 1 / sqrt(head_dim)
  float softcap = 0.0f;       // > 0: logits become softcap * tanh(logit / softcap)
  int64_t window = 0;         // > 0: a query at p sees only tokens (p - window, p]
  int top_k = 0;              // > 0: also return the k highest logits per query head
};

// n queries [n][q_heads][head_dim] f32, each at a position p >= 0: it sees
// the stored tokens of [first_token, tokens) among [0, p] (or the last
// `window` of [0, p]); a query past the stored tokens sees up to the last.
struct AttentionQueries {
  int64_t n = 0;
  const float* q = nullptr;
  const int64_t* positions = nullptr;
  // [n][q_heads], or nullptr: added to each logit of that query head before
  // the softcap (the part of a centered key's score its stored key lacks,
  // KeyTransform).
  const float* logit_offset = nullptr;
};

// out: [n][q_heads][head_dim] f32. lse: [n][q_heads], the natural-log
// log-sum-exp of the logits each output averaged over, so results over
// disjoint token sets merge exactly (MergeAttention). With top_k > 0:
// topk_tokens / topk_logits [n][q_heads][top_k], highest first; slots beyond
// the visible token count hold token -1 and logit -inf.
struct AttentionOutput {
  float* out = nullptr;
  float* lse = nullptr;
  int64_t* topk_tokens = nullptr;
  float* topk_logits = nullptr;
};

enum class AttentionPath {
  kScalar,  // the plain reference, the oracle of the tests
  kSimd,    // Highway SIMD, best target of this CPU
};

struct AttentionOptions {
  AttentionPath path = AttentionPath::kSimd;
  // Work is split over kv heads and token chunks (a short cache's heads
  // together, in a batch of many) and runs here; nullptr runs everything on
  // the calling thread.
  ThreadPool* pool = nullptr;
  // Tokens per work item: a head's tokens are cut on a grid of this many,
  // fixed by position, so that results do not depend on the pool size or on
  // the other problems and queries of the batch. 0: chosen from the cache
  // alone, 1024 down to 256 so that it gives at least 64 work items when it
  // can (short caches, few kv heads).
  int64_t chunk_tokens = 0;
  // Keys and values of every codec but f16 are scored and accumulated in
  // integers (int16 x int16 -> int32 multiply-adds, on every SIMD target;
  // AVX-512 VNNI for turbo keys and values where the CPU has it), within about
  // 1e-4 relative of the float scan. false forces the float scan, the
  // reference of the tests. (Problems marked few_tokens, a layer's sinks,
  // are attended in floats either way.)
  bool integer_dot_products = true;
  // New tokens to store before any problem is attended (kernels/paged_cache.h,
  // EncodeChunkCpu, a chunk an index): a Decode step's appends, whose pages
  // its problems read. They run first in the same parallel job, so the pool
  // wakes once for both; every work item waits until all are stored.
  // AttendCpu stores them even when the batch has no problem, and not at all
  // when it refuses one. large_encode: they are a large call by themselves
  // (ThreadPool::ParallelFor's heavy), however few the work items.
  absl::Span<const EncodeChunk> encode_first = {};
  bool large_encode = false;
};

struct KeyTransform;

// One problem of a batch: queries against one layer of one session's cache,
// and where their results go. A layer stored with a KeyTransform or with
// sink tokens is one problem too; AttendTransformed turns it into plain
// ones (what the device kernels take): queries scaled and offset for the
// pages, the sinks a problem of their own, merged after.
struct AttentionProblem {
  PagedKvCache cache;
  AttentionQueries queries;
  AttentionOutput output;
  // How the pages' vectors were stored (key_transform.h); nullptr: as given.
  const KeyTransform* transform = nullptr;
  // Tokens [0, cache.first_token) in host memory, their own codecs and one
  // page (sinks.tokens of them, never transformed); tokens 0: none.
  PagedKvCache sinks = {};
  // Set by AttendTransformed on the problem it makes of a layer's sinks when
  // FewTokensApply: AttendCpu's SIMD path attends it with AttendFewCpu. Not
  // chosen by the cache's length alone, which would make a query's result
  // depend on tokens past it (a 40-token fork against its 70-token source).
  bool few_tokens = false;
};

// Problems [count] sharing one AttentionParams (q_heads, scale, softcap,
// window, top_k): a decode step of every session of a batch for one layer.
// A single session's call is a batch of one.
struct AttentionBatch {
  const AttentionProblem* problems = nullptr;
  int64_t count = 0;
};

// Checks the descriptor, parameters and positions; INVALID_ARGUMENT naming
// the field otherwise. (Not the transform and sinks: AttendTransformed.)
absl::Status CheckAttention(const PagedKvCache& cache, const AttentionParams& params,
                            const AttentionQueries& queries, const AttentionOutput& output);

// Attention on the CPU over a whole batch: every problem is checked first
// (INVALID_ARGUMENT naming the problem and field, nothing computed), then the
// work items of all problems (kv head x token chunk) run as one parallel job.
// A problem's transform is applied in its items (its queries scaled and
// offset as each takes its head's rows; the offsets and value means added
// by the item finishing the head), and so are its sinks on the SIMD path
// when AttendFewCpu takes them (f16, q8_0, q4_0): attended and merged by that
// item. Other sinks make the batch go through AttendTransformed, as problems
// of their own in the same job. On the SIMD path a problem marked few_tokens
// (a layer's sinks) is attended by AttendFewCpu, one work item per kv head
// and pass of queries; INVALID_ARGUMENT when its cache does not qualify.
absl::Status AttendCpu(const AttentionBatch& batch, const AttentionParams& params,
                       const AttentionOptions& options = {});

// Runs a batch of plain problems (no transform, no sinks) on a device.
using PlainAttention = std::function<absl::Status(const AttentionBatch&, const AttentionParams&)>;

// A batch whose problems may carry a transform and sinks, on any device:
// each such problem's queries are multiplied by its key scales (and, with a
// softcap, given their logit offsets) for `pages`, which attends the pages;
// its sinks are attended by `sinks` (nullptr: by `pages`, in the same
// batch); then the offsets without a softcap go to the log-sum-exps and
// top-k logits, the value means to the outputs, and the sinks' results are
// merged in (MergeAttention, top-k lists merged). Problems without either
// pass through untouched. INVALID_ARGUMENT when a transform or sinks do not
// match their cache.
absl::Status AttendTransformed(const AttentionBatch& batch, const AttentionParams& params,
                               const PlainAttention& pages, const PlainAttention& sinks);

// AttendTransformed's pieces, which the CPU driver applies in its work items
// instead (a kv head's rows at a time), to the same bits:
// - the checks of a problem's transform and sinks against its cache
//   (INVALID_ARGUMENT naming problem `index`);
absl::Status CheckTransformAndSinks(const AttentionProblem& problem, int64_t index);
// - a query row of kv head `kv_head` times its key scales (out != q);
void ScaleQueryRow(const KeyTransform& transform, int kv_head, const float* q, float* out);
// - that row's logit offset: scale * <q, key mean> + given (q unscaled);
float KeyMeanOffset(const KeyTransform& transform, int kv_head, const float* q, float scale, float given);
// - after the pages, a row with a result (lse finite): `offset` (nullptr:
//   none, the kernel had it) into its lse and top-k logits, the kv head's
//   value mean into its output;
void FinishTransformedRow(const KeyTransform* transform, int kv_head, const float* offset, int top_k, float* out,
                          float* lse, const int64_t* topk_tokens, float* topk_logits);
// - a row's top-k list and its sinks' merged into the first (k entries each).
void MergeTopK(int k, int64_t* tokens, float* logits, const int64_t* sink_tokens, const float* sink_logits);

// The most tokens AttendFewCpu takes (a layer's sinks hold at most 64).
constexpr int64_t kMaxFewTokens = 64;

// Whether AttendFewCpu takes this cache: at most kMaxFewTokens tokens, in
// codecs that are not rotated (f16, q8_0, q4_0).
bool FewTokensApply(const PagedKvCache& cache);

// Attention over such a cache on the calling thread, for kv head `head` and
// queries [first_query, first_query + queries) of the problem: AttendCpu's
// results for those rows up to float rounding, without the scan's chunk
// states and set-up, which cost more than the arithmetic over a few tokens
// (a layer's 4 sinks, for every session of a Decode batch). The problem is
// checked by the caller (CheckAttention).
void AttendFewCpu(const AttentionProblem& problem, const AttentionParams& params, int head, int64_t first_query,
                  int64_t queries);

// A batch of one.
inline absl::Status AttendCpu(const PagedKvCache& cache, const AttentionParams& params,
                              const AttentionQueries& queries, const AttentionOutput& output,
                              const AttentionOptions& options = {}) {
  const AttentionProblem problem{cache, queries, output};
  return AttendCpu(AttentionBatch{&problem, 1}, params, options);
}

// Merges two results computed over disjoint token sets of the same queries
// (count = n * q_heads outputs of head_dim values): a becomes the result over
// both sets, exactly as if computed at once.
void MergeAttention(size_t count, int head_dim, float* out_a, float* lse_a, const float* out_b,
                    const float* lse_b);

}  // namespace turbokv
