#include "kernels/cuda/cuda_attention.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/cuda_codec.h"

namespace turbokv::cuda {
namespace {

// Device memory freed on scope exit.
struct DeviceArray {
  void* ptr = nullptr;
  ~DeviceArray() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  absl::Status Allocate(size_t bytes) { return CudaStatus(cudaMalloc(&ptr, bytes ? bytes : 1), "cudaMalloc"); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<DevicePagedCache>> DevicePagedCache::Upload(const PagedKvCache& host,
                                                                            int device) {
  if (host.page_tokens <= 0 || host.kv_heads <= 0 || host.tokens < 0) {
    return absl::InvalidArgumentError("DevicePagedCache: page_tokens and kv_heads must be positive");
  }
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  std::unique_ptr<DevicePagedCache> cache(new DevicePagedCache());
  cache->device_ = device;
  const int64_t pages = (host.tokens + host.page_tokens - 1) / host.page_tokens;
  const size_t bytes = host.page_bytes();
  for (int64_t i = 0; i < pages; ++i) {
    void* page = nullptr;
    if (absl::Status s = CudaStatus(cudaMalloc(&page, bytes), "cudaMalloc page"); !s.ok()) return s;
    cache->pages_.push_back(page);
    if (absl::Status s = CudaStatus(cudaMemcpy(page, host.pages[i], bytes, cudaMemcpyHostToDevice), "cudaMemcpy page");
        !s.ok()) {
      return s;
    }
  }
  const size_t table_bytes = cache->pages_.size() * sizeof(void*);
  if (absl::Status s = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&cache->page_table_), table_bytes ? table_bytes : 1),
                                  "cudaMalloc page table");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaMemcpy(cache->page_table_, cache->pages_.data(), table_bytes, cudaMemcpyHostToDevice),
                                  "cudaMemcpy page table");
      !s.ok()) {
    return s;
  }
  cache->descriptor_ = host;
  cache->descriptor_.pages = cache->page_table_;
  return cache;
}

DevicePagedCache::~DevicePagedCache() {
  for (void* page : pages_) cudaFree(page);
  if (page_table_ != nullptr) cudaFree(page_table_);
}

absl::Status AttendCuda(const PagedKvCache& cache, const AttentionParams& params, int64_t n_queries,
                        const float* q, const int64_t* positions, float* out, float* lse,
                        cudaStream_t stream) {
  int device = 0, sm_count = 0;
  if (absl::Status s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
                                  "cudaDeviceGetAttribute");
      !s.ok()) {
    return s;
  }
  if (params.top_k > 0) return absl::UnimplementedError("top_k is computed on the CPU only");
  if (cache.key_layout.head_dim > kMaxCudaHeadDim) {
    return absl::UnimplementedError(absl::StrCat("CUDA attention takes head_dim up to ", kMaxCudaHeadDim));
  }
  const size_t bytes = AttentionWorkspaceBytes(cache, params, n_queries, sm_count);
  void* workspace = nullptr;
  if (absl::Status s = CudaStatus(cudaMallocAsync(&workspace, bytes, stream), "cudaMallocAsync"); !s.ok()) return s;
  const cudaError_t launched =
      LaunchAttention(cache, params, n_queries, q, positions, out, lse, workspace, bytes, sm_count, stream);
  const cudaError_t freed = cudaFreeAsync(workspace, stream);
  if (absl::Status s = CudaStatus(launched, "attention kernels"); !s.ok()) return s;
  return CudaStatus(freed, "cudaFreeAsync");
}

absl::Status AttendCudaFromHost(const DevicePagedCache& cache, const AttentionParams& params,
                                const AttentionQueries& queries, const AttentionOutput& output) {
  // CheckAttention reads the descriptor's sizes and the host queries and
  // positions, never the (device) pages.
  if (absl::Status s = CheckAttention(cache.descriptor(), params, queries, output); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaSetDevice(cache.device()), "cudaSetDevice"); !s.ok()) return s;
  const int d = cache.descriptor().key_layout.head_dim;
  const size_t rows = static_cast<size_t>(queries.n) * params.q_heads;
  DeviceArray q, positions, out, lse;
  for (auto [array, size] : {std::make_pair(&q, rows * d * sizeof(float)),
                             std::make_pair(&positions, queries.n * sizeof(int64_t)),
                             std::make_pair(&out, rows * d * sizeof(float)),
                             std::make_pair(&lse, rows * sizeof(float))}) {
    if (absl::Status s = array->Allocate(size); !s.ok()) return s;
  }
  if (absl::Status s = CudaStatus(cudaMemcpy(q.ptr, queries.q, rows * d * sizeof(float), cudaMemcpyHostToDevice), "copy q");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(
          cudaMemcpy(positions.ptr, queries.positions, queries.n * sizeof(int64_t), cudaMemcpyHostToDevice),
          "copy positions");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AttendCuda(cache.descriptor(), params, queries.n, q.as<float>(), positions.as<int64_t>(),
                                  out.as<float>(), lse.as<float>(), nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaMemcpy(output.out, out.ptr, rows * d * sizeof(float), cudaMemcpyDeviceToHost), "copy out");
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaMemcpy(output.lse, lse.ptr, rows * sizeof(float), cudaMemcpyDeviceToHost), "copy lse");
}

}  // namespace turbokv::cuda
