#include "bench/cuda_attention_timing.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "bench/cuda_timing.h"
#include "kernels/cuda/cuda_attention.h"

namespace turbokv {

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
    }, 21, 10);
    auto copy = MedianMsPerCall([&] {
      return cuda::CudaStatus(cudaMemcpyAsync(copy_dst, copy_src, cache_bytes, cudaMemcpyDeviceToDevice), "copy");
    }, 21, 10);
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
