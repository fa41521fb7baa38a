// Per-block encode and decode math shared by the scalar CPU reference and the
// CUDA kernels. Inputs are assumed finite (see codec.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/half.h"
#include "kernels/hd.h"
#include "kernels/layout.h"

namespace turbokv {

// What encoding lost, summed over the blocks of one vector: the encoders fill
// it from what they already hold (no decode pass) and EncodeStats
// (kernels/codec.h) turns it into a relative error.
struct QuantizationError {
  double error_sq = 0;  // ||x - decode(encode(x))||^2
  double norm_sq = 0;   // ||x||^2, as a sum of float squares
  int fields = 0;       // fp16 fields written: block scales, or f16's values
  int saturated = 0;    // ... whose value was beyond +-65504 (stored as +-65504)
  int underflowed = 0;  // ... nonzero, stored as an fp16 zero or subnormal (below 2^-14)

  // One value x and what decoding gives back for it.
  TURBOKV_HD void AddValue(float x, float decoded) {
    const float r = x - decoded;
    error_sq += static_cast<double>(r) * r;
    norm_sq += x * x;
  }
  // One block: its sums and its fp16 scale.
  TURBOKV_HD void AddBlock(double block_error_sq, double block_norm_sq, float scale, uint16_t scale_bits) {
    error_sq += block_error_sq;
    norm_sq += block_norm_sq;
    CountField(scale, scale_bits);
  }
  // One fp16 field: the float it was meant to hold and the bits stored.
  TURBOKV_HD void CountField(float value, uint16_t bits) {
    ++fields;
    if (fabsf(value) > kHalfMax) {
      ++saturated;
    } else if (value != 0.0f && (bits & 0x7c00u) == 0) {
      ++underflowed;
    }
  }
};

// 1 / d, or 0 when d is 0 or so small (subnormal) that 1 / d overflows: the
// quantized values then become 0 instead of an undefined float-to-int cast.
TURBOKV_HD float SafeReciprocal(float d) {
  const float r = d != 0.0f ? 1.0f / d : 0.0f;
  return fabsf(r) <= 3.4e38f ? r : 0.0f;
}

// --- q8_0: 32 values, fp16 d = max|x| / 127, q = round(x * (1 / d)) ----------

// `error`, when not null, gains what the block lost.
TURBOKV_HD void EncodeQ8Block(const float* x, uint8_t* out, QuantizationError* error = nullptr) {
  float amax = 0.0f;
  for (int j = 0; j < kGgmlBlockValues; ++j) amax = fmaxf(amax, fabsf(x[j]));
  const float d = amax / 127.0f;
  const float id = SafeReciprocal(d);
  const uint16_t d_bits = FloatToHalfBits(d);
  StoreHalfBits(out, d_bits);
  const float stored = HalfBitsToFloat(d_bits);
  float error_sq = 0.0f;  // local sums: `out` may alias `error`
  float norm_sq = 0.0f;
  for (int j = 0; j < kGgmlBlockValues; ++j) {
    const int8_t q = static_cast<int8_t>(roundf(x[j] * id));
    out[2 + j] = static_cast<uint8_t>(q);
    if (error) {
      const float r = x[j] - q * stored;
      error_sq += r * r;
      norm_sq += x[j] * x[j];
    }
  }
  if (error) error->AddBlock(error_sq, norm_sq, d, d_bits);
}

TURBOKV_HD void DecodeQ8Block(const uint8_t* in, float* x) {
  const float d = HalfBitsToFloat(LoadHalfBits(in));
  for (int j = 0; j < kGgmlBlockValues; ++j) x[j] = static_cast<int8_t>(in[2 + j]) * d;
}

// --- q4_0: 32 values, d = (value of largest magnitude) / -8, q in 0..15 ------

// `error`, when not null, gains what the block lost.
TURBOKV_HD void EncodeQ4Block(const float* x, uint8_t* out, QuantizationError* error = nullptr) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < kGgmlBlockValues; ++j) {
    if (fabsf(x[j]) > amax) {
      amax = fabsf(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = SafeReciprocal(d);
  const uint16_t d_bits = FloatToHalfBits(d);
  StoreHalfBits(out, d_bits);
  const float stored = HalfBitsToFloat(d_bits);
  float error_sq = 0.0f;  // local sums: `out` may alias `error`
  float norm_sq = 0.0f;
  for (int j = 0; j < kGgmlBlockValues / 2; ++j) {
    const int lo = static_cast<int>(fminf(15.0f, x[j] * id + 8.5f));
    const int hi = static_cast<int>(fminf(15.0f, x[j + 16] * id + 8.5f));
    out[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
    if (error) {
      const float r_lo = x[j] - static_cast<float>(lo - 8) * stored;
      const float r_hi = x[j + 16] - static_cast<float>(hi - 8) * stored;
      error_sq += r_lo * r_lo + r_hi * r_hi;
      norm_sq += x[j] * x[j] + x[j + 16] * x[j + 16];
    }
  }
  if (error) error->AddBlock(error_sq, norm_sq, d, d_bits);
}

TURBOKV_HD void DecodeQ4Block(const uint8_t* in, float* x) {
  const float d = HalfBitsToFloat(LoadHalfBits(in));
  for (int j = 0; j < kGgmlBlockValues / 2; ++j) {
    x[j] = static_cast<float>((in[2 + j] & 15) - 8) * d;
    x[j + 16] = static_cast<float>((in[2 + j] >> 4) - 8) * d;
  }
}

// --- turbo: quantizer applied to a rotated block ------------------------------
//
// z holds B values of H*S*x (unnormalized, so ||z|| = sqrt(B) * ||x||). The
// coordinates of u = z * sqrt(B) / ||z|| are quantized to the codebook, and the
// stored scale s = <z, c> / ||c||^2 equals ||x|| * <u, c> / ||c||^2, the
// MSE-optimal scale of docs/ARCHITECTURE.md, "The method". Decoding computes
// x_hat = S * H * (s * c) / B.

// 1 / ||z|| scaled to unit-variance coordinates; 0 for a zero block.
TURBOKV_HD float TurboNormalizer(float sum_squares, int block_values) {
  const float norm = sqrtf(sum_squares);
  return norm > 0.0f ? sqrtf(static_cast<float>(block_values)) / norm : 0.0f;
}

// The scale from <z, c> and ||c||^2, before its rounding to fp16.
TURBOKV_HD float TurboScale(float dot, float centroid_sq) {
  return centroid_sq > 0.0f ? dot / centroid_sq : 0.0f;
}

// The fp16 scale from <z, c> and ||c||^2.
TURBOKV_HD uint16_t TurboScaleBits(float dot, float centroid_sq) {
  return FloatToHalfBits(TurboScale(dot, centroid_sq));
}

// Adds one encoded turbo block to `error` from the encoder's own sums
// (||z||^2, <z, c>, ||c||^2), its scale and the scale's stored bits. Since
// x_hat = S * H * (s * c) / B and H * S / sqrt(B) is orthogonal,
// ||x - x_hat||^2 = ||z - s * c||^2 / B = (||z||^2 - 2 s <z, c> + s^2 ||c||^2) / B
// with s the stored fp16 scale: exact up to the float rounding of the sums
// and of the rotation, no decode needed.
TURBOKV_HD void AddTurboBlockError(float sum_squares, float dot, float centroid_sq, float scale,
                                   uint16_t scale_bits, int block_values, QuantizationError* error) {
  const double s = HalfBitsToFloat(scale_bits);
  const double residual = sum_squares - 2.0 * s * dot + s * s * centroid_sq;
  error->AddBlock((residual > 0.0 ? residual : 0.0) / block_values,
                  static_cast<double>(sum_squares) / block_values, scale, scale_bits);
}

// Sums over a block use one fixed order everywhere (scalar, SIMD of any width,
// CUDA), so every implementation computes the same norm and scale to the bit:
// 16 partial sums, partial r adding the terms i = r, r + 16, r + 32, ... in
// ascending order, then a fixed tree over the 16 partials.
constexpr int kSumLanes = 16;

TURBOKV_HD float SumPartials16(const float* partial) {
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = partial[l] + partial[l + 8];
  for (int l = 0; l < 4; ++l) t[l] = t[l] + t[l + 4];
  for (int l = 0; l < 2; ++l) t[l] = t[l] + t[l + 2];
  return t[0] + t[1];
}

// Scalar reference: quantizes one rotated block, writes scale and planes.
// `indices` is scratch space for block_values bytes. `error`, when not null,
// gains what the block lost.
TURBOKV_HD void EncodeTurboRotatedBlock(const float* z, int block_values, int bits,
                                        const float* centroids, const float* boundaries,
                                        uint8_t* indices, uint8_t* out, QuantizationError* error) {
  const int levels = 1 << bits;
  float squares[kSumLanes] = {};
  for (int i = 0; i < block_values; ++i) squares[i % kSumLanes] += z[i] * z[i];
  const float sum_squares = SumPartials16(squares);
  const float inv = TurboNormalizer(sum_squares, block_values);
  float dot[kSumLanes] = {};
  float centroid_sq[kSumLanes] = {};
  for (int i = 0; i < block_values; ++i) {
    const int index = QuantizeIndex(z[i] * inv, boundaries, levels);
    const float c = centroids[index];
    indices[i] = static_cast<uint8_t>(index);
    dot[i % kSumLanes] += z[i] * c;
    centroid_sq[i % kSumLanes] += c * c;
  }
  const float dot_sum = SumPartials16(dot);
  const float centroid_sq_sum = SumPartials16(centroid_sq);
  const float scale = TurboScale(dot_sum, centroid_sq_sum);
  const uint16_t scale_bits = FloatToHalfBits(scale);
  StoreHalfBits(out, scale_bits);
  if (error) AddTurboBlockError(sum_squares, dot_sum, centroid_sq_sum, scale, scale_bits, block_values, error);
  const int plane_bytes = block_values * bits / 8;
  for (int b = 0; b < plane_bytes; ++b) {
    out[kTurboScaleBytes + b] = TurboPlaneByte(indices, block_values, bits, b);
  }
}

// s / B for a stored block: decoded values in the rotated domain are f * c.
TURBOKV_HD float TurboDecodeFactor(const uint8_t* block, int block_values) {
  return HalfBitsToFloat(LoadHalfBits(block)) * (1.0f / static_cast<float>(block_values));
}

// Scalar reference: s * c / B in the rotated domain (apply S*H afterwards).
TURBOKV_HD void DecodeTurboRotatedBlock(const uint8_t* in, int block_values, int bits,
                                        const float* centroids, float* w) {
  const float f = TurboDecodeFactor(in, block_values);
  for (int i = 0; i < block_values; ++i) {
    w[i] = f * centroids[TurboIndex(in + kTurboScaleBytes, block_values, bits, i)];
  }
}

// One block of a record in the attention kernels' domain: turbo blocks stay
// rotated ((s / B) * c, apply S * H to get values), the others decode to plain
// values. `centroids` is the codebook of a turbo layout (unused otherwise).
TURBOKV_HD void DecodeBlockToKernelDomain(const CodecLayout& layout, const uint8_t* block,
                                          const float* centroids, float* x) {
  switch (layout.kind) {
    case CodecKind::kF16:
      for (int i = 0; i < layout.block_values; ++i) x[i] = HalfBitsToFloat(LoadHalfBits(block + 2 * i));
      return;
    case CodecKind::kQ8_0:
      DecodeQ8Block(block, x);
      return;
    case CodecKind::kQ4_0:
      DecodeQ4Block(block, x);
      return;
    default:
      DecodeTurboRotatedBlock(block, layout.block_values, TurboBits(layout.kind), centroids, x);
      return;
  }
}

// Value i of a record of an unrotated codec (f16, q8_0, q4_0).
template <CodecKind kKind>
TURBOKV_HD float PlainValueAt(const uint8_t* record, int i) {
  if (kKind == CodecKind::kF16) return HalfBitsToFloat(LoadHalfBits(record + 2 * i));
  if (kKind == CodecKind::kQ8_0) {
    const uint8_t* block = record + (i >> 5) * kQ8BlockBytes;
    return static_cast<int8_t>(block[2 + (i & 31)]) * HalfBitsToFloat(LoadHalfBits(block));
  }
  const uint8_t* block = record + (i >> 5) * kQ4BlockBytes;  // q4_0
  const int j = i & 31;
  const int q = j < 16 ? (block[2 + j] & 15) : (block[2 + j - 16] >> 4);
  return static_cast<float>(q - 8) * HalfBitsToFloat(LoadHalfBits(block));
}

// Value i (0 <= i < head_dim) of one record in the attention kernels' domain:
// rotated, (s / B) * c[index], for turbo codecs; the plain value otherwise.
// `centroids` is the codebook of a turbo layout (unused for the others).
TURBOKV_HD float DecodeValueAt(const CodecLayout& layout, const uint8_t* record, int i,
                               const float* centroids) {
  switch (layout.kind) {
    case CodecKind::kF16:
      return PlainValueAt<CodecKind::kF16>(record, i);
    case CodecKind::kQ8_0:
      return PlainValueAt<CodecKind::kQ8_0>(record, i);
    case CodecKind::kQ4_0:
      return PlainValueAt<CodecKind::kQ4_0>(record, i);
    default: {
      const int shift = BlockShift(layout.block_values);
      const uint8_t* block = record + static_cast<size_t>(i >> shift) * layout.block_bytes;
      const int j = i & (layout.block_values - 1);
      return TurboDecodeFactor(block, layout.block_values) *
             centroids[TurboIndex(block + kTurboScaleBytes, layout.block_values, TurboBits(layout.kind), j)];
    }
  }
}

// An aligned 16-bit little-endian word (turbo index planes start at even
// offsets of a 16-byte aligned page: one load on a GPU, not two).
TURBOKV_HD uint32_t LoadAlignedU16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  return LoadHalfBits(p);
#endif
}

// q[0..3] into v (on a GPU one 16-byte load: q must be 16-byte aligned).
TURBOKV_HD void LoadFloat4(const float* q, float* v) {
#if defined(__CUDA_ARCH__)
  const float4 x = *reinterpret_cast<const float4*>(q);
  v[0] = x.x;
  v[1] = x.y;
  v[2] = x.z;
  v[3] = x.w;
#else
  for (int e = 0; e < 4; ++e) v[e] = q[e];
#endif
}

// Eight f16 values at p (on a GPU one 16-byte load: p must be 16-byte
// aligned there).
TURBOKV_HD void LoadHalf8(const uint8_t* p, float* v) {
#if defined(__CUDA_ARCH__)
  const uint4 x = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = HalfBitsToFloat(static_cast<uint16_t>(w[k] & 0xffffu));
    v[2 * k + 1] = HalfBitsToFloat(static_cast<uint16_t>(w[k] >> 16));
  }
#else
  for (int k = 0; k < 8; ++k) v[k] = HalfBitsToFloat(LoadHalfBits(p + 2 * k));
#endif
}

// Dot products of kRows query rows (q + r * q_stride, d values each; q and
// q_stride 16-byte aligned) with one f16 record of d values (d a multiple
// of 8; the record 16-byte aligned on a GPU), eight values a load: the
// fp16 cache's key scoring. `dot` accumulates.
template <int kRows>
TURBOKV_HD void F16Dots(const uint8_t* record, int d, const float* q, int q_stride, int rows, float* dot) {
  for (int i = 0; i < d; i += 8) {
    float k[8];
    LoadHalf8(record + 2 * i, k);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      float qv[8];
      LoadFloat4(q + r * q_stride + i, qv);
      LoadFloat4(q + r * q_stride + i + 4, qv + 4);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int e = 0; e < 8; ++e) dot[r] = fmaf(qv[e], k[e], dot[r]);
    }
  }
}

