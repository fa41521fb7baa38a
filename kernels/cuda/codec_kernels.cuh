// CUDA launchers for the codecs. Same bytes as the CPU reference (layout.h,
// docs/FORMAT.md). Host code includes this header; only codec_kernels.cu sees
// the kernels. Each launcher dispatches (codec, block size, bits) to a template
// once, enqueues on `stream` and returns the launch error, or
// cudaErrorNotSupported for a layout it has no kernel for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/layout.h"

namespace turbokv::cuda {

// x: n * head_dim floats on the device; codes: n * layout.code_size() bytes on
// the device. `seed` is the rotation seed (turbo codecs only).
cudaError_t LaunchEncode(const CodecLayout& layout, uint64_t seed, size_t n, const float* x,
                         uint8_t* codes, cudaStream_t stream);
cudaError_t LaunchDecode(const CodecLayout& layout, uint64_t seed, size_t n, const uint8_t* codes,
                         float* x, cudaStream_t stream);

}  // namespace turbokv::cuda
