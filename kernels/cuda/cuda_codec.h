// The CUDA codecs behind an absl::Status API. Same spec, same bytes as the CPU
// codecs of kernels/codec.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace turbokv::cuda {

// OK when `device` exists and can run our kernels; otherwise why not (no
// driver, no device, compute capability below 8.0), for logs and test skips.
absl::Status CheckDevice(int device);

// absl::Status for a CUDA error, naming the operation.
absl::Status CudaStatus(cudaError_t error, const char* what);

class CudaCodec {
 public:
  static absl::StatusOr<std::unique_ptr<CudaCodec>> Create(const CodecSpec& spec, int device);

  const CodecSpec& spec() const { return spec_; }
  const CodecLayout& layout() const { return layout_; }
  size_t code_size() const { return layout_.code_size(); }

  // Device pointers, enqueued on `stream` (the caller synchronizes).
  absl::Status EncodeAsync(size_t n, const float* x, uint8_t* codes, cudaStream_t stream) const;
  absl::Status DecodeAsync(size_t n, const uint8_t* codes, float* x, cudaStream_t stream) const;

  // Host pointers: copies in, runs, copies out and waits. For tests and tools.
  absl::Status Encode(size_t n, const float* x, uint8_t* codes) const;
  absl::Status Decode(size_t n, const uint8_t* codes, float* x) const;

 private:
  CudaCodec(const CodecSpec& spec, const CodecLayout& layout, int device)
      : spec_(spec), layout_(layout), device_(device) {}

  CodecSpec spec_;
  CodecLayout layout_;
  int device_;
};

}  // namespace turbokv::cuda
