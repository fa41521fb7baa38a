// The tensor-core decode kernel's arithmetic, written once for the GPU and
// for a host emulation of it (docs/ARCHITECTURE.md, "GPU kernel notes"): one warp attends one
// group of kTokenGroup tokens of one kv head at a time (a page's token group,
// kernels/page_layout.h), for up to 8 * NT query heads of its GQA group.
//
//   scores  S^T (16 tokens x 8 heads) = K (16 x 16 dims) . Q^T (16 dims x 8),
//           mma.m16n8k16 a 16-dim chunk of the head dimension, the codes'
//           unit values (a centroid, q8_0's int8, q4_0's q - 8, f16's value)
//           on the A side and the query (fp16 hi + lo) on the B side; each
//           key block's accumulator then times the token's block factor
//           (turbo s / B, q8_0 and q4_0 d);
//   softmax online over the groups, per head, in exp2;
//   values  O^T (16 dims x 8 heads) += V^T (16 dims x 16 tokens) . P'
//           (16 tokens x 8 heads), P' the weights times each token's value
//           block factor (fp16 hi + lo), moved from the scores' C layout to
//           the B layout by an 8x8 transpose (movmatrix).
//
// Which dimension a fragment slot holds is free (a dot product sums them in
// any order; an output row is written back to its dimension): KeyDim and
// ValueDim choose, per codec, the dimensions whose codes a lane finds in a
// few adjacent bytes of its tokens' index planes.
//
// The warp is a template parameter W, so that the same code runs as CUDA
// threads (a lane each, W::R<T> a register) and on the host, where
// MmaHostWarp runs the 32 lanes in turn (W::R<T> an array of 32) and the
// warp-wide steps (mma, the transpose, reductions across lanes) on arrays.
// Everything a lane computes is the same bits on both; the mma sums and
// exp2 are float arithmetic of the hardware's order, within float rounding.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/block_math.h"
#include "kernels/half.h"
#include "kernels/hd.h"
#include "kernels/layout.h"
#include "kernels/page_layout.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace turbokv::mma {

constexpr int kTile = kTokenGroup;  // tokens a warp attends at once: an mma's M
constexpr float kLog2e = 1.4426950408889634f;

// fp16 conversions of the finite values the kernel has (inside fp16's range):
// the GPU's instructions there (round to nearest even; the same bits as
// half.h's, which are branches on a GPU), half.h's on the host.
TURBOKV_HD uint16_t ToHalf(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(x));
#else
  return FloatToHalfBits(x);
#endif
}
TURBOKV_HD float FromHalf(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return HalfBitsToFloat(h);
#endif
}

