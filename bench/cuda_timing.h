// Timing of GPU work with CUDA events, for the benchmarks.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_codec.h"

namespace turbokv {

// Median milliseconds per call of `op` (which enqueues work and returns an
// absl::Status) over `runs` timed batches of `calls` calls, after one warm-up.
template <class Op>
absl::StatusOr<float> MedianMsPerCall(Op op, int runs, int calls) {
  cudaEvent_t start, stop;
  if (auto s = cuda::CudaStatus(cudaEventCreate(&start), "cudaEventCreate"); !s.ok()) return s;
  if (auto s = cuda::CudaStatus(cudaEventCreate(&stop), "cudaEventCreate"); !s.ok()) return s;
  absl::Status status = op();
  std::vector<float> ms;
  for (int run = 0; run < runs && status.ok(); ++run) {
    cudaEventRecord(start);
    for (int call = 0; call < calls && status.ok(); ++call) status = op();
    cudaEventRecord(stop);
    float elapsed = 0;
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "kernels");
    if (status.ok()) status = cuda::CudaStatus(cudaEventElapsedTime(&elapsed, start, stop), "timer");
    ms.push_back(elapsed / calls);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace turbokv
