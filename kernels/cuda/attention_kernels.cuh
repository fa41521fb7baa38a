// CUDA attention on a compressed paged cache (flash-decoding): a split kernel
// scores the tokens of one token range per block against the query heads of
// one kv head, keeping a running softmax state, and a merge kernel combines
// the ranges through their max and sum, normalizes and rotates the values
// back. Same descriptor as the CPU (kernels/attention.h); results agree with
// the CPU's to float rounding (the kernels use the fast __expf).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"

namespace turbokv::cuda {

// Largest head dimension the kernels take (shared memory holds each warp's
// accumulators for four query heads).
constexpr int kMaxCudaHeadDim = 512;

// Device memory the launcher needs for a problem, in bytes.
size_t AttentionWorkspaceBytes(const PagedKvCache& cache, const AttentionParams& params,
                               int64_t n_queries, int sm_count);

// All pointers are device pointers: cache.pages points to a device array of
// device page pointers; q [n][q_heads][d]; positions [n]; out [n][q_heads][d];
// lse [n][q_heads]. Returns cudaErrorNotSupported for what the kernels do not
// cover (top_k > 0, head_dim > kMaxCudaHeadDim); the caller validated the rest
// (CheckAttention).
cudaError_t LaunchAttention(const PagedKvCache& cache, const AttentionParams& params,
                            int64_t n_queries, const float* q, const int64_t* positions, float* out,
                            float* lse, void* workspace, size_t workspace_bytes, int sm_count,
                            cudaStream_t stream);

}  // namespace turbokv::cuda