// A fragment slot's place in its matrix (PTX ISA, "mma.m16n8k16" with .f16
// A and B, .f32 C). lane = 4 * group + quad.
//   A (16 x 16, row major): element e in 0..7 of a lane.
//   B (16 x 8, column major): element e in 0..3.
//   C (16 x 8): element e in 0..3.
TURBOKV_HD int ARow(int lane, int e) { return (lane >> 2) + 8 * ((e >> 1) & 1); }
TURBOKV_HD int ACol(int lane, int e) { return 2 * (lane & 3) + (e & 1) + 8 * (e >> 2); }
TURBOKV_HD int BRow(int lane, int e) { return 2 * (lane & 3) + (e & 1) + 8 * (e >> 1); }
TURBOKV_HD int BCol(int lane) { return lane >> 2; }
TURBOKV_HD int CRow(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
TURBOKV_HD int CCol(int lane, int e) { return 2 * (lane & 3) + (e & 1); }

// A codec fixed at compile time (its layout then a constant, its fragments
// built by the fast paths below), or kAnyCodec: the layout read at run time
// and every value decoded on its own.
constexpr CodecKind kAnyCodec = static_cast<CodecKind>(0);

// The dimension of column c (0..15) of chunk k of the key side (A's
// columns), in a lane's terms: quad q = (c % 8) / 2, pair p = c / 8 (its
// registers 0-1 or 2-3), half s = c % 2 (the register's low or high fp16).
//   turbo4 (blocks of B): the two nibbles of plane byte j are dimensions j
//     and j + B/2: a register holds one byte, byte q B/8 + 2 kb + p of the
//     block's chunk kb.
//   turbo3 and turbo2: plane byte j holds dimensions j + m B/4 (m = 0..3;
//     turbo3's high bits of byte j < B/8 are bits 2m of high byte j, of
//     j >= B/8 bits 2m + 1 of high byte j - B/8): a quad takes low bytes
//     (B/32) q + t and the same B/8 further, t < B/32, with the high bytes
//     (B/32) q + t; the chunk's pairs are 2 kb and 2 kb + 1 of the quad's
//     fields in the order (lower, fields 0 2), (lower, 1 3), (upper, 0 2),
//     (upper, 1 3), a register two fields m, m + 2 of one byte.
//   f16: a quad's D/4 dimensions in order, four a chunk.
//   q8_0, q4_0: in order.
TURBOKV_HD int KeyDim(const CodecLayout& layout, int k, int c) {
  const int q = (c & 7) >> 1, pair = c >> 3, half = c & 1;
  const int bits = TurboBits(layout.kind);
  if (layout.kind == CodecKind::kF16) return q * (layout.head_dim / 4) + 4 * k + 2 * pair + half;
  if (bits == 0) return 16 * k + c;
  const int B = layout.block_values;
  const int per_block = B / 16;  // chunks of a block
  const int block = k / per_block, kb = k - block * per_block;
  if (bits == 4) return block * B + q * (B / 8) + 2 * kb + pair + half * (B / 2);
  const int h = 2 * kb + pair, w = h / (B / 32), t = h % (B / 32);
  const int j = (w >> 1) * (B / 8) + (B / 32) * q + t;
  return block * B + j + ((w & 1) + 2 * half) * (B / 4);
}

// The dimension of row r (0..15) of chunk k of the value side (V^T's rows,
// the output's), in a lane's terms: group g = r % 8, high = r / 8 (rows g
// and g + 8 of a lane's registers 0 and 1, or 2 and 3).
//   turbo4: plane byte g B/16 + kb of chunk kb, its low nibble in row g and
//     its high in row g + 8.
//   turbo3 and turbo2: a group takes low bytes (B/64) g + t and the same
//     B/8 further, t < B/64, with high bytes (B/64) g + t; chunk kb is byte
//     t of the group's (lower, fields 0 2), (lower, 1 3), (upper, ...),
//     rows g and g + 8 its two fields.
//   f16: rows g and g + 8 dimensions 2 g and 2 g + 1 of the chunk's 16.
//   q8_0, q4_0: in order.
TURBOKV_HD int ValueDim(const CodecLayout& layout, int k, int r) {
  const int g = r & 7, high = r >> 3;
  const int bits = TurboBits(layout.kind);
  if (layout.kind == CodecKind::kF16) return 16 * k + 2 * g + high;
  if (bits == 0) return 16 * k + r;
  const int B = layout.block_values;
  const int per_block = B / 16;
  const int block = k / per_block, kb = k - block * per_block;
  if (bits == 4) return block * B + g * (B / 16) + kb + high * (B / 2);
  const int w = kb / (B / 64), t = kb % (B / 64);
  const int j = (w >> 1) * (B / 8) + (B / 64) * g + t;
  return block * B + j + ((w & 1) + 2 * high) * (B / 4);
}

// Blocks of a record whose factor scales a dot product or a value: the
// rotation blocks of a turbo codec, the 32-value blocks of q8_0 and q4_0,
// one for f16.
TURBOKV_HD int FactorBlocks(const CodecLayout& layout) {
  return layout.kind == CodecKind::kF16 ? 1 : layout.blocks;
}

// The fp16 unit values a codec's codes stand for: a turbo codebook's
// centroids as fp16 hi + lo (part 0: the nearest fp16; part 1: the rest in
// fp16 cut to its high byte, 3 bits of mantissa, so that its lookup is of
// one byte: c within 2^-15 of itself; keys take both parts, values part 0,
// within the kernel tests' bound); q8_0, q4_0 and f16 codes are exact (no
// part 1). For the fast paths the same as byte tables for __byte_perm:
// bytes[part][0][w] byte i is the low byte of code 4 w + i's unit,
// bytes[part][1][w] its high byte.
struct UnitTable {
  uint16_t unit[2][16];
  uint32_t bytes[2][2][4];
};

TURBOKV_HD void MakeUnitTable(const float* centroids, int levels, UnitTable* table) {
  for (int part = 0; part < 2; ++part)
    for (int half = 0; half < 2; ++half)
      for (int w = 0; w < 4; ++w) table->bytes[part][half][w] = 0;
  for (int i = 0; i < 16; ++i) {
    const float c = i < levels ? centroids[i] : 0.0f;
    table->unit[0][i] = FloatToHalfBits(c);
    table->unit[1][i] = FloatToHalfBits(c - HalfBitsToFloat(table->unit[0][i])) & 0xff00u;
    for (int part = 0; part < 2; ++part) {
      table->bytes[part][0][i / 4] |= static_cast<uint32_t>(table->unit[part][i] & 0xff) << (8 * (i % 4));
      table->bytes[part][1][i / 4] |= static_cast<uint32_t>(table->unit[part][i] >> 8) << (8 * (i % 4));
    }
  }
}

// __byte_perm: byte i of the result is byte (s >> 4 i) & 7 of {x, y} (x's
// bytes 0-3, y's 4-7), or that byte's sign replicated when bit 3 is set.
TURBOKV_HD uint32_t BytePerm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t bytes = x | (static_cast<uint64_t>(y) << 32);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 15u;
    uint32_t b = static_cast<uint32_t>(bytes >> (8 * (sel & 7))) & 0xffu;
    if (sel & 8) b = (b & 0x80u) ? 0xffu : 0u;
    out |= b << (8 * i);
  }
  return out;
