// GPU timing of the CUDA attention for turbokv-bench attend --impl cuda.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "kernels/attention.h"

namespace turbokv {

struct CudaAttentionTiming {
  double us_per_call = 0;      // median over repeated calls, CUDA events
  double copy_gb_per_s = 0;    // device-to-device copy of the cache's bytes, read + written
};

// Uploads `cache` to GPU 0 and times attention of `queries` against it.
absl::StatusOr<CudaAttentionTiming> MeasureCudaAttention(const PagedKvCache& cache,
                                                         const AttentionParams& params,
                                                         const AttentionQueries& queries,
                                                         size_t cache_bytes);

}  // namespace turbokv
