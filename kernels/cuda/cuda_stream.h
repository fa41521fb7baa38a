// Runs the CUDA kernels over batches described on the host: caches whose
// pages are device memory but whose page tables (host arrays of device page
// addresses), inputs and outputs are host memory, the way the daemon's
// store sees device pages. A CudaStream owns a CUDA stream, a device buffer
// and a pinned host buffer; each call stages its tables and inputs through
// the pinned buffer in one copy, launches, copies the results back in one
// copy and waits. The buffers grow to the largest call seen and are kept, so
// steady traffic allocates nothing. One thread at a time per CudaStream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/paged_cache.h"

namespace turbokv::cuda {

struct StagingLayout;

class CudaStream {
 public:
  // A stream on `device`, which must pass CheckDevice.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Create(int device);
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  // Attention over a batch (kernels/attention.h). The problems share
  // kv_heads and head_dim (INVALID_ARGUMENT otherwise); UNIMPLEMENTED for
  // head_dim above kMaxCudaHeadDim or top_k above kMaxCudaTopK. Checks
  // every problem first (CheckAttention). One launch when the kernels'
  // scratch fits kScratchBytes (a decode step of a batch does), passes of
  // queries otherwise. The problems share their page order too (the token
  // groups: the tensor-core kernel, in `variant`; attention_kernels.cuh).
  absl::Status Attend(const AttentionBatch& batch, const AttentionParams& params, TensorCoreVariant variant = {});
  // Encodes every chunk (kernels/paged_cache.h; pages on this device): its
  // new pages zeroed, then one launch per codec layout among their keys and
  // values, the same bytes as the CPU codecs, and their quantization error
  // when asked.
  absl::Status Encode(absl::Span<const EncodeChunk> chunks);
  // Decodes tokens [first, first + n) of a cache on this device into host
  // keys and values [n][kv_heads][head_dim].
  absl::Status Decode(const PagedKvCache& cache, int64_t first, int64_t n, float* keys, float* values);
  // Copies between host and device memory (through the pinned buffer).
  absl::Status CopyToHost(const void* device, size_t bytes, void* host);
  absl::Status CopyToDevice(const void* host, size_t bytes, void* device);

  // The most scratch one attention launch takes (rotated queries, partial
  // states, logits), past what its inputs and outputs need.
  static constexpr size_t kScratchBytes = size_t{256} << 20;

  // Seconds the device spent in the kernels of the last Attend, Encode or
  // Decode (CUDA events around the launches; the last pass of an Attend).
  double last_kernel_seconds() const { return last_kernel_seconds_; }

 private:
  explicit CudaStream(int device) : device_(device) {}
  // One launch over problems the caller checked.
  absl::Status AttendPass(const AttentionProblem* problems, size_t count, const AttentionParams& params,
                          TensorCoreVariant variant);
  // Enqueues the copy of a call's results back to the pinned buffer.
  absl::Status CopyBack(const StagingLayout& layout, const char* what);
  // Makes the device current and both buffers at least this large.
  absl::Status Reserve(size_t device_bytes, size_t host_bytes);
  // Waits for the stream; the kernels' time between the events.
  absl::Status Wait(const char* what);
  uint8_t* device_at(size_t offset) const { return static_cast<uint8_t*>(device_buffer_) + offset; }
  uint8_t* host_at(size_t offset) const { return static_cast<uint8_t*>(host_buffer_) + offset; }

  const int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t kernels_start_ = nullptr;
  cudaEvent_t kernels_end_ = nullptr;
  void* device_buffer_ = nullptr;
  size_t device_capacity_ = 0;
  void* host_buffer_ = nullptr;  // pinned
  size_t host_capacity_ = 0;
  double last_kernel_seconds_ = 0;
};

}  // namespace turbokv::cuda
