// Encode and decode kernels. The turbo kernels give one warp to one rotation
// block: each lane holds B/32 consecutive values, the Walsh-Hadamard stages
// inside a lane run on registers and the others through warp shuffles, with the
// butterflies (a + b, a - b) of FastWalshHadamard. Sums follow the fixed order of
// SumPartials16 through shared memory, and the per-value math is the shared
// host/device code of block_math.h, so the bytes equal the CPU reference's.
// Built with --fmad=false: no multiply-add contraction, as on the CPU.
#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cuda/codec_kernels.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/rotation.h"

namespace turbokv::cuda {
namespace {

__constant__ Codebook c_codebooks[] = {
#include "kernels/codebooks.inc"
};
constexpr int kCodebookCount = sizeof(kCodebooks) / sizeof(kCodebooks[0]);

constexpr int kWarpsPerBlock = 4;

__device__ const Codebook& DeviceCodebook(int block_values, int bits) {
  int i = 0;
  while (i + 1 < kCodebookCount &&
         !(c_codebooks[i].block_values == block_values && c_codebooks[i].bits == bits)) {
    ++i;
  }
  return c_codebooks[i];
}

// Partial r of SumPartials16: terms[r], terms[r + 16], ... in ascending order.
template <int B>
__device__ __forceinline__ float Partial(const float* terms, int r) {
  float s = 0.0f;
#pragma unroll
  for (int i = r; i < B; i += kSumLanes) s += terms[i];
  return s;
}

template <int B>
struct TurboScratch {
  float a[B];
  float b[B];
  float partial_a[kSumLanes];
  float partial_b[kSumLanes];
  uint8_t indices[B];
};

template <int B, int kBits>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    EncodeTurboKernel(int head_dim, int blocks, int block_bytes, uint64_t seed, size_t total_blocks,
                      const float* __restrict__ x, uint8_t* __restrict__ codes) {
  constexpr int V = B / 32;
  constexpr int kLevels = 1 << kBits;
  __shared__ TurboScratch<B> scratch_all[kWarpsPerBlock];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const size_t item = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= total_blocks) return;  // whole warps exit together
  TurboScratch<B>& s = scratch_all[warp];
  const size_t vec = item / blocks;
  const int blk = static_cast<int>(item % blocks);
  const float* in = x + vec * head_dim + blk * B;
  uint8_t* out = codes + vec * static_cast<size_t>(blocks) * block_bytes +
                 static_cast<size_t>(blk) * block_bytes;
  const Codebook& cb = DeviceCodebook(B, kBits);

  float v[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = lane * V + k;
    const float sign = RotationSignNegative(seed, blk * B + i) ? -1.0f : 1.0f;
    v[k] = in[i] * sign;
  }
  WarpFwht<V>(v, lane);

#pragma unroll
  for (int k = 0; k < V; ++k) s.a[lane * V + k] = v[k] * v[k];
  __syncwarp();
  if (lane < kSumLanes) s.partial_a[lane] = Partial<B>(s.a, lane);
  __syncwarp();
  const float inv = TurboNormalizer(SumPartials16(s.partial_a), B);
  __syncwarp();

#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = lane * V + k;
    const int index = QuantizeIndex(v[k] * inv, cb.boundaries, kLevels);
    const float c = cb.centroids[index];
    s.indices[i] = static_cast<uint8_t>(index);
    s.a[i] = v[k] * c;
    s.b[i] = c * c;
  }
  __syncwarp();
  if (lane < kSumLanes) {
    s.partial_a[lane] = Partial<B>(s.a, lane);
  } else {
    s.partial_b[lane - kSumLanes] = Partial<B>(s.b, lane - kSumLanes);
  }
  __syncwarp();
  if (lane == 0) {
    StoreHalfBits(out, TurboScaleBits(SumPartials16(s.partial_a), SumPartials16(s.partial_b)));
  }
  constexpr int kPlaneBytes = B * kBits / 8;
  for (int byte = lane; byte < kPlaneBytes; byte += 32) {
    out[kTurboScaleBytes + byte] = TurboPlaneByte(s.indices, B, kBits, byte);
  }
}

template <int B, int kBits>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    DecodeTurboKernel(int head_dim, int blocks, int block_bytes, uint64_t seed, size_t total_blocks,
                      const uint8_t* __restrict__ codes, float* __restrict__ x) {
  constexpr int V = B / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const size_t item = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= total_blocks) return;
  const size_t vec = item / blocks;
  const int blk = static_cast<int>(item % blocks);
  const uint8_t* in = codes + vec * static_cast<size_t>(blocks) * block_bytes +
                      static_cast<size_t>(blk) * block_bytes;
  float* out = x + vec * head_dim + blk * B;
  const Codebook& cb = DeviceCodebook(B, kBits);

  const float f = TurboDecodeFactor(in, B);
  float v[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    v[k] = f * cb.centroids[TurboIndex(in + kTurboScaleBytes, B, kBits, lane * V + k)];
  }
  WarpFwht<V>(v, lane);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = lane * V + k;
    const float sign = RotationSignNegative(seed, blk * B + i) ? -1.0f : 1.0f;
    out[i] = v[k] * sign;
  }
}

