// Byte layouts of the codecs, shared by the CPU code and the CUDA kernels.
// docs/FORMAT.md is the normative description; this header implements it.
//
// One encoded vector of head_dim values is a sequence of blocks, little-endian:
//   f16     head_dim x fp16                                      2 bytes/value
//   q8_0    blocks of 32: fp16 d, 32 x int8 q; x = q * d          34 bytes/block
//   q4_0    blocks of 32: fp16 d, 16 bytes of nibbles; byte j holds value j
//           (low nibble) and value j + 16 (high); x = (q - 8) * d  18 bytes/block
//   turboN  rotation blocks of B (128 when head_dim % 128 == 0, else 64):
//           fp16 scale, then the N-bit centroid indices in planes:
//             turbo2: one 2-bit plane of B/4 bytes
//             turbo3: the same 2-bit plane of the low bits, then a 1-bit plane
//                     of B/8 bytes with the high bits
//             turbo4: one 4-bit plane of B/2 bytes
//           A plane of P bytes with k-bit fields holds index i in byte i % P at
//           bit k * (i / P). Consecutive bytes hold consecutive indices, so
//           SIMD and GPU code unpack a plane with shifts and masks only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/hd.h"

namespace turbokv {

// Stable numeric codes: they appear in docs/FORMAT.md and in stored data.
enum class CodecKind : uint8_t {
  kF16 = 1,
  kQ8_0 = 2,
  kQ4_0 = 3,
  kTurbo2 = 4,
  kTurbo3 = 5,
  kTurbo4 = 6,
};

constexpr int kGgmlBlockValues = 32;  // q8_0 and q4_0
constexpr int kQ8BlockBytes = 2 + 32;
constexpr int kQ4BlockBytes = 2 + 16;
constexpr int kTurboScaleBytes = 2;

// Bits per index of a turbo codec, 0 for the others.
TURBOKV_HD constexpr int TurboBits(CodecKind kind) {
  switch (kind) {
    case CodecKind::kTurbo2:
      return 2;
    case CodecKind::kTurbo3:
      return 3;
    case CodecKind::kTurbo4:
      return 4;
    default:
      return 0;
  }
}

// Rotation block size for a head dimension: 128 when it divides head_dim, else
// 64 when that does, else 0 (unsupported).
TURBOKV_HD constexpr int RotationBlockValues(int head_dim) {
  if (head_dim <= 0) return 0;
  if (head_dim % 128 == 0) return 128;
  if (head_dim % 64 == 0) return 64;
  return 0;
}

// Bytes of one turbo block: the fp16 scale plus B * bits / 8 bytes of indices.
TURBOKV_HD constexpr int TurboBlockBytes(int block_values, int bits) {
  return kTurboScaleBytes + block_values * bits / 8;
}

// Where the vectors of one codec start and how large they are. Every codec
// cuts a vector into equal blocks: `blocks` blocks of `block_values` values,
// each `block_bytes` bytes long (f16 is one block of head_dim values).
struct CodecLayout {
  CodecKind kind = CodecKind::kF16;
  int head_dim = 0;
  int block_values = 0;
  int blocks = 0;
  int block_bytes = 0;

  // Bytes of one encoded vector.
  TURBOKV_HD constexpr size_t code_size() const {
    return static_cast<size_t>(blocks) * static_cast<size_t>(block_bytes);
  }
  // Stored bits per value, scales included.
  double bits_per_value() const { return 8.0 * static_cast<double>(code_size()) / head_dim; }
};

// The layout of a codec at a head dimension; blocks == 0 when the head
// dimension is not supported (see RotationBlockValues).
TURBOKV_HD constexpr CodecLayout MakeCodecLayout(CodecKind kind, int head_dim) {
  CodecLayout layout;
  layout.kind = kind;
  layout.head_dim = head_dim;
  const int rotation_block = RotationBlockValues(head_dim);
  if (rotation_block == 0) return layout;
  switch (kind) {
    case CodecKind::kF16:
      layout.block_values = head_dim;
      layout.block_bytes = 2 * head_dim;
      break;
    case CodecKind::kQ8_0:
      layout.block_values = kGgmlBlockValues;
      layout.block_bytes = kQ8BlockBytes;
      break;
    case CodecKind::kQ4_0:
      layout.block_values = kGgmlBlockValues;
      layout.block_bytes = kQ4BlockBytes;
      break;
    default:
      layout.block_values = rotation_block;
      layout.block_bytes = TurboBlockBytes(rotation_block, TurboBits(kind));
      break;
  }
  layout.blocks = head_dim / layout.block_values;
  return layout;
}

// --- turbo index planes -----------------------------------------------------

// Byte `byte` (counted from the first plane) of the packed indices of one
// block of `block_values` indices, one index per element of `indices`.
TURBOKV_HD uint8_t TurboPlaneByte(const uint8_t* indices, int block_values, int bits,
                                  int byte) {
  uint32_t v = 0;
  if (bits == 4) {
    const int plane = block_values / 2;
    v = indices[byte] | (indices[byte + plane] << 4);
  } else {
    const int low_plane = block_values / 4;
    if (byte < low_plane) {
      for (int m = 0; m < 4; ++m) v |= (indices[byte + m * low_plane] & 3u) << (2 * m);
    } else {  // turbo3 high-bit plane
      const int plane = block_values / 8;
      const int j = byte - low_plane;
      for (int m = 0; m < 8; ++m) v |= ((indices[j + m * plane] >> 2) & 1u) << m;
    }
  }
  return static_cast<uint8_t>(v);
}

// log2 of a rotation block size (64 or 128): indexing uses shifts and masks,
// not divisions, which cost dozens of instructions on a GPU.
TURBOKV_HD int BlockShift(int block_values) { return block_values == 128 ? 7 : 6; }

// Index i of a block whose first plane starts at `planes` and turbo3's
// high plane at `high`.
TURBOKV_HD int TurboIndexOf(const uint8_t* planes, const uint8_t* high, int block_values, int bits, int i) {
  const int shift = BlockShift(block_values);
  if (bits == 4) {  // one plane of B/2 bytes
    const int plane_shift = shift - 1;
    return (planes[i & ((1 << plane_shift) - 1)] >> (4 * (i >> plane_shift))) & 15;
  }
  const int low_shift = shift - 2;  // B/4 bytes
  int index = (planes[i & ((1 << low_shift) - 1)] >> (2 * (i >> low_shift))) & 3;
  if (bits == 3) {
    const int high_shift = shift - 3;  // B/8 bytes
    index |= ((high[i & ((1 << high_shift) - 1)] >> (i >> high_shift)) & 1) << 2;
  }
  return index;
}

// Index i of a block whose planes start at `planes`, one after the other.
TURBOKV_HD int TurboIndex(const uint8_t* planes, int block_values, int bits, int i) {
  return TurboIndexOf(planes, planes + block_values / 4, block_values, bits, i);
}

// The quantizer's decision: the number of boundaries strictly below u, which
// is the index of the nearest centroid (ties go to the lower one).
TURBOKV_HD int QuantizeIndex(float u, const float* boundaries, int levels) {
  int index = 0;
  for (int k = 0; k + 1 < levels; ++k) index += boundaries[k] < u ? 1 : 0;
  return index;
}

}  // namespace turbokv
