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

// The tensor-core split kernel's shape (attention_tc.cu): warps a block and
// cp.async stages a warp. {0, 0}: the one the kernel's table chose for the
// batch's head dim and codecs.
struct TensorCoreVariant {
  int warps = 0;
  int stages = 0;
};

// Whether the tensor-core split kernel is compiled in `variant` for caches
// of this head dim and codec pair whose blocks take `rows_per_block` query
// heads (RowsPerBlock): the default, {4, 2}, for every shape; the sweep's
// others ({4, 3}, {8, 2}, {2, 4}) at head_dim 128 with 8 rows a block and
// turbo4, turbo3 or f16 on both sides (the presets' and the f16 baseline).
bool TensorCoreVariantCompiled(int head_dim, int rows_per_block, CodecKind keys, CodecKind values,
                               TensorCoreVariant variant);

// Runs a planned batch (PlanAttention) on `stream`. host_problems: the
// planned problems on the host; device_problems: the same array in device
// memory; every pointer in them is device memory. workspace:
// plan.workspace_bytes(head_dim) bytes of device memory. The problems share
// kv_heads and head_dim, and params.q_heads is theirs; their codecs may
// differ. Returns cudaErrorNotSupported for head_dim above kMaxCudaHeadDim
// (or top_k above kMaxCudaTopK), cudaErrorInvalidValue for problems that do
// not share their shape; the caller validated the rest (CheckAttention).
// Caches in the token-group order run the tensor-core split kernel (in
// `variant`), the others the CUDA-core one; a batch shares its order
// (cudaErrorInvalidValue otherwise, and for a variant not compiled).
cudaError_t LaunchAttention(const DeviceProblem* host_problems, const DeviceProblem* device_problems, int64_t count,
                            const AttentionPlan& plan, const AttentionParams& params, void* workspace,
                            cudaStream_t stream, TensorCoreVariant variant = {});

// Most top_k the top-k kernel selects (the service's limit).
constexpr int kMaxCudaTopK = 1024;

}  // namespace turbokv::cuda
