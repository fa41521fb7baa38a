// GPU timing of the CUDA attention for turbokv-bench attend --impl cuda.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "kernels/attention.h"

namespace turbokv {

// Which split kernel a timing runs: the CUDA-core one (caches in the
// canonical order) or the tensor-core one (the token-group order) in a
// variant, warps x stages ({0, 0}: its default; kernels/cuda/attention_kernels.cuh).
struct CudaKernelChoice {
  bool tensor_cores = false;
  int warps = 0;
  int stages = 0;
};

struct CudaAttentionTiming {
  double us_per_call = 0;    // median time of the kernels of one batched call (CUDA events around them)
  double copy_gb_per_s = 0;  // device-to-device copy of as many bytes as the batch's caches, read + written
};

// Uploads `cache` to GPU 0 `sessions` times and times attention of `queries`
// against each copy, the whole batch in one call (a decode step of
// `sessions` sessions), through the daemon's entry (CudaStream::Attend), on
// `kernel`. cache_bytes: what one copy's attention reads.
absl::StatusOr<CudaAttentionTiming> MeasureCudaAttention(const PagedKvCache& cache, int sessions,
                                                         const AttentionParams& params,
                                                         const AttentionQueries& queries, size_t cache_bytes,
                                                         CudaKernelChoice kernel = {});

}  // namespace turbokv
