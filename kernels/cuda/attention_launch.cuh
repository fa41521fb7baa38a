// What the attention kernels of one launch share (attention_kernels.cu runs
// the launch; the tensor-core split kernel, attention_tc.cu, is one of its
// split kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/attention_plan.h"

namespace turbokv::cuda {

struct Launch {
  const DeviceProblem* problems;
  int64_t count;
  int q_heads;
  int group;       // q heads per kv head
  int row_chunks;  // ceil(group / RowsPerBlock)
  int head_dim;
  float scale;
  float softcap;
  int64_t window;
  int top_k;
  float* q_rot;     // [rows][head_dim], in the key domain
  float* partials;  // [partials][head_dim + 2]: m, l, acc
  float* logits;    // with top_k: [logits]
};

// The split kernel's units of a launch whose caches are in the token-group
// order (kernels/page_layout.h), on the tensor cores (kernels/mma_tile.h):
// each unit's partial state into l.partials, its logits into l.logits with
// top_k, as the CUDA-core split kernel writes them. host_problems: the
// launch's problems on the host (their codecs size the shared memory).
// cudaErrorNotSupported for a head_dim other than 64, 128 or 256;
// cudaErrorInvalidValue for a variant not compiled for the batch.
cudaError_t LaunchTensorCoreSplit(const Launch& l, const DeviceProblem* host_problems, int64_t units,
                                  cudaStream_t stream, TensorCoreVariant variant);

}  // namespace turbokv::cuda
