#include "kernels/cuda/attention_plan.h"

#include <algorithm>

namespace turbokv::cuda {

AttentionPlan PlanAttention(DeviceProblem* problems, int64_t count, int q_heads, int sm_count, int top_k) {
  AttentionPlan plan;
  if (count == 0) return plan;
  const int kv_heads = problems[0].cache.kv_heads;
  const int group = q_heads / kv_heads;
  plan.row_chunks = (group + kRowsPerBlock - 1) / kRowsPerBlock;
  // Token work of the whole batch, in (token x block of rows) units.
  int64_t work = 0;
  for (int64_t i = 0; i < count; ++i) {
    work += problems[i].n * plan.row_chunks * kv_heads * std::max<int64_t>(1, problems[i].cache.tokens);
  }
  const int64_t target_blocks = 8 * static_cast<int64_t>(std::max(1, sm_count));
  int64_t split_tokens = std::max<int64_t>(kSplitQuantum, (work + target_blocks - 1) / target_blocks);
  split_tokens = (split_tokens + kSplitQuantum - 1) / kSplitQuantum * kSplitQuantum;
  for (int64_t i = 0; i < count; ++i) {
    DeviceProblem& p = problems[i];
    const int64_t tokens = std::max<int64_t>(1, p.cache.tokens);
    p.splits = static_cast<int>(std::min<int64_t>(kMaxSplits, (tokens + split_tokens - 1) / split_tokens));
    p.chunk = (tokens + p.splits - 1) / p.splits;
    const int64_t rows = p.n * q_heads;
    p.first_unit = plan.units;
    p.first_row = plan.rows;
    p.first_partial = plan.partials;
    p.first_logit = plan.logits;
    plan.units += p.n * plan.row_chunks * kv_heads * p.splits;
    plan.rows += rows;
    plan.partials += rows * p.splits;
    if (top_k > 0) plan.logits += rows * tokens;
  }
  return plan;
}

}  // namespace turbokv::cuda
