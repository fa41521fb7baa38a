// CUDA attention behind an absl::Status API, and a device copy of a paged
// cache for tests and tools.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention.h"

namespace turbokv::cuda {

// A paged cache copied to the device; descriptor() holds device pointers.
class DevicePagedCache {
 public:
  static absl::StatusOr<std::unique_ptr<DevicePagedCache>> Upload(const PagedKvCache& host, int device);
  ~DevicePagedCache();
  DevicePagedCache(const DevicePagedCache&) = delete;
  DevicePagedCache& operator=(const DevicePagedCache&) = delete;

  const PagedKvCache& descriptor() const { return descriptor_; }
  int device() const { return device_; }

 private:
  DevicePagedCache() = default;

  int device_ = 0;
  std::vector<void*> pages_;
  const uint8_t** page_table_ = nullptr;  // device array of the page pointers
  PagedKvCache descriptor_;
};

// Attention on the device, enqueued on `stream`. `cache` and every array are
// device memory (see LaunchAttention); the caller has validated the request
// (CheckAttention). UNIMPLEMENTED for what the kernels do not cover (top_k,
// head_dim above 512): run those on the CPU.
absl::Status AttendCuda(const PagedKvCache& cache, const AttentionParams& params, int64_t n_queries,
                        const float* q, const int64_t* positions, float* out, float* lse,
                        cudaStream_t stream);

// The same with host queries and outputs: validates, copies in, runs, copies
// out and waits. For tests and tools.
absl::Status AttendCudaFromHost(const DevicePagedCache& cache, const AttentionParams& params,
                                const AttentionQueries& queries, const AttentionOutput& output);

}  // namespace turbokv::cuda
