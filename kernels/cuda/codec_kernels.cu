// Encode and decode kernels. The turbo kernels give one warp to one rotation
// block: each lane holds B/32 consecutive values, the Walsh-Hadamard stages
// inside a lane run on registers and the others through warp shuffles, with the
// butterflies (a + b, a - b) of FastWalshHadamard. Sums follow the fixed order of
// SumPartials16 through shared memory, and the per-value math is the shared
// host/device code of block_math.h, so the bytes equal the CPU reference's.
// Built with --fmad=false: no multiply-add contraction, as on the CPU.
#include <algorithm>

#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cuda/codebooks.cuh"
#include "kernels/cuda/codec_kernels.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/rotation.h"
#include "kernels/vector_chunks.h"

namespace turbokv::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

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

// Where the vectors of a launch are. Contiguous: n vectors of head_dim
// floats and n records of code_size bytes, one seed (the tests' and
// benchmarks' layout). Chunked: chunks of a layer's pages (vector_chunks.h),
// a seed each.
struct Contiguous {
  float* x;
  uint8_t* codes;
  int head_dim;
  size_t code_size;
  uint64_t seed;
  __device__ ChunkVector operator()(size_t v) const { return ChunkVector{x + v * head_dim, codes + v * code_size, seed}; }
};

struct Chunked {
  const VectorChunk* chunks;
  int count;
  int head_dim;
  __device__ ChunkVector operator()(size_t v) const {
    return LocateChunkVector(chunks, count, static_cast<int64_t>(v), head_dim);
  }
};

// One warp per rotation block (item = vector * blocks + block). errors, when
// not null, gets what each block lost ([items]).
template <int B, int kBits, class Locate>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    EncodeTurboKernel(Locate locate, int blocks, int block_bytes, size_t total_blocks, QuantizationError* errors) {
  constexpr int V = B / 32;
  constexpr int kLevels = 1 << kBits;
  __shared__ TurboScratch<B> scratch_all[kWarpsPerBlock];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const size_t item = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= total_blocks) return;  // whole warps exit together
  TurboScratch<B>& s = scratch_all[warp];
  const int blk = static_cast<int>(item % blocks);
  const ChunkVector vector = locate(item / blocks);
  const float* in = vector.x + blk * B;
  const int at = blk * block_bytes;  // the block's canonical offset in the record
  const uint64_t seed = vector.seed;
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
  const float sum_squares = SumPartials16(s.partial_a);
  const float inv = TurboNormalizer(sum_squares, B);
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
    const float dot = SumPartials16(s.partial_a);
    const float centroid_sq = SumPartials16(s.partial_b);
    const float scale = TurboScale(dot, centroid_sq);
    const uint16_t scale_bits = FloatToHalfBits(scale);
    StoreHalfBits(vector.Field(at, kTurboScaleBytes), scale_bits);
    if (errors != nullptr) {
      QuantizationError error;
      AddTurboBlockError(sum_squares, dot, centroid_sq, scale, scale_bits, B, &error);
      errors[item] = error;
    }
  }
  // The first plane (turbo3: its low bits), then turbo3's high plane.
  constexpr int kPlaneBytes = B * kBits / 8, kFirstPlane = kBits == 3 ? B / 4 : kPlaneBytes;
  uint8_t* first = vector.Field(at + kTurboScaleBytes, kFirstPlane);
  uint8_t* high = vector.Field(at + kTurboScaleBytes + kFirstPlane, B / 8);
  for (int byte = lane; byte < kPlaneBytes; byte += 32) {
    const uint8_t value = TurboPlaneByte(s.indices, B, kBits, byte);
    if (byte < kFirstPlane) {
      first[byte] = value;
    } else {
      high[byte - kFirstPlane] = value;
    }
  }
}

template <int B, int kBits, class Locate>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    DecodeTurboKernel(Locate locate, int blocks, int block_bytes, size_t total_blocks, QuantizationError*) {
  constexpr int V = B / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const size_t item = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= total_blocks) return;
  const int blk = static_cast<int>(item % blocks);
  const ChunkVector vector = locate(item / blocks);
  const int at = blk * block_bytes;
  constexpr int kFirstPlane = kBits == 3 ? B / 4 : B * kBits / 8;
  const uint8_t* first = vector.Field(at + kTurboScaleBytes, kFirstPlane);
  const uint8_t* high = vector.Field(at + kTurboScaleBytes + kFirstPlane, B / 8);
  float* out = vector.x + blk * B;
  const Codebook& cb = DeviceCodebook(B, kBits);

  const float f = TurboDecodeFactor(vector.Field(at, kTurboScaleBytes), B);
  float v[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    v[k] = f * cb.centroids[TurboIndexOf(first, high, B, kBits, lane * V + k)];
  }
  WarpFwht<V>(v, lane);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int i = lane * V + k;
    const float sign = RotationSignNegative(vector.seed, blk * B + i) ? -1.0f : 1.0f;
    out[i] = v[k] * sign;
  }
}