#endif
}

TURBOKV_HD uint32_t PackHalves(uint16_t lo, uint16_t hi) { return lo | (static_cast<uint32_t>(hi) << 16); }

// The units (part `part`) of four codes, nibbles 0-3 of `codes`, as the low
// and high bytes of their fp16 (byte i of each for nibble i): 16-entry
// tables (two lookups and a choice by bit 3), or 8-entry ones (codes below
// 8).
// (Part 1's low bytes are zero: not looked up.)
TURBOKV_HD void LookUp16(uint32_t codes, const UnitTable& t, int part, uint32_t* lo, uint32_t* hi) {
  const uint32_t sel = codes & 0x7777u, pick = ((codes >> 1) & 0x4444u) | 0x3210u;
  const uint32_t* l = t.bytes[part][0];
  const uint32_t* h = t.bytes[part][1];
  *lo = part == 0 ? BytePerm(BytePerm(l[0], l[1], sel), BytePerm(l[2], l[3], sel), pick) : 0u;
  *hi = BytePerm(BytePerm(h[0], h[1], sel), BytePerm(h[2], h[3], sel), pick);
}
TURBOKV_HD void LookUp8(uint32_t codes, const UnitTable& t, int part, uint32_t* lo, uint32_t* hi) {
  *lo = part == 0 ? BytePerm(t.bytes[part][0][0], t.bytes[part][0][1], codes) : 0u;
  *hi = BytePerm(t.bytes[part][1][0], t.bytes[part][1][1], codes);
}

TURBOKV_HD uint32_t Load16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  return p[0] | (static_cast<uint32_t>(p[1]) << 8);
#endif
}
TURBOKV_HD uint32_t Load32(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  return Load16(p) | (Load16(p + 2) << 16);
#endif
}

// One side (keys or values) of one token group of one kv head, in the token
// groups order: kTile records split by field.
template <CodecKind K, int D>
struct Group {
  const uint8_t* bytes;
  CodecLayout runtime;  // the layout when K is kAnyCodec

  TURBOKV_HD CodecLayout layout() const {
    if constexpr (K == kAnyCodec) {
      return runtime;
    } else {
      constexpr CodecLayout kLayout = MakeCodecLayout(K, D);
      return kLayout;
    }
  }
  // Field `offset` (canonical offset in the record) of token t.
  TURBOKV_HD const uint8_t* Field(int t, int offset, int field_bytes) const {
    return bytes + kTile * offset + t * field_bytes;
  }
  // The code of dimension x of token t: a turbo index, q8_0's int8 (as
  // 0..255), q4_0's nibble, f16's bits.
  TURBOKV_HD uint32_t Code(int t, int x) const {
    const CodecLayout l = layout();
    switch (l.kind) {
      case CodecKind::kF16:
        return Load16(Field(t, 0, 2 * D) + 2 * x);
      case CodecKind::kQ8_0:
        return Field(t, (x >> 5) * kQ8BlockBytes + 2, 32)[x & 31];
      case CodecKind::kQ4_0: {
        const int j = x & 31;
        const uint8_t byte = Field(t, (x >> 5) * kQ4BlockBytes + 2, 16)[j & 15];
        return j < 16 ? byte & 15u : byte >> 4;
      }
      default: {
        const int B = l.block_values, bits = TurboBits(l.kind);
        const int b = x / B, i = x - b * B;
        const int base = b * l.block_bytes + kTurboScaleBytes;
        if (bits == 4) return (Field(t, base, B / 2)[i % (B / 2)] >> (4 * (i / (B / 2)))) & 15u;
        uint32_t index = (Field(t, base, B / 4)[i % (B / 4)] >> (2 * (i / (B / 4)))) & 3u;
        if (bits == 3) index |= ((Field(t, base + B / 4, B / 8)[i % (B / 8)] >> (i / (B / 8))) & 1u) << 2;
        return index;
      }
    }
  }
  // Whether its units have a part 1 (the turbo codecs').
  TURBOKV_HD bool HasLo() const { return TurboBits(layout().kind) != 0; }
  // Part `part` of the fp16 unit value of a code (UnitTable).
  TURBOKV_HD uint16_t Unit(uint32_t code, const UnitTable& table, int part) const {
    switch (layout().kind) {
      case CodecKind::kF16:
        return part == 0 ? static_cast<uint16_t>(code) : 0;
      case CodecKind::kQ8_0:
        return part == 0 ? ToHalf(static_cast<float>(static_cast<int8_t>(code))) : 0;
      case CodecKind::kQ4_0:
        return part == 0 ? ToHalf(static_cast<float>(static_cast<int>(code) - 8)) : 0;
      default:
        return table.unit[part][code];
    }
  }
  // The factor of factor block `b` (FactorBlocks) of token t.
  TURBOKV_HD float Factor(int t, int b) const {
    const CodecLayout l = layout();
    switch (l.kind) {
      case CodecKind::kF16:
        return 1.0f;
      case CodecKind::kQ8_0:
        return FromHalf(Load16(Field(t, b * kQ8BlockBytes, 2)));
      case CodecKind::kQ4_0:
        return FromHalf(Load16(Field(t, b * kQ4BlockBytes, 2)));
      default:
        return FromHalf(Load16(Field(t, b * l.block_bytes, 2))) * (1.0f / static_cast<float>(l.block_values));
    }
  }
};

