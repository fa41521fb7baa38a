// CUDA attention on compressed paged caches, a whole batch per launch
// (flash-decoding): a split kernel scores the tokens of one split of one
// problem per block against the query heads of one GQA group of one kv head,
// keeping a running softmax state (and, with top_k, writing every logit); a
// merge kernel combines a row's splits through their max and sum, normalizes
// and rotates the values back; a top-k kernel selects each row's highest
// logits. Same descriptors as the CPU (kernels/attention.h); results agree
// with the CPU's to float rounding (the kernels use the fast __expf).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/cuda/attention_plan.h"

namespace turbokv::cuda {

// Runs a planned batch (PlanAttention) on `stream`. host_problems: the
// planned problems on the host; device_problems: the same array in device
// memory; every pointer in them is device memory. workspace:
// plan.workspace_bytes(head_dim) bytes of device memory. The problems share
// kv_heads and head_dim, and params.q_heads is theirs; their codecs may
// differ. Returns cudaErrorNotSupported for head_dim above kMaxCudaHeadDim
// (or top_k above kMaxCudaTopK), cudaErrorInvalidValue for problems that do
// not share their shape; the caller validated the rest (CheckAttention).
cudaError_t LaunchAttention(const DeviceProblem* host_problems, const DeviceProblem* device_problems, int64_t count,
                            const AttentionPlan& plan, const AttentionParams& params, void* workspace,
                            cudaStream_t stream);

// Most top_k the top-k kernel selects (the service's limit).
constexpr int kMaxCudaTopK = 1024;

}  // namespace turbokv::cuda
