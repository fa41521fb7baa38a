// CUDA launchers for the codecs. Same bytes as the CPU reference (layout.h,
// docs/FORMAT.md). Host code includes this header; only codec_kernels.cu sees
// the kernels. Each launcher dispatches (codec, block size, bits) to a template
// once, enqueues on `stream` and returns the launch error, or
// cudaErrorNotSupported for a layout it has no kernel for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/block_math.h"
#include "kernels/layout.h"
#include "kernels/vector_chunks.h"

namespace turbokv::cuda {

// x: n * head_dim floats on the device; codes: n * layout.code_size() bytes on
// the device. `seed` is the rotation seed (turbo codecs only).
cudaError_t LaunchEncode(const CodecLayout& layout, uint64_t seed, size_t n, const float* x,
                         uint8_t* codes, cudaStream_t stream);
cudaError_t LaunchDecode(const CodecLayout& layout, uint64_t seed, size_t n, const uint8_t* codes,
                         float* x, cudaStream_t stream);

// The same over chunks of layers' pages (vector_chunks.h): chunks[count] and
// everything they point to on the device, `vectors` vectors in all (the last
// chunk's first_vector + count * kv_heads). Every chunk has this layout
// (keys, or values, of layers with one codec and head_dim). errors, when not
// null: [vectors * layout.blocks], what each block lost (QuantizationError,
// the same numbers as the CPU encoders'); sum a vector's blocks for
// EncodeStats::AddVector.
cudaError_t LaunchEncodeChunks(const CodecLayout& layout, const VectorChunk* chunks, int count, size_t vectors,
                               QuantizationError* errors, cudaStream_t stream);
cudaError_t LaunchDecodeChunks(const CodecLayout& layout, const VectorChunk* chunks, int count, size_t vectors,
                               cudaStream_t stream);

// Zeroes pages[count] (the array and the pages on the device): the new pages
// of an encode, before its launches.
cudaError_t LaunchZeroPages(const ZeroedPage* pages, size_t count, cudaStream_t stream);

}  // namespace turbokv::cuda