// Dot products of kRows query rows (q + r * q_stride, 128 values each, in the
// rotated domain; q and q_stride 16-byte aligned) with one stored turbo
// block of 128 values: for each row, (s / B) * sum_j q[j] * c[index_j]. The
// block's index planes are read once into registers as 16-bit words; the
// values run in spans that share one shift of those words (32 values for 2
// and 3 bits, 64 for 4), so that within a span every word index and shift is
// a constant and a GPU thread keeps its registers few. The sums are fused
// multiply-adds (one GPU instruction). `dot` accumulates.
template <int kBits, int kRows>
TURBOKV_HD void TurboBlock128Dots(const uint8_t* block, const float* q, int q_stride, int rows,
                                  const float* centroids, float* dot) {
  constexpr int kWords = 128 * kBits / 16;
  constexpr int kSpan = kBits == 4 ? 64 : 32;
  uint32_t words[kWords];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kWords; ++k) words[k] = LoadAlignedU16(block + kTurboScaleBytes + 2 * k);
  float part[kRows] = {};
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int span = 0; span < 128 / kSpan; ++span) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j4 = 0; j4 < kSpan; j4 += 4) {
      float qv[kRows][4];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) LoadFloat4(q + r * q_stride + span * kSpan + j4, qv[r]);
      }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int e = 0; e < 4; ++e) {
        // Value j = span * kSpan + jj. 4 bits: byte j % 64, nibble j / 64.
        // 2 and 3 bits: low bits in byte j % 32 at bit 2 (j / 32); the
        // third in byte 32 + j % 16 at bit j / 16. The words are shifted
        // by the span already (below), so every shift here is a constant.
        const int jj = j4 + e;
        int index;
        if (kBits == 4) {
          index = (words[jj >> 1] >> (8 * (jj & 1))) & 15;
        } else {
          index = (words[jj >> 1] >> (8 * (jj & 1))) & 3;
          if (kBits == 3) {
            const int high = 32 + (jj & 15);
            index |= ((words[high >> 1] >> (8 * (high & 1) + (jj >> 4))) & 1) << 2;
          }
        }
        const float c = centroids[index];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int r = 0; r < kRows; ++r) {
          if (r < rows) part[r] = fmaf(qv[r][e], c, part[r]);
        }
      }
    }
    // The next span's bits down to where this one's were.
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kWords; ++k) words[k] >>= kBits == 4 ? 4 : 2;
  }
  const float f = TurboDecodeFactor(block, 128);
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) dot[r] += f * part[r];
  }
}

