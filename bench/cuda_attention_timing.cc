#include "bench/cuda_attention_timing.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "bench/cuda_timing.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/page_layout.h"

namespace turbokv {

absl::StatusOr<CudaAttentionTiming> MeasureCudaAttention(const PagedKvCache& cache, int sessions,
                                                         const AttentionParams& params,
                                                         const AttentionQueries& queries, size_t cache_bytes,
                                                         CudaKernelChoice kernel) {
  const PageOrder order = kernel.tensor_cores ? PageOrder::kTokenGroups : PageOrder::kCanonical;
  if (kernel.tensor_cores && !TokenGroupsApply(cache.key_layout, cache.value_layout, cache.page_tokens)) {
    return absl::InvalidArgumentError("the tensor-core kernel takes pages of a multiple of 16 tokens (--page-tokens)");
  }
  const cuda::TensorCoreVariant variant{kernel.warps, kernel.stages};
  std::vector<std::unique_ptr<cuda::DevicePagedCache>> copies;
  for (int i = 0; i < sessions; ++i) {
    auto copy = cuda::DevicePagedCache::Upload(cache, 0, order);
    if (!copy.ok()) return copy.status();
    copies.push_back(*std::move(copy));
  }
  auto stream = cuda::CudaStream::Create(0);
  if (!stream.ok()) return stream.status();
  const size_t rows = static_cast<size_t>(queries.n) * params.q_heads;
  const size_t d = cache.key_layout.head_dim;
  std::vector<float> out(rows * d * sessions), lse(rows * sessions);
  std::vector<AttentionProblem> batch;
  for (int i = 0; i < sessions; ++i) {
    batch.push_back({copies[i]->descriptor(), queries, {out.data() + i * rows * d, lse.data() + i * rows}});
  }
  // The kernels' own time, call by call: the median of 21 calls after a warm-up.
  std::vector<double> seconds;
  for (int call = 0; call < 22; ++call) {
    if (absl::Status s = (*stream)->Attend({batch.data(), sessions}, params, variant); !s.ok()) return s;
    if (call > 0) seconds.push_back((*stream)->last_kernel_seconds());
  }
  std::sort(seconds.begin(), seconds.end());
  CudaAttentionTiming timing;
  timing.us_per_call = seconds[seconds.size() / 2] * 1e6;
  const size_t bytes = cache_bytes * sessions;
  void *source = nullptr, *target = nullptr;
  absl::Status status = cuda::CudaStatus(cudaMalloc(&source, bytes), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(&target, bytes), "cudaMalloc");
  if (status.ok()) {
    auto copy = MedianMsPerCall([&] {
      return cuda::CudaStatus(cudaMemcpyAsync(target, source, bytes, cudaMemcpyDeviceToDevice), "copy");
    }, 21, 10);
    if (copy.ok()) {
      timing.copy_gb_per_s = 2.0 * bytes / (*copy * 1e-3) / 1e9;
    } else {
      status = copy.status();
    }
  }
  cudaFree(source);
  cudaFree(target);
  if (!status.ok()) return status;
  return timing;
}

}  // namespace turbokv