// A lane's A fragments of chunk k of the key side, value by value: tokens
// ARow, dimensions KeyDim(k, ACol); four registers of two fp16 for each
// part of the units (a[4] part 0, lo[4] part 1).
template <CodecKind K, int D>
TURBOKV_HD void KeyFragmentOneByOne(const Group<K, D>& keys, const UnitTable& table, int lane, int k, uint32_t* a,
                                    uint32_t* lo) {
  for (int r = 0; r < 4; ++r) {
    uint16_t h[2][2];
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * r + s;
      const uint32_t code = keys.Code(ARow(lane, e), KeyDim(keys.layout(), k, ACol(lane, e)));
      for (int part = 0; part < 2; ++part) h[part][s] = keys.Unit(code, table, part);
    }
    a[r] = PackHalves(h[0][0], h[0][1]);
    lo[r] = PackHalves(h[1][0], h[1][1]);
  }
}

// A lane's A fragment of chunk k of the value side (V^T), value by value:
// dimensions ValueDim(k, ARow), tokens ACol.
template <CodecKind K, int D>
TURBOKV_HD void ValueFragmentOneByOne(const Group<K, D>& values, const UnitTable& table, int lane, int k,
                                      uint32_t* a) {
  for (int r = 0; r < 4; ++r) {
    uint16_t h[2];
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * r + s;
      h[s] = values.Unit(values.Code(ACol(lane, e), ValueDim(values.layout(), k, ARow(lane, e))), table, 0);
    }
    a[r] = PackHalves(h[0], h[1]);
  }
}

// turbo3's and turbo2's four index nibbles of a word of two low-plane bytes
// (and turbo3's two high-plane bytes): fields m and m + 2 of each byte,
// m = odd; `upper`: the low bytes B/8 on, whose high bits are the odd bits.
TURBOKV_HD uint32_t ThreeBitNibbles(uint32_t low, uint32_t high, bool odd, bool upper, bool has_high) {
  uint32_t n = (odd ? low >> 2 : low) & 0x3333u;
  if (has_high) {
    const int up = (odd ? 0 : 2) - (upper ? 1 : 0);  // bit 2m (2m + 1) of a high byte to bit 2 of its nibble
    n |= (up >= 0 ? high << up : high >> -up) & 0x4444u;
  }
  return n;
}

// Where chunk k (16 dimensions) of a turbo side lies for a lane: the
// lane's quad and group, the chunk's index within its rotation block, and
// the byte (within a record) of that block's first plane.
template <CodecKind K, int D>
struct TurboChunk {
  static constexpr CodecLayout kLayout = MakeCodecLayout(K, D);
  static constexpr int B = kLayout.block_values, kBits = TurboBits(K);
  int q, g, kb, plane;
  TURBOKV_HD TurboChunk(int lane, int k)
      : q(lane & 3), g(lane >> 2), kb(k % (B / 16)), plane(k / (B / 16) * kLayout.block_bytes + kTurboScaleBytes) {}
};

