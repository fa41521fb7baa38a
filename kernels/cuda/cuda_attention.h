// A paged cache copied to the device, for the CUDA tests and benchmarks: its
// descriptor, like the daemon's view of device pages, has a host array of
// device page addresses (run it with CudaStream::Attend).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/attention.h"

namespace turbokv::cuda {

class DevicePagedCache {
 public:
  // The host cache's canonical pages, kept on the device in `order` (the
  // token groups: the tensor-core kernel's).
  static absl::StatusOr<std::unique_ptr<DevicePagedCache>> Upload(const PagedKvCache& host, int device,
                                                                   PageOrder order = PageOrder::kCanonical);
  ~DevicePagedCache();
  DevicePagedCache(const DevicePagedCache&) = delete;
  DevicePagedCache& operator=(const DevicePagedCache&) = delete;

  // pages: a host array of device pointers, valid while this lives.
  const PagedKvCache& descriptor() const { return descriptor_; }

 private:
  DevicePagedCache() = default;

  int device_ = 0;
  std::vector<const uint8_t*> pages_;
  PagedKvCache descriptor_;
};

}  // namespace turbokv::cuda