// One thread per 32-value block (q8_0, q4_0).
template <class Locate>
__global__ void EncodeGgmlKernel(Locate locate, CodecKind kind, int blocks, int block_bytes, size_t total_blocks,
                                 QuantizationError* errors) {
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= total_blocks) return;
  const int blk = static_cast<int>(b % blocks);
  const ChunkVector vector = locate(b / blocks);
  const float* in = vector.x + blk * kGgmlBlockValues;
  uint8_t out[kQ8BlockBytes];  // the block, then its two fields where they go
  QuantizationError error;
  if (kind == CodecKind::kQ8_0) {
    EncodeQ8Block(in, out, errors != nullptr ? &error : nullptr);
  } else {
    EncodeQ4Block(in, out, errors != nullptr ? &error : nullptr);
  }
  const int at = blk * block_bytes, values = block_bytes - kTurboScaleBytes;
  uint8_t* scale = vector.Field(at, kTurboScaleBytes);
  uint8_t* codes = vector.Field(at + kTurboScaleBytes, values);
  scale[0] = out[0];
  scale[1] = out[1];
  for (int i = 0; i < values; ++i) codes[i] = out[kTurboScaleBytes + i];
  if (errors != nullptr) errors[b] = error;
}

template <class Locate>
__global__ void DecodeGgmlKernel(Locate locate, CodecKind kind, int blocks, int block_bytes, size_t total_blocks,
                                 QuantizationError*) {
  const size_t b = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= total_blocks) return;
  const int blk = static_cast<int>(b % blocks);
  const ChunkVector vector = locate(b / blocks);
  // The block's two fields, gathered.
  uint8_t in[kQ8BlockBytes];
  const int at = blk * block_bytes, values = block_bytes - kTurboScaleBytes;
  const uint8_t* scale = vector.Field(at, kTurboScaleBytes);
  const uint8_t* codes = vector.Field(at + kTurboScaleBytes, values);
  in[0] = scale[0];
  in[1] = scale[1];
  for (int i = 0; i < values; ++i) in[kTurboScaleBytes + i] = codes[i];
  float* out = vector.x + blk * kGgmlBlockValues;
  if (kind == CodecKind::kQ8_0) {
    DecodeQ8Block(in, out);
  } else {
    DecodeQ4Block(in, out);
  }
}

// One warp per vector (f16 is one block of head_dim values): lanes take
// every 32nd value; what the vector lost is summed over the warp.
template <class Locate>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    EncodeF16Kernel(Locate locate, int head_dim, size_t vectors, QuantizationError* errors) {
  const size_t v = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (v >= vectors) return;
  const ChunkVector vector = locate(v);
  QuantizationError error;
  for (int i = lane; i < head_dim; i += 32) {
    const float x = vector.x[i];
    const uint16_t bits = FloatToHalfBits(x);
    StoreHalfBits(vector.Field(0, 2 * head_dim) + 2 * i, bits);
    if (errors != nullptr) {
      error.AddValue(x, HalfBitsToFloat(bits));
      error.CountField(x, bits);
    }
  }
  if (errors == nullptr) return;
  error.error_sq = WarpSum(error.error_sq);
  error.norm_sq = WarpSum(error.norm_sq);
  error.fields = WarpSum(error.fields);
  error.saturated = WarpSum(error.saturated);
  error.underflowed = WarpSum(error.underflowed);
  if (lane == 0) errors[v] = error;
}

template <class Locate>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    DecodeF16Kernel(Locate locate, int head_dim, size_t vectors, QuantizationError*) {
  const size_t v = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (v >= vectors) return;
  const ChunkVector vector = locate(v);
  const uint8_t* record = vector.Field(0, 2 * head_dim);
  for (int i = lane; i < head_dim; i += 32) vector.x[i] = HalfBitsToFloat(LoadHalfBits(record + 2 * i));
}