// A lane's A fragments of chunk k of the key side, as KeyFragmentOneByOne
// gives them, from whole plane words for the fast codecs (lo: nothing
// written when the codec has no part 1).
template <CodecKind K, int D>
TURBOKV_HD void KeyFragment(const Group<K, D>& keys, const UnitTable& table, int lane, int k, uint32_t* a,
                            uint32_t* lo) {
  if constexpr (TurboBits(K) != 0) {
    constexpr int B = TurboChunk<K, D>::B, bits = TurboBits(K);
    const TurboChunk<K, D> c(lane, k);
    const int q = c.q, g = c.g, kb = c.kb, plane = c.plane;
    TURBOKV_UNROLL
    for (int row = 0; row < 2; ++row) {
      const int t = g + 8 * row;
      uint32_t codes;
      if constexpr (bits == 4) {
        codes = Load16(keys.Field(t, plane, B / 2) + q * (B / 8) + 2 * kb);
      } else {
        const int w = 2 * kb / (B / 32), byte = (2 * kb) % (B / 32) + (B / 32) * q;
        const uint32_t low = Load16(keys.Field(t, plane, B / 4) + (w >> 1) * (B / 8) + byte);
        const uint32_t high = bits == 3 ? Load16(keys.Field(t, plane + B / 4, B / 8) + byte) : 0u;
        codes = ThreeBitNibbles(low, high, w & 1, w >> 1, bits == 3);
      }
      TURBOKV_UNROLL
      for (int part = 0; part < 2; ++part) {
        uint32_t l, h;
        if constexpr (bits == 4) {
          LookUp16(codes, table, part, &l, &h);
        } else {
          LookUp8(codes, table, part, &l, &h);
        }
        uint32_t* out = part == 0 ? a : lo;
        out[row] = BytePerm(l, h, 0x5140);      // the first byte's (or fields') two values
        out[2 + row] = BytePerm(l, h, 0x7362);  // the second's
      }
    }
  } else if constexpr (K == CodecKind::kF16) {
    const int q = lane & 3, g = lane >> 2;
    TURBOKV_UNROLL
    for (int row = 0; row < 2; ++row) {
      const uint8_t* x = keys.Field(g + 8 * row, 0, 2 * D) + 2 * (q * (D / 4) + 4 * k);
      a[row] = Load32(x);
      a[2 + row] = Load32(x + 4);
    }
  } else {
    uint32_t unused[4];
    KeyFragmentOneByOne(keys, table, lane, k, a, keys.HasLo() ? lo : unused);
  }
}

// A lane's A fragment of chunk k of the value side, as
// ValueFragmentOneByOne gives it: for the fast codecs, each register's two
// tokens' codes of one dimension put side by side, then looked up together.
template <CodecKind K, int D>
TURBOKV_HD void ValueFragment(const Group<K, D>& values, const UnitTable& table, int lane, int k, uint32_t* a) {
  if constexpr (TurboBits(K) != 0) {
    constexpr int B = TurboChunk<K, D>::B, bits = TurboBits(K);
    const TurboChunk<K, D> c(lane, k);
    const int q = c.q, g = c.g, kb = c.kb, plane = c.plane;
    TURBOKV_UNROLL
    for (int pair = 0; pair < 2; ++pair) {
      const int t = 2 * q + 8 * pair;  // tokens t and t + 1
      uint32_t codes[2];
      TURBOKV_UNROLL
      for (int i = 0; i < 2; ++i) {
        if constexpr (bits == 4) {
          codes[i] = values.Field(t + i, plane, B / 2)[g * (B / 16) + kb];
        } else {
          const int w = kb / (B / 64), byte = kb % (B / 64) + (B / 64) * g;
          const uint32_t low = values.Field(t + i, plane, B / 4)[(w >> 1) * (B / 8) + byte];
          const uint32_t high = bits == 3 ? values.Field(t + i, plane + B / 4, B / 8)[byte] : 0u;
          codes[i] = ThreeBitNibbles(low, high, w & 1, w >> 1, bits == 3);
        }
      }
      // Nibbles: token t's row g, its row g + 8, token t + 1's row g, row g + 8.
      const uint32_t both = codes[0] | (codes[1] << 8);
      uint32_t lo, hi;
      if constexpr (bits == 4) {
        LookUp16(both, table, 0, &lo, &hi);
      } else {
        LookUp8(both, table, 0, &lo, &hi);
      }
      a[2 * pair] = BytePerm(lo, hi, 0x6240);      // row g: tokens t, t + 1
      a[2 * pair + 1] = BytePerm(lo, hi, 0x7351);  // row g + 8
    }
  } else if constexpr (K == CodecKind::kF16) {
    const int q = lane & 3, g = lane >> 2;
    TURBOKV_UNROLL
    for (int pair = 0; pair < 2; ++pair) {
      const int t = 2 * q + 8 * pair;
      const uint32_t x = Load32(values.Field(t, 0, 2 * D) + 2 * (16 * k + 2 * g));
      const uint32_t y = Load32(values.Field(t + 1, 0, 2 * D) + 2 * (16 * k + 2 * g));
      a[2 * pair] = BytePerm(x, y, 0x5410);
      a[2 * pair + 1] = BytePerm(x, y, 0x7632);
    }
  } else {
    ValueFragmentOneByOne(values, table, lane, k, a);
  }
}

