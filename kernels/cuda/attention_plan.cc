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
  const int rows_per_block = RowsPerBlock(problems[0].cache, group);
  plan.row_chunks = (group + rows_per_block - 1) / rows_per_block;
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

size_t ScratchPerQuery(const PagedKvCache& cache, const AttentionParams& params) {
  const int64_t tokens = std::max<int64_t>(1, cache.tokens);
  const int64_t splits = (tokens + SplitTokens(tokens) - 1) / SplitTokens(tokens);
  const int64_t d = cache.key_layout.head_dim;
  return static_cast<size_t>(params.q_heads) * (d + splits * (d + 2) + (params.top_k > 0 ? tokens : 0)) *
         sizeof(float);
}

std::vector<std::vector<AttentionProblem>> CutIntoPasses(const AttentionProblem* problems, size_t count,
                                                         const AttentionParams& params, size_t scratch_bytes) {
  std::vector<std::vector<AttentionProblem>> passes;
  std::vector<AttentionProblem> pass;
  size_t pass_bytes = 0;
  for (size_t i = 0; i < count; ++i) {
    const AttentionProblem& p = problems[i];
    const size_t d = static_cast<size_t>(p.cache.key_layout.head_dim);
    const size_t per_query = ScratchPerQuery(p.cache, params);
    for (int64_t q = 0; q < p.queries.n;) {
      if (!pass.empty() && pass_bytes + per_query > scratch_bytes) {
        passes.push_back(std::move(pass));
        pass.clear();
        pass_bytes = 0;
      }
      const int64_t room = static_cast<int64_t>((scratch_bytes - std::min(scratch_bytes, pass_bytes)) / per_query);
      const int64_t take = std::max<int64_t>(1, std::min(p.queries.n - q, room));
      const size_t rows = static_cast<size_t>(q) * params.q_heads;
      const size_t top = rows * params.top_k;
      pass.push_back(AttentionProblem{
          p.cache,
          AttentionQueries{take, p.queries.q + rows * d, p.queries.positions + q,
                           p.queries.logit_offset != nullptr ? p.queries.logit_offset + rows : nullptr},
          AttentionOutput{p.output.out + rows * d, p.output.lse + rows,
                          params.top_k > 0 ? p.output.topk_tokens + top : nullptr,
                          params.top_k > 0 ? p.output.topk_logits + top : nullptr}});
      pass_bytes += static_cast<size_t>(take) * per_query;
      q += take;
    }
  }
  if (!pass.empty()) passes.push_back(std::move(pass));
  return passes;
}

}  // namespace turbokv::cuda
