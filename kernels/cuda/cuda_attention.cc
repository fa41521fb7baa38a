#include "kernels/cuda/cuda_attention.h"

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_codec.h"

namespace turbokv::cuda {

absl::StatusOr<std::unique_ptr<DevicePagedCache>> DevicePagedCache::Upload(const PagedKvCache& host, int device) {
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
    cache->pages_.push_back(static_cast<const uint8_t*>(page));
    if (absl::Status s = CudaStatus(cudaMemcpy(page, host.pages[i], bytes, cudaMemcpyHostToDevice), "cudaMemcpy page");
        !s.ok()) {
      return s;
    }
  }
  cache->descriptor_ = host;
  cache->descriptor_.pages = cache->pages_.data();
  return cache;
}

DevicePagedCache::~DevicePagedCache() {
  cudaSetDevice(device_);
  for (const uint8_t* page : pages_) cudaFree(const_cast<uint8_t*>(page));
}

}  // namespace turbokv::cuda