// x as fp16 hi + lo.
TURBOKV_HD void SplitHalf(float x, uint16_t* hi, uint16_t* lo) {
  *hi = ToHalf(x);
  *lo = ToHalf(x - FromHalf(*hi));
}

// A lane's B fragments (hi, lo) of chunk k of n-tile j of the queries:
// rows [8 j, 8 j + 8) of `q` ([rows][head_dim] floats, rows beyond `rows`
// zero), the key side's dimensions KeyDim(k, BRow).
TURBOKV_HD void QueryFragment(const CodecLayout& key_layout, const float* q, int rows, int head_dim, int lane, int k,
                              int j, uint32_t* hi, uint32_t* lo) {
  const int row = 8 * j + BCol(lane);
  for (int r = 0; r < 2; ++r) {
    uint16_t h[2], l[2];
    for (int s = 0; s < 2; ++s) {
      const float x = row < rows ? q[row * head_dim + KeyDim(key_layout, k, BRow(lane, 2 * r + s))] : 0.0f;
      SplitHalf(x, &h[s], &l[s]);
    }
    hi[r] = PackHalves(h[0], h[1]);
    lo[r] = PackHalves(l[0], l[1]);
  }
}

// What a unit's warps attend with: the query side, built once a unit.
template <int D, int NT>
struct QuerySide {
  // frag[k][j][lane]: hi b0b1, hi b2b3, lo b0b1, lo b2b3 (one 16-byte load).
  alignas(16) uint32_t frag[D / 16][NT][32][4];
  float offset[8 * NT];  // added to each row's logits (the key transform's; 0 without)
  int rows;              // rows of the unit (query heads), <= 8 * NT
};

// One token group to attend and where its scores go.
template <CodecKind K, CodecKind V, int D>
struct TileArgs {
  Group<K, D> keys;
  Group<V, D> values;
  const UnitTable* key_table;
  const UnitTable* value_table;
  int64_t first_token;  // the group's first token
  int64_t visible_first, visible_last;  // what the unit's query sees
  float scale;          // softmax scale (to the logits), times log2(e) below
  float softcap;        // > 0: logits become softcap * tanh(logit / softcap)
  // With top-k: logits[row * row_stride + token] gets each visible logit.
  float* logits;
  int64_t row_stride;
};

// A warp's running state, per lane: m and l per head of its C columns
// (rows 2 quad + {0, 1} of each n-tile), in log2 units, and O^T's C
// fragments (dims ValueDim rows, heads columns).
template <int D, int NT>
struct WarpRows {
  float m[NT][2];
  float l[NT][2];  // this lane's tokens only: summed over the lane groups at the end
  float acc[NT][D / 16][4];
};

template <int D, int NT>
TURBOKV_HD void ResetRows(WarpRows<D, NT>& s) {
  TURBOKV_UNROLL
  for (int j = 0; j < NT; ++j) {
    TURBOKV_UNROLL
    for (int h = 0; h < 2; ++h) {
      s.m[j][h] = -INFINITY;
      s.l[j][h] = 0.0f;
    }
    TURBOKV_UNROLL
    for (int k = 0; k < D / 16; ++k) {
      TURBOKV_UNROLL
      for (int e = 0; e < 4; ++e) s.acc[j][k][e] = 0.0f;
    }
  }
}

// The warp W (see the top of this file) gives:
//   W::R<T>            a value per lane: r[lane] (a register of the thread
//                      on the GPU; an array of 32 on the host)
//   w.Lanes(f)         f(lane) for the lanes of the warp
//   w.Mma(c, a, b)     C += A . B of mma.m16n8k16 (f32 += f16 . f16): c(lane)
//                      a lane's 4 floats of C, a(lane) its 4 words of A,
//                      b(lane) its 2 words of B
//   w.Transpose(x, n)  each word x(lane)[i], i < n, a lane's two fp16 of an
//                      8 x 8 matrix (row lane / 4, columns 2 (lane % 4) and
//                      the next), becomes its two of the transpose (movmatrix)
//   w.MaxOverGroups(x, n), w.SumOverGroups(x, n)
//                      x(lane)[i] becomes the max (sum) over the 8 lanes of
//                      its quad (lane % 4): a column of a C fragment
//   w.Exp2(x)          2^x (the GPU's ex2.approx)