// The four values i = lane + 32 k (k = 0..3) of a turbo block of 128 values,
// in the kernels' domain ((s / B) * c), as DecodeValueAt computes them: the
// share of one of 32 GPU threads that decode a block together. Each thread
// reads at most two index bytes, since lane + 32 k falls in the same plane
// bytes for every k.
TURBOKV_HD void TurboBlock128LaneValues(const uint8_t* block, int bits, int lane,
                                        const float* centroids, float* v) {
  const float f = TurboDecodeFactor(block, 128);
  const uint8_t* planes = block + kTurboScaleBytes;
  if (bits == 4) {  // index i: byte i % 64, nibble i / 64
    const int b0 = planes[lane];
    const int b1 = planes[lane + 32];
    v[0] = f * centroids[b0 & 15];
    v[1] = f * centroids[b1 & 15];
    v[2] = f * centroids[b0 >> 4];
    v[3] = f * centroids[b1 >> 4];
    return;
  }
  const int low = planes[lane];  // index i: byte i % 32, bits 2 (i / 32)
  const int high = bits == 3 ? planes[32 + (lane & 15)] : 0;  // byte i % 16, bit i / 16
  for (int k = 0; k < 4; ++k) {
    int index = (low >> (2 * k)) & 3;
    if (bits == 3) index |= ((high >> ((lane >> 4) + 2 * k)) & 1) << 2;
    v[k] = f * centroids[index];
  }
}

// The same four values i = lane + 32 k of a record of 128 values of f16,
// q8_0 or q4_0 (as DecodeValueAt), with the codec's branch taken once, not
// once per value: the unrolled per-value switch cost a GPU thread its
// registers.
TURBOKV_HD void PlainLaneValues128(CodecKind kind, const uint8_t* record, int lane, float* v) {
  switch (kind) {
    case CodecKind::kF16:
      for (int k = 0; k < 4; ++k) v[k] = PlainValueAt<CodecKind::kF16>(record, lane + 32 * k);
      return;
    case CodecKind::kQ8_0:
      for (int k = 0; k < 4; ++k) v[k] = PlainValueAt<CodecKind::kQ8_0>(record, lane + 32 * k);
      return;
    default:
      for (int k = 0; k < 4; ++k) v[k] = PlainValueAt<CodecKind::kQ4_0>(record, lane + 32 * k);
      return;
  }
}

}  // namespace turbokv
