#include "kernels/cuda/cuda_attention.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/page_layout.h"

namespace turbokv::cuda {

absl::StatusOr<std::unique_ptr<DevicePagedCache>> DevicePagedCache::Upload(const PagedKvCache& host, int device,
                                                                           PageOrder order) {
  if (host.page_tokens <= 0 || host.kv_heads <= 0 || host.tokens < 0) {
    return absl::InvalidArgumentError("DevicePagedCache: page_tokens and kv_heads must be positive");
  }
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  std::unique_ptr<DevicePagedCache> cache(new DevicePagedCache());
  cache->device_ = device;
  const int64_t pages = (host.tokens + host.page_tokens - 1) / host.page_tokens;
  if (order == PageOrder::kTokenGroups && !TokenGroupsApply(host.key_layout, host.value_layout, host.page_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DevicePagedCache: pages of ", host.page_tokens, " tokens cannot be kept in 16-token groups"));
  }
  PagedKvCache ordered = host;
  ordered.order = order;
  const PageFormat format = ordered.format();
  const size_t bytes = host.page_bytes();
  std::vector<uint8_t> staged(bytes);
  for (int64_t i = 0; i < pages; ++i) {
    void* page = nullptr;
    if (absl::Status s = CudaStatus(cudaMalloc(&page, bytes), "cudaMalloc page"); !s.ok()) return s;
    cache->pages_.push_back(static_cast<const uint8_t*>(page));
    PageToOrder(format, host.pages[i], staged.data());
    if (absl::Status s = CudaStatus(cudaMemcpy(page, staged.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy page");
        !s.ok()) {
      return s;
    }
  }
  cache->descriptor_ = ordered;
  cache->descriptor_.pages = cache->pages_.data();
  return cache;
}

DevicePagedCache::~DevicePagedCache() {
  cudaSetDevice(device_);
  for (const uint8_t* page : pages_) cudaFree(const_cast<uint8_t*>(page));
}

}  // namespace turbokv::cuda