// Attends one token group. (Register arrays are indexed by constants only,
// in unrolled loops: a key or value block that changes within the head
// dimension is a branch, not an index.)
template <class W, int D, int NT, CodecKind K, CodecKind V>
TURBOKV_HD void AttendGroup(W& w, const QuerySide<D, NT>& qs, const TileArgs<K, V, D>& a,
                            typename W::template R<WarpRows<D, NT>>& state) {
  constexpr int kChunks = D / 16;
  const int key_chunks_per_block = kChunks / FactorBlocks(a.keys.layout());
  const int value_chunks_per_block = kChunks / FactorBlocks(a.values.layout());

  // Scores: a key block's chunks summed (the query's hi and lo against the
  // codes' units, its hi against the units' part 1), then times the
  // token's factor of that block into the dot products.
  typename W::template R<float[NT][4]> dot, cur;
  w.Lanes([&](int lane) {
    TURBOKV_UNROLL
    for (int j = 0; j < NT; ++j) {
      TURBOKV_UNROLL
      for (int e = 0; e < 4; ++e) dot[lane][j][e] = cur[lane][j][e] = 0.0f;
    }
  });
  const bool key_lo = a.keys.HasLo();
  typename W::template R<uint32_t[4]> fa, fa_lo;
  TURBOKV_UNROLL
  for (int k = 0; k < kChunks; ++k) {
    w.Lanes([&](int lane) { KeyFragment(a.keys, *a.key_table, lane, k, fa[lane], fa_lo[lane]); });
    TURBOKV_UNROLL
    for (int j = 0; j < NT; ++j) {
      auto c = [&](int lane) { return cur[lane][j]; };
      auto q_hi = [&](int lane) { return &qs.frag[k][j][lane][0]; };
      w.Mma(c, [&](int lane) { return &fa[lane][0]; }, q_hi);
      w.Mma(c, [&](int lane) { return &fa[lane][0]; }, [&](int lane) { return &qs.frag[k][j][lane][2]; });
      if (key_lo) w.Mma(c, [&](int lane) { return &fa_lo[lane][0]; }, q_hi);
    }
    if ((k + 1) % key_chunks_per_block == 0) {
      const int b = k / key_chunks_per_block;
      w.Lanes([&](int lane) {
        TURBOKV_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float f = a.keys.Factor(CRow(lane, e), b);
          TURBOKV_UNROLL
          for (int j = 0; j < NT; ++j) {
            dot[lane][j][e] = fmaf(f, cur[lane][j][e], dot[lane][j][e]);
            cur[lane][j][e] = 0.0f;
          }
        }
      });
    }
  }

  // Logits (log2 units), masked, and the group's max per head: the group's
  // tokens [first, last] are visible (of 0..15).
  const int first = static_cast<int>(a.visible_first > a.first_token ? a.visible_first - a.first_token : 0);
  const int last = static_cast<int>(a.visible_last - a.first_token < kTile - 1 ? a.visible_last - a.first_token : kTile - 1);
  const bool store_logits = a.logits != nullptr;
  typename W::template R<float[NT][4]> x;
  typename W::template R<float[NT][2]> top;
  w.Lanes([&](int lane) {
    TURBOKV_UNROLL
    for (int j = 0; j < NT; ++j) {
      top[lane][j][0] = top[lane][j][1] = -INFINITY;
      TURBOKV_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int row = 8 * j + CCol(lane, e), t = CRow(lane, e);
        float logit = fmaf(dot[lane][j][e], a.scale, qs.offset[row]);
        if (a.softcap > 0.0f) logit = a.softcap * tanhf(logit / a.softcap);
        const bool visible = row < qs.rows && t >= first && t <= last;
        if (store_logits && visible) a.logits[row * a.row_stride + a.first_token + t] = logit;
        x[lane][j][e] = visible ? logit * kLog2e : -INFINITY;
        top[lane][j][e & 1] = fmaxf(top[lane][j][e & 1], x[lane][j][e]);
      }
    }
  });
  w.MaxOverGroups([&](int lane) { return &top[lane][0][0]; }, 2 * NT);

  // Online softmax: the new maxima, the weights, the rescale of the sums.
  typename W::template R<float[NT][4]> p;
  w.Lanes([&](int lane) {
    WarpRows<D, NT>& st = state[lane];
    TURBOKV_UNROLL
    for (int j = 0; j < NT; ++j) {
      float correction[2];
      TURBOKV_UNROLL
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(st.m[j][h], top[lane][j][h]);
        correction[h] = m_new == -INFINITY ? 1.0f : w.Exp2(st.m[j][h] - m_new);
        st.m[j][h] = m_new;
        st.l[j][h] *= correction[h];
      }
      TURBOKV_UNROLL
      for (int e = 0; e < 4; ++e) {
        const float m = st.m[j][e & 1];
        p[lane][j][e] = m == -INFINITY ? 0.0f : w.Exp2(x[lane][j][e] - m);
        st.l[j][e & 1] += p[lane][j][e];
      }
      if (correction[0] != 1.0f || correction[1] != 1.0f) {  // the max rose: seldom, after the first groups
        TURBOKV_UNROLL
        for (int k = 0; k < kChunks; ++k) {
          TURBOKV_UNROLL
          for (int e = 0; e < 4; ++e) st.acc[j][k][e] *= correction[e & 1];
        }
      }
    }
  });

  // Values: each value block's P' = P times the tokens' factors of that
  // block, as fp16 hi + lo, moved to B fragments, against the codes' units.
  typename W::template R<uint32_t[NT][4]> pb;  // hi: tokens 0-7, 8-15; lo: the same
  typename W::template R<uint32_t[4]> fv;
  TURBOKV_UNROLL
  for (int k = 0; k < kChunks; ++k) {
    if (k % value_chunks_per_block == 0) {
      const int vb = k / value_chunks_per_block;
      w.Lanes([&](int lane) {
        TURBOKV_UNROLL
        for (int j = 0; j < NT; ++j) {
          uint16_t hi[4], lo[4];
          TURBOKV_UNROLL
          for (int e = 0; e < 4; ++e) {
            SplitHalf(p[lane][j][e] * a.values.Factor(CRow(lane, e), vb), &hi[e], &lo[e]);
          }
          pb[lane][j][0] = PackHalves(hi[0], hi[1]);
          pb[lane][j][1] = PackHalves(hi[2], hi[3]);
          pb[lane][j][2] = PackHalves(lo[0], lo[1]);
          pb[lane][j][3] = PackHalves(lo[2], lo[3]);
        }
      });
      w.Transpose([&](int lane) { return &pb[lane][0][0]; }, 4 * NT);
    }
    w.Lanes([&](int lane) { ValueFragment(a.values, *a.value_table, lane, k, fv[lane]); });
    TURBOKV_UNROLL
    for (int j = 0; j < NT; ++j) {
      auto c = [&](int lane) { return state[lane].acc[j][k]; };
      auto v = [&](int lane) { return &fv[lane][0]; };
      w.Mma(c, v, [&](int lane) { return &pb[lane][j][0]; });
      w.Mma(c, v, [&](int lane) { return &pb[lane][j][2]; });
    }
  }
}

