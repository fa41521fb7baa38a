#include "bench/cuda_attention_timing.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"

namespace turbokv {
namespace {

// Median milliseconds per call of `op` (21 timed batches of 10 calls after a warm-up).
template <class Op>
absl::StatusOr<float> MedianMsPerCall(Op op) {
  cudaEvent_t start, stop;
  if (auto s = cuda::CudaStatus(cudaEventCreate(&start), "cudaEventCreate"); !s.ok()) return s;
  if (auto s = cuda::CudaStatus(cudaEventCreate(&stop), "cudaEventCreate"); !s.ok()) return s;
  absl::Status status = op();
  std::vector<float> ms;
  for (int run = 0; run < 21 && status.ok(); ++run) {
    cudaEventRecord(start);
    for (int call = 0; call < 10 && status.ok(); ++call) status = op();
    cudaEventRecord(stop);
    float elapsed = 0;
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "kernels");
    if (status.ok()) status = cuda::CudaStatus(cudaEventElapsedTime(&elapsed, start, stop), "timer");
    ms.push_back(elapsed / 10);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

absl::StatusOr<CudaAttentionTiming> MeasureCudaAttention(const PagedKvCache& cache,
                                                         const AttentionParams& params,
                                                         const AttentionQueries& queries,
                                                         size_t cache_bytes) {
  auto device_cache = cuda::DevicePagedCache::Upload(cache, 0);
  if (!device_cache.ok()) return device_cache.status();
  const size_t rows = static_cast<size_t>(queries.n) * params.q_heads;
  const size_t d = cache.key_layout.head_dim;
  float *q = nullptr, *out = nullptr, *lse = nullptr;
  int64_t* positions = nullptr;
  void *copy_src = nullptr, *copy_dst = nullptr;
  absl::Status status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&q), rows * d * 4), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&out), rows * d * 4), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&lse), rows * 4), "cudaMalloc");
  if (status.ok()) {
    status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&positions), queries.n * 8), "cudaMalloc");
  }
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(&copy_src, cache_bytes), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(&copy_dst, cache_bytes), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMemcpy(q, queries.q, rows * d * 4, cudaMemcpyHostToDevice), "copy");
  if (status.ok()) {
    status = cuda::CudaStatus(cudaMemcpy(positions, queries.positions, queries.n * 8, cudaMemcpyHostToDevice), "copy");
  }
  CudaAttentionTiming timing;
  if (status.ok()) {
    auto attend = MedianMsPerCall([&] {
      return cuda::AttendCuda((*device_cache)->descriptor(), params, queries.n, q, positions, out, lse, nullptr);
    });
    auto copy = MedianMsPerCall([&] {
      return cuda::CudaStatus(cudaMemcpyAsync(copy_dst, copy_src, cache_bytes, cudaMemcpyDeviceToDevice), "copy");
    });
    if (!attend.ok()) {
      status = attend.status();
    } else if (!copy.ok()) {
      status = copy.status();
    } else {
      timing.us_per_call = *attend * 1e3;
      timing.copy_gb_per_s = 2.0 * cache_bytes / (*copy * 1e-3) / 1e9;
    }
  }
  for (void* p : {static_cast<void*>(q), static_cast<void*>(out), static_cast<void*>(lse),
                  static_cast<void*>(positions), copy_src, copy_dst}) {
    cudaFree(p);
  }
  if (!status.ok()) return status;
  return timing;
}

}  // namespace turbokv