// One block a page (pages 16-byte aligned): 16-byte stores, then the tail.
__global__ void ZeroPagesKernel(const ZeroedPage* pages, size_t count) {
  for (size_t i = blockIdx.x; i < count; i += gridDim.x) {
    uint8_t* page = pages[i].page;
    const size_t bytes = pages[i].bytes, wide = bytes / 16;
    for (size_t j = threadIdx.x; j < wide; j += blockDim.x) reinterpret_cast<uint4*>(page)[j] = make_uint4(0, 0, 0, 0);
    for (size_t j = wide * 16 + threadIdx.x; j < bytes; j += blockDim.x) page[j] = 0;
  }
}

constexpr int kThreads = 256;

unsigned GridFor(size_t items, size_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// The kernels of one direction, for the launcher below.
template <class Locate>
struct EncodeKernels {
  template <int B, int kBits>
  static auto Turbo() { return EncodeTurboKernel<B, kBits, Locate>; }
  static auto F16() { return EncodeF16Kernel<Locate>; }
  static auto Ggml() { return EncodeGgmlKernel<Locate>; }
};

template <class Locate>
struct DecodeKernels {
  template <int B, int kBits>
  static auto Turbo() { return DecodeTurboKernel<B, kBits, Locate>; }
  static auto F16() { return DecodeF16Kernel<Locate>; }
  static auto Ggml() { return DecodeGgmlKernel<Locate>; }
};

// Dispatches (codec, block size, bits) to a kernel once and enqueues it over
// n vectors. errors (encode only, may be null): [n * layout.blocks].
template <class K, class Locate>
cudaError_t Launch(const CodecLayout& layout, Locate locate, size_t n, QuantizationError* errors,
                   cudaStream_t stream) {
  if (layout.blocks == 0) return cudaErrorNotSupported;
  if (n == 0) return cudaSuccess;
  cudaGetLastError();  // what cudaGetLastError reports below is this launch's
  const size_t total_blocks = n * static_cast<size_t>(layout.blocks);
  switch (layout.kind) {
    case CodecKind::kF16:
      K::F16()<<<GridFor(n, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(locate, layout.head_dim, n, errors);
      return cudaGetLastError();
    case CodecKind::kQ8_0:
    case CodecKind::kQ4_0:
      K::Ggml()<<<GridFor(total_blocks, kThreads), kThreads, 0, stream>>>(locate, layout.kind, layout.blocks,
                                                                          layout.block_bytes, total_blocks, errors);
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
      locate, layout.blocks, layout.block_bytes, total_blocks, errors);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchEncode(const CodecLayout& layout, uint64_t seed, size_t n, const float* x,
                         uint8_t* codes, cudaStream_t stream) {
  // The input is only read: the kernels share one locator type with decode.
  const Contiguous locate{const_cast<float*>(x), codes, layout.head_dim, layout.code_size(), seed};
  return Launch<EncodeKernels<Contiguous>>(layout, locate, n, nullptr, stream);
}

cudaError_t LaunchDecode(const CodecLayout& layout, uint64_t seed, size_t n, const uint8_t* codes,
                         float* x, cudaStream_t stream) {
  const Contiguous locate{x, const_cast<uint8_t*>(codes), layout.head_dim, layout.code_size(), seed};
  return Launch<DecodeKernels<Contiguous>>(layout, locate, n, nullptr, stream);
}

cudaError_t LaunchEncodeChunks(const CodecLayout& layout, const VectorChunk* chunks, int count, size_t vectors,
                               QuantizationError* errors, cudaStream_t stream) {
  const Chunked locate{chunks, count, layout.head_dim};
  return Launch<EncodeKernels<Chunked>>(layout, locate, vectors, errors, stream);
}

cudaError_t LaunchDecodeChunks(const CodecLayout& layout, const VectorChunk* chunks, int count, size_t vectors,
                               cudaStream_t stream) {
  const Chunked locate{chunks, count, layout.head_dim};
  return Launch<DecodeKernels<Chunked>>(layout, locate, vectors, nullptr, stream);
}

cudaError_t LaunchZeroPages(const ZeroedPage* pages, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  cudaGetLastError();  // what cudaGetLastError reports below is this launch's
  constexpr size_t kMaxBlocks = 65535;  // pages past it loop in the blocks
  ZeroPagesKernel<<<static_cast<unsigned>(std::min(count, kMaxBlocks)), kThreads, 0, stream>>>(pages, count);
  return cudaGetLastError();
}

}  // namespace turbokv::cuda