// One thread per 32-value block (q8_0, q4_0) or per value (f16).
__global__ void EncodeGgmlKernel(CodecKind kind, size_t total_blocks, const float* __restrict__ x,
                                 uint8_t* __restrict__ codes) {
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= total_blocks) return;
  if (kind == CodecKind::kQ8_0) {
    EncodeQ8Block(x + b * kGgmlBlockValues, codes + b * kQ8BlockBytes);
  } else {
    EncodeQ4Block(x + b * kGgmlBlockValues, codes + b * kQ4BlockBytes);
  }
}

__global__ void DecodeGgmlKernel(CodecKind kind, size_t total_blocks, const uint8_t* __restrict__ codes,
                                 float* __restrict__ x) {
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= total_blocks) return;
  if (kind == CodecKind::kQ8_0) {
    DecodeQ8Block(codes + b * kQ8BlockBytes, x + b * kGgmlBlockValues);
  } else {
    DecodeQ4Block(codes + b * kQ4BlockBytes, x + b * kGgmlBlockValues);
  }
}

__global__ void EncodeF16Kernel(size_t count, const float* __restrict__ x, uint8_t* __restrict__ codes) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) StoreHalfBits(codes + 2 * i, FloatToHalfBits(x[i]));
}

__global__ void DecodeF16Kernel(size_t count, const uint8_t* __restrict__ codes, float* __restrict__ x) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] = HalfBitsToFloat(LoadHalfBits(codes + 2 * i));
}

constexpr int kThreads = 256;

unsigned GridFor(size_t items, size_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// The kernels of one direction, for the launcher below.
struct EncodeKernels {
  using In = float;
  using Out = uint8_t;
  template <int B, int kBits>
  static auto Turbo() { return EncodeTurboKernel<B, kBits>; }
  static auto F16() { return EncodeF16Kernel; }
  static auto Ggml() { return EncodeGgmlKernel; }
};

struct DecodeKernels {
  using In = uint8_t;
  using Out = float;
  template <int B, int kBits>
  static auto Turbo() { return DecodeTurboKernel<B, kBits>; }
  static auto F16() { return DecodeF16Kernel; }
  static auto Ggml() { return DecodeGgmlKernel; }
};

// Dispatches (codec, block size, bits) to a kernel once and enqueues it.
template <class K>
cudaError_t Launch(const CodecLayout& layout, uint64_t seed, size_t n, const typename K::In* in,
                   typename K::Out* out, cudaStream_t stream) {
  if (layout.blocks == 0) return cudaErrorNotSupported;
  if (n == 0) return cudaSuccess;
  const size_t total_blocks = n * static_cast<size_t>(layout.blocks);
  switch (layout.kind) {
    case CodecKind::kF16: {
      const size_t count = n * layout.head_dim;
      K::F16()<<<GridFor(count, kThreads), kThreads, 0, stream>>>(count, in, out);
      return cudaGetLastError();
    }
    case CodecKind::kQ8_0:
    case CodecKind::kQ4_0:
      K::Ggml()<<<GridFor(total_blocks, kThreads), kThreads, 0, stream>>>(layout.kind, total_blocks,
                                                                          in, out);
      return cudaGetLastError();
    default:
      break;
  }
  const int bits = TurboBits(layout.kind);
  decltype(K::template Turbo<64, 2>()) kernel = nullptr;
  if (layout.block_values == 64) {
    kernel = bits == 2   ? K::template Turbo<64, 2>()
             : bits == 3 ? K::template Turbo<64, 3>()
             : bits == 4 ? K::template Turbo<64, 4>()
                         : nullptr;
  } else if (layout.block_values == 128) {
    kernel = bits == 2   ? K::template Turbo<128, 2>()
             : bits == 3 ? K::template Turbo<128, 3>()
             : bits == 4 ? K::template Turbo<128, 4>()
                         : nullptr;
  }
  if (kernel == nullptr) return cudaErrorNotSupported;
  kernel<<<GridFor(total_blocks, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
      layout.head_dim, layout.blocks, layout.block_bytes, seed, total_blocks, in, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchEncode(const CodecLayout& layout, uint64_t seed, size_t n, const float* x,
                         uint8_t* codes, cudaStream_t stream) {
  return Launch<EncodeKernels>(layout, seed, n, x, codes, stream);
}

cudaError_t LaunchDecode(const CodecLayout& layout, uint64_t seed, size_t n, const uint8_t* codes,
                         float* x, cudaStream_t stream) {
  return Launch<DecodeKernels>(layout, seed, n, codes, x, stream);
}

}  // namespace turbokv::cuda
