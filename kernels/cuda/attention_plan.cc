#include "kernels/cuda/attention_plan.h"

#include <algorithm>
#include <cstdint>

namespace turbokv::cuda {

int64_t SplitTokens(int64_t tokens) {
  int64_t chunk = kSplitTokens;
  while ((tokens + chunk - 1) / chunk > kMaxSplits) chunk *= 2;
  return chunk;
}

AttentionPlan PlanAttention(DeviceProblem* problems, int64_t count, int q_heads, int top_k) {
  AttentionPlan plan;
  if (count == 0) return plan;
  const int kv_heads = problems[0].cache.kv_heads;
  const int group = q_heads / kv_heads;
  plan.row_chunks = (group + kRowsPerBlock - 1) / kRowsPerBlock;
  for (int64_t i = 0; i < count; ++i) {
    DeviceProblem& p = problems[i];
    const int64_t tokens = std::max<int64_t>(1, p.cache.tokens);
    p.chunk = SplitTokens(tokens);
    p.splits = static_cast<int>((tokens + p.chunk - 1) / p.chunk);
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
