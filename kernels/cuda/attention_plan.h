// How a batch of attention problems is cut into blocks of the CUDA kernels
// (attention_kernels.cuh), and where its scratch goes. Plain C++: the plan is
// made on the host and its lookups run on both sides, so the CPU tests check
// them.
//
// The split kernel runs one block per unit = (problem, query, row chunk, kv
// head, split): up to kRowsPerBlock query heads of one GQA group, against
// the tokens of one split of the problem's cache. A problem's splits are a
// grid by position whose spacing depends on its cache's length alone
// (SplitTokens), never on the rest of the batch: a session's result is the
// same, to the bit, attended alone (Step) or in any Decode batch, as on the
// CPU. The merge kernel runs one block per output row (problem, query, q
// head).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/attention.h"
#include "kernels/hd.h"

namespace turbokv::cuda {

constexpr int kAttentionWarps = 4;  // warps per block of the split kernel
constexpr int kRowsPerBlock = 4;    // query heads of one GQA group per block (canonical caches)
// Tokens of a split of a cache that kMaxSplits splits of kSplitTokens hold;
// longer caches double it until they fit (SplitTokens).
constexpr int64_t kSplitTokens = 512;
constexpr int kMaxSplits = 256;
// Largest head dimension the kernels take (576: MLA's latent keys).
constexpr int kMaxCudaHeadDim = 576;

// One problem of a batch as the kernels read it. The caller fills the first
// part with device pointers (cache.pages: the device copy of the layer's
// page table); PlanAttention fills the rest.
struct DeviceProblem {
  PagedKvCache cache;
  int64_t n = 0;                       // queries
  const float* q = nullptr;            // [n][q_heads][head_dim]
  const int64_t* positions = nullptr;  // [n]
  float* out = nullptr;                // [n][q_heads][head_dim]
  float* lse = nullptr;                // [n][q_heads]
  int64_t* topk_tokens = nullptr;      // [n][q_heads][top_k], with top_k > 0
  float* topk_logits = nullptr;
  const float* logit_offset = nullptr;  // [n][q_heads], or nullptr

  int splits = 1;
  int64_t chunk = 1;          // tokens per split: split s holds [s * chunk, (s + 1) * chunk)
  int64_t first_unit = 0;     // split-kernel blocks of the problems before it
  int64_t first_row = 0;      // output rows (query x q head) before it
  int64_t first_partial = 0;  // partial states (row x split) before it
  int64_t first_logit = 0;    // with top_k: logits (row x token) before it
};

struct AttentionPlan {
  int row_chunks = 1;     // ceil(group / kRowsPerBlock)
  int64_t units = 0;      // split-kernel blocks
  int64_t rows = 0;       // output rows: merge blocks
  int64_t partials = 0;   // partial states: m, l and head_dim accumulators each
  int64_t logits = 0;     // with top_k: one float per visible-or-not token of each row

  // The scratch the kernels need, in floats from its start: the queries
  // rotated into the key domain [rows][head_dim], the partial states
  // [partials][head_dim + 2], the logits [logits].
  size_t q_rot_offset() const { return 0; }
  size_t partials_offset(int head_dim) const { return static_cast<size_t>(rows) * head_dim; }
  size_t logits_offset(int head_dim) const {
    return partials_offset(head_dim) + static_cast<size_t>(partials) * (head_dim + 2);
  }
  size_t workspace_bytes(int head_dim) const {
    return (logits_offset(head_dim) + static_cast<size_t>(logits)) * sizeof(float);
  }
};

// Query heads of one GQA group a split-kernel block takes: kRowsPerBlock
// for caches in the canonical order (the CUDA-core kernel); for the token
// groups (the tensor-core kernel, an mma's N of 8 per n-tile) 8, or 16 when
// the group has more than 8 and head_dim is at most 128.
TURBOKV_HD int RowsPerBlock(const PagedKvCache& cache, int group) {
  if (cache.order != PageOrder::kTokenGroups) return kRowsPerBlock;
  return group > 8 && cache.key_layout.head_dim <= 128 ? 16 : 8;
}

// The spacing of a cache's split grid: kSplitTokens, doubled until at most
// kMaxSplits splits hold `tokens`.
int64_t SplitTokens(int64_t tokens);

// Plans `count` problems sharing kv_heads, q_heads, head_dim and page order
// (their caches' tokens and query counts set): fills each problem's plan
// fields.
AttentionPlan PlanAttention(DeviceProblem* problems, int64_t count, int q_heads, int top_k);

// The scratch a query of a problem takes in a launch: its rotated rows, its
// splits' partial states and, with top_k, its logits.
size_t ScratchPerQuery(const PagedKvCache& cache, const AttentionParams& params);

// The problems cut into launches whose scratch stays within scratch_bytes
// (one query of one problem alone may pass it): a problem's queries go in
// passes when they need more, each a problem over a slice of its queries
// and outputs. Every query of every problem is in exactly one pass, in
// order. A query's result does not depend on what else a launch holds, so
// the passes change nothing in it.
std::vector<std::vector<AttentionProblem>> CutIntoPasses(const AttentionProblem* problems, size_t count,
                                                         const AttentionParams& params, size_t scratch_bytes);

// The problem a split-kernel block, or an output row, belongs to: the last
// with first_unit (first_row) <= i.
TURBOKV_HD int64_t ProblemOfUnit(const DeviceProblem* problems, int64_t count, int64_t unit) {
  return LastAtOrBelow(problems, count, &DeviceProblem::first_unit, unit);
}

TURBOKV_HD int64_t ProblemOfRow(const DeviceProblem* problems, int64_t count, int64_t row) {
  return LastAtOrBelow(problems, count, &DeviceProblem::first_row, row);
}

// What a unit of a problem computes: unit - first_unit =
// ((query * row_chunks + row_chunk) * kv_heads + head) * splits + split.
struct Unit {
  int64_t query;
  int row_chunk;
  int head;
  int split;
};

TURBOKV_HD Unit UnitOf(const DeviceProblem& p, int64_t unit, int row_chunks) {
  int64_t local = unit - p.first_unit;
  Unit u;
  u.split = static_cast<int>(local % p.splits);
  local /= p.splits;
  u.head = static_cast<int>(local % p.cache.kv_heads);
  local /= p.cache.kv_heads;
  u.row_chunk = static_cast<int>(local % row_chunks);
  u.query = local / row_chunks;
  return u;
}

// The tokens of a cache a query at `position` sees: [first, last] (none
// when first > last): its window's, from the cache's first attended token to
// its last stored one.
struct VisibleTokens {
  int64_t first;
  int64_t last;
};

TURBOKV_HD VisibleTokens Visible(int64_t position, int64_t window, const PagedKvCache& cache) {
  const int64_t from_window = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
  return VisibleTokens{from_window > cache.first_token ? from_window : cache.first_token,
                       position < cache.tokens - 1 ? position : cache.tokens - 1};
}

}  // namespace turbokv::cuda