// Once a warp's groups are attended: each lane's l summed over the 8 lanes
// of its quad, so that every lane holds its columns' whole sums.
template <class W, int D, int NT>
TURBOKV_HD void FinishRows(W& w, typename W::template R<WarpRows<D, NT>>& state) {
  w.SumOverGroups([&](int lane) { return &state[lane].l[0][0]; }, 2 * NT);
}

// What a lane holds of a warp's rows, written where they go: m (natural log
// units), l and the weighted sums of the values in their dimensions' order
// (out[row * (D + 2)]: m, l, then D sums), for rows < `rows`. Every slot is
// written by exactly one lane.
template <int D, int NT>
TURBOKV_HD void StoreRows(const WarpRows<D, NT>& st, const CodecLayout& value_layout, int lane, int rows, float* out) {
  const int g = lane >> 2;
  TURBOKV_UNROLL
  for (int j = 0; j < NT; ++j) {
    TURBOKV_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int row = 8 * j + 2 * (lane & 3) + h;
      if (row >= rows) continue;
      float* o = out + row * (D + 2);
      if (g == 0) {
        o[0] = st.m[j][h] == -INFINITY ? -INFINITY : st.m[j][h] / kLog2e;
        o[1] = st.l[j][h];
      }
      TURBOKV_UNROLL
      for (int k = 0; k < D / 16; ++k) {
        TURBOKV_UNROLL
        for (int half = 0; half < 2; ++half) o[2 + ValueDim(value_layout, k, g + 8 * half)] = st.acc[j][k][2 * half + h];
      }
    }
  }
}

// Slot i (0: m, 1: l, 2 + x: the sum of dimension x) of a row's state over
// several warps' stored rows (StoreRows' layout, `stride` floats apart), one
// slot a call so that threads share the work.
TURBOKV_HD float CombineRowSlot(const float* rows, int warps, size_t stride, int i) {
  float m = -INFINITY;
  TURBOKV_UNROLL
  for (int w = 0; w < warps; ++w) m = fmaxf(m, rows[w * stride]);
  if (i == 0) return m;
  float sum = 0.0f;
  TURBOKV_UNROLL
  for (int w = 0; w < warps; ++w) {
    const float mw = rows[w * stride];
    if (mw != -INFINITY) sum = fmaf(rows[w * stride + i], expf(mw - m), sum);
  }
  return sum;
}

}  // namespace turbokv::mma
