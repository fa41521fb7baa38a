// GPU timing of the CUDA codecs for turbokv-bench (CUDA events, device buffers).
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_codec.h"

namespace turbokv {

struct CudaCodecTiming {
  double encode_vectors_per_s = 0;
  double decode_vectors_per_s = 0;
  double encode_gb_per_s = 0;  // f32 read + codes written
  double decode_gb_per_s = 0;  // codes read + f32 written
  double copy_gb_per_s = 0;    // cudaMemcpy device to device, read + written
};

// Median of repeated runs over `vectors` random vectors on the codec's device.
absl::StatusOr<CudaCodecTiming> MeasureCudaCodec(const cuda::CudaCodec& codec, size_t vectors);

}  // namespace turbokv
