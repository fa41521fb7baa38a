#include "bench/cuda_codec_timing.h"

#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "bench/cuda_timing.h"

namespace turbokv {

absl::StatusOr<CudaCodecTiming> MeasureCudaCodec(const cuda::CudaCodec& codec, size_t vectors) {
  const size_t x_bytes = vectors * codec.layout().head_dim * sizeof(float);
  const size_t code_bytes = vectors * codec.code_size();
  std::vector<float> host(vectors * codec.layout().head_dim);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  for (float& v : host) v = normal(rng);

  float* x = nullptr;
  float* y = nullptr;
  uint8_t* codes = nullptr;
  absl::Status status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&x), x_bytes), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&y), x_bytes), "cudaMalloc");
  if (status.ok()) status = cuda::CudaStatus(cudaMalloc(reinterpret_cast<void**>(&codes), code_bytes), "cudaMalloc");
  if (status.ok()) {
    status = cuda::CudaStatus(cudaMemcpy(x, host.data(), x_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  CudaCodecTiming t;
  if (status.ok()) {
    auto encode = MedianMsPerCall([&] { return codec.EncodeAsync(vectors, x, codes, nullptr); }, 11, 1);
    auto decode = MedianMsPerCall([&] { return codec.DecodeAsync(vectors, codes, y, nullptr); }, 11, 1);
    auto copy = MedianMsPerCall([&] {
      return cuda::CudaStatus(cudaMemcpyAsync(y, x, x_bytes, cudaMemcpyDeviceToDevice), "copy");
    }, 11, 1);
    if (!encode.ok()) status = encode.status();
    else if (!decode.ok()) status = decode.status();
    else if (!copy.ok()) status = copy.status();
    else {
      t.encode_vectors_per_s = vectors / (*encode * 1e-3);
      t.decode_vectors_per_s = vectors / (*decode * 1e-3);
      t.encode_gb_per_s = (x_bytes + code_bytes) / (*encode * 1e-3) / 1e9;
      t.decode_gb_per_s = (x_bytes + code_bytes) / (*decode * 1e-3) / 1e9;
      t.copy_gb_per_s = 2.0 * x_bytes / (*copy * 1e-3) / 1e9;
    }
  }
  cudaFree(x);
  cudaFree(y);
  cudaFree(codes);
  if (!status.ok()) return status;
  return t;
}

}  // namespace turbokv
