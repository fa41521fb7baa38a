// The tensor-core decode kernel's arithmetic, written once for the GPU and
// for a host emulation of it (DESIGN.md section 7): one warp attends one
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

namespace turbokv::mma {

constexpr int kTile = kTokenGroup;  // tokens a warp attends at once: an mma's M
constexpr float kLog2e = 1.4426950408889634f;

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

// The dimension of column c (0..15) of chunk k of the key side (A's columns).
// turbo4, blocks of B: the two nibbles of plane byte j are dimensions j and
// j + B/2; lane quad q takes bytes [q B/8, (q + 1) B/8), a chunk two of them.
// turbo2 and turbo3: plane byte j holds j + m B/4 (m = 0..3, the low plane
// of turbo3); quad q takes bytes [q B/16, (q + 1) B/16), one a chunk, its
// four fields in the chunk's four columns of the quad. f16, q8_0, q4_0: in
// order.
TURBOKV_HD int KeyDim(const CodecLayout& layout, int k, int c) {
  const int bits = TurboBits(layout.kind);
  if (bits == 0) return 16 * k + c;
  const int B = layout.block_values;
  const int per_block = B / 16;  // chunks of a block
  const int block = k / per_block, kb = k - block * per_block;
  const int q = (c & 7) >> 1, pair = c >> 3, half = c & 1;
  if (bits == 4) {
    const int j = q * (B / 8) + 2 * kb + pair;
    return block * B + j + half * (B / 2);
  }
  const int j = q * (B / 16) + kb;
  return block * B + j + (2 * pair + half) * (B / 4);
}

// The dimension of row r (0..15) of chunk k of the value side (V^T's rows,
// the output's). turbo4: lane group g (0..7) takes plane bytes
// [g B/16, (g + 1) B/16), one a chunk: its low nibble in row g, its high in
// row g + 8. turbo2 and turbo3: group g takes bytes [g B/32, (g + 1) B/32),
// each a chunk for two fields. f16, q8_0, q4_0: in order.
TURBOKV_HD int ValueDim(const CodecLayout& layout, int k, int r) {
  const int bits = TurboBits(layout.kind);
  if (bits == 0) return 16 * k + r;
  const int B = layout.block_values;
  const int per_block = B / 16;
  const int block = k / per_block, kb = k - block * per_block;
  const int g = r & 7, high = r >> 3;
  if (bits == 4) return block * B + g * (B / 16) + kb + high * (B / 2);
  const int per_group = B / 32;
  const int j = g * per_group + kb % per_group;
  return block * B + j + (2 * (kb / per_group) + high) * (B / 4);
}

// Blocks of a record whose factor scales a dot product or a value: the
// rotation blocks of a turbo codec, the 32-value blocks of q8_0 and q4_0,
// one for f16.
TURBOKV_HD int FactorBlocks(const CodecLayout& layout) {
  return layout.kind == CodecKind::kF16 ? 1 : layout.blocks;
}

// The fp16 unit values a codec's codes stand for, with the hi + lo split of
// a turbo codebook's centroids (hi the nearest fp16, lo the nearest fp16 of
// the rest): q8_0, q4_0 and f16 codes are exact in fp16 (lo zero).
struct UnitTable {
  uint16_t hi[16];
  uint16_t lo[16];
};

TURBOKV_HD void MakeUnitTable(const float* centroids, int levels, UnitTable* table) {
  for (int i = 0; i < 16; ++i) {
    const float c = i < levels ? centroids[i] : 0.0f;
    table->hi[i] = FloatToHalfBits(c);
    table->lo[i] = FloatToHalfBits(c - HalfBitsToFloat(table->hi[i]));
  }
}

// One side (keys or values) of one token group of one kv head, in the token
// groups order: kTile records of `layout` split by field.
struct GroupView {
  const uint8_t* bytes;
  CodecLayout layout;

  // Field `offset` (canonical offset in the record) of token t.
  TURBOKV_HD const uint8_t* Field(int t, int offset, int field_bytes) const {
    return bytes + kTile * offset + t * field_bytes;
  }
  // The code of dimension x of token t: a turbo index, q8_0's int8 (as
  // 0..255), q4_0's nibble, f16's bits.
  TURBOKV_HD uint32_t Code(int t, int x) const {
    switch (layout.kind) {
      case CodecKind::kF16:
        return LoadHalfBits(Field(t, 0, static_cast<int>(layout.code_size())) + 2 * x);
      case CodecKind::kQ8_0: {
        const int b = x >> 5;
        return Field(t, b * kQ8BlockBytes + 2, 32)[x & 31];
      }
      case CodecKind::kQ4_0: {
        const int b = x >> 5, j = x & 31;
        const uint8_t byte = Field(t, b * kQ4BlockBytes + 2, 16)[j & 15];
        return j < 16 ? byte & 15u : byte >> 4;
      }
      default: {
        const int B = layout.block_values, bits = TurboBits(layout.kind);
        const int b = x / B, i = x - b * B;
        const int base = b * layout.block_bytes + kTurboScaleBytes;
        if (bits == 4) return (Field(t, base, B / 2)[i % (B / 2)] >> (4 * (i / (B / 2)))) & 15u;
        uint32_t index = (Field(t, base, B / 4)[i % (B / 4)] >> (2 * (i / (B / 4)))) & 3u;
        if (bits == 3) index |= ((Field(t, base + B / 4, B / 8)[i % (B / 8)] >> (i / (B / 8))) & 1u) << 2;
        return index;
      }
    }
  }
  // The fp16 unit value of a code (`lo`: the centroid's rest; 0 for codes
  // exact in fp16).
  TURBOKV_HD uint16_t Unit(uint32_t code, const UnitTable& table, bool lo) const {
    switch (layout.kind) {
      case CodecKind::kF16:
        return lo ? 0 : static_cast<uint16_t>(code);
      case CodecKind::kQ8_0:
        return lo ? 0 : FloatToHalfBits(static_cast<float>(static_cast<int8_t>(code)));
      case CodecKind::kQ4_0:
        return lo ? 0 : FloatToHalfBits(static_cast<float>(static_cast<int>(code) - 8));
      default:
        return lo ? table.lo[code] : table.hi[code];
    }
  }
  // The factor of factor block `b` (FactorBlocks) of token t.
  TURBOKV_HD float Factor(int t, int b) const {
    switch (layout.kind) {
      case CodecKind::kF16:
        return 1.0f;
      case CodecKind::kQ8_0:
        return HalfBitsToFloat(LoadHalfBits(Field(t, b * kQ8BlockBytes, 2)));
      case CodecKind::kQ4_0:
        return HalfBitsToFloat(LoadHalfBits(Field(t, b * kQ4BlockBytes, 2)));
      default:
        return HalfBitsToFloat(LoadHalfBits(Field(t, b * layout.block_bytes, 2))) /
               static_cast<float>(layout.block_values);
    }
  }
  // Whether codes of this codec need the lo half of their unit values.
  TURBOKV_HD bool HasLo() const { return TurboBits(layout.kind) != 0; }
};

TURBOKV_HD uint32_t PackHalves(uint16_t lo, uint16_t hi) { return lo | (static_cast<uint32_t>(hi) << 16); }

// A lane's A fragment of chunk k of the key side: tokens ARow, dimensions
// KeyDim(k, ACol); four registers of two fp16.
TURBOKV_HD void KeyFragment(const GroupView& keys, const UnitTable& table, bool lo, int lane, int k, uint32_t* a) {
  for (int r = 0; r < 4; ++r) {
    uint16_t h[2];
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * r + s;
      h[s] = keys.Unit(keys.Code(ARow(lane, e), KeyDim(keys.layout, k, ACol(lane, e))), table, lo);
    }
    a[r] = PackHalves(h[0], h[1]);
  }
}

// A lane's A fragment of chunk k of the value side (V^T): dimensions
// ValueDim(k, ARow), tokens ACol.
TURBOKV_HD void ValueFragment(const GroupView& values, const UnitTable& table, int lane, int k, uint32_t* a) {
  for (int r = 0; r < 4; ++r) {
    uint16_t h[2];
    for (int s = 0; s < 2; ++s) {
      const int e = 2 * r + s;
      h[s] = values.Unit(values.Code(ACol(lane, e), ValueDim(values.layout, k, ARow(lane, e))), table, false);
    }
    a[r] = PackHalves(h[0], h[1]);
  }
}

// x as fp16 hi + lo.
TURBOKV_HD void SplitHalf(float x, uint16_t* hi, uint16_t* lo) {
  *hi = FloatToHalfBits(x);
  *lo = FloatToHalfBits(x - HalfBitsToFloat(*hi));
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
  // qf[k][j][lane]: hi b0b1, hi b2b3, lo b0b1, lo b2b3.
  uint32_t frag[D / 16][NT][32][4];
  float offset[8 * NT];  // added to each row's logits (the key transform's; 0 without)
  int rows;              // rows of the unit (query heads), <= 8 * NT
};

// One token group to attend and where its scores go.
struct TileArgs {
  GroupView keys;
  GroupView values;
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
  for (int j = 0; j < NT; ++j) {
    for (int h = 0; h < 2; ++h) {
      s.m[j][h] = -INFINITY;
      s.l[j][h] = 0.0f;
    }
    for (int k = 0; k < D / 16; ++k) {
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

// Attends one token group.
template <class W, int D, int NT>
TURBOKV_HD void AttendGroup(W& w, const QuerySide<D, NT>& qs, const TileArgs& a,
                            typename W::template R<WarpRows<D, NT>>& state) {
  constexpr int kChunks = D / 16;
  constexpr int kMaxBlocks = D / 32;  // q8_0 and q4_0 have the most
  const int key_blocks = FactorBlocks(a.keys.layout), value_blocks = FactorBlocks(a.values.layout);
  const int key_chunks_per_block = kChunks / key_blocks;
  const int value_chunks_per_block = kChunks / value_blocks;
  const bool key_lo = a.keys.HasLo();

  // Scores: one accumulator per n-tile and key factor block; the query's
  // hi and lo against the codes' units, and their hi against the units' lo.
  typename W::template R<float[NT][kMaxBlocks][4]> s;
  w.Lanes([&](int lane) {
    for (int j = 0; j < NT; ++j)
      for (int b = 0; b < kMaxBlocks; ++b)
        for (int e = 0; e < 4; ++e) s[lane][j][b][e] = 0.0f;
  });
  typename W::template R<uint32_t[4]> fa, fa_lo;
  for (int k = 0; k < kChunks; ++k) {
    w.Lanes([&](int lane) {
      KeyFragment(a.keys, *a.key_table, false, lane, k, fa[lane]);
      if (key_lo) KeyFragment(a.keys, *a.key_table, true, lane, k, fa_lo[lane]);
    });
    const int b = k / key_chunks_per_block;
    for (int j = 0; j < NT; ++j) {
      auto c = [&](int lane) { return s[lane][j][b]; };
      auto q_hi = [&](int lane) { return &qs.frag[k][j][lane][0]; };
      w.Mma(c, [&](int lane) { return &fa[lane][0]; }, q_hi);
      w.Mma(c, [&](int lane) { return &fa[lane][0]; }, [&](int lane) { return &qs.frag[k][j][lane][2]; });
      if (key_lo) w.Mma(c, [&](int lane) { return &fa_lo[lane][0]; }, q_hi);
    }
  }

  // Logits (log2 units), masked, and the group's max per head.
  typename W::template R<float[NT][4]> x;
  typename W::template R<float[NT][2]> top;
  w.Lanes([&](int lane) {
    for (int j = 0; j < NT; ++j) {
      top[lane][j][0] = top[lane][j][1] = -INFINITY;
      for (int e = 0; e < 4; ++e) {
        const int t = CRow(lane, e), row = 8 * j + CCol(lane, e);
        const int64_t token = a.first_token + t;
        float dot = 0.0f;
        for (int b = 0; b < key_blocks; ++b) dot = fmaf(a.keys.Factor(t, b), s[lane][j][b][e], dot);
        float logit = fmaf(dot, a.scale, qs.offset[row]);
        if (a.softcap > 0.0f) logit = a.softcap * tanhf(logit / a.softcap);
        const bool visible = row < qs.rows && token >= a.visible_first && token <= a.visible_last;
        if (visible && a.logits != nullptr) a.logits[row * a.row_stride + token] = logit;
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
    for (int j = 0; j < NT; ++j) {
      float correction[2];
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(st.m[j][h], top[lane][j][h]);
        correction[h] = m_new == -INFINITY ? 1.0f : w.Exp2(st.m[j][h] - m_new);
        st.m[j][h] = m_new;
        st.l[j][h] *= correction[h];
      }
      for (int e = 0; e < 4; ++e) {
        const float m = st.m[j][e & 1];
        p[lane][j][e] = m == -INFINITY ? 0.0f : w.Exp2(x[lane][j][e] - m);
        st.l[j][e & 1] += p[lane][j][e];
      }
      for (int k = 0; k < kChunks; ++k) {
        for (int e = 0; e < 4; ++e) st.acc[j][k][e] *= correction[e & 1];
      }
    }
  });

  // Values, factor block by factor block: P' = P times each token's factor,
  // as fp16 hi + lo, moved to B fragments, against the codes' units.
  typename W::template R<uint32_t[NT][4]> pb;  // hi: tokens 0-7, 8-15; lo: the same
  typename W::template R<uint32_t[4]> fv;
  for (int vb = 0; vb < value_blocks; ++vb) {
    w.Lanes([&](int lane) {
      for (int j = 0; j < NT; ++j) {
        uint16_t hi[4], lo[4];
        for (int e = 0; e < 4; ++e) SplitHalf(p[lane][j][e] * a.values.Factor(CRow(lane, e), vb), &hi[e], &lo[e]);
        pb[lane][j][0] = PackHalves(hi[0], hi[1]);
        pb[lane][j][1] = PackHalves(hi[2], hi[3]);
        pb[lane][j][2] = PackHalves(lo[0], lo[1]);
        pb[lane][j][3] = PackHalves(lo[2], lo[3]);
      }
    });
    w.Transpose([&](int lane) { return &pb[lane][0][0]; }, 4 * NT);
    for (int k = vb * value_chunks_per_block; k < (vb + 1) * value_chunks_per_block; ++k) {
      w.Lanes([&](int lane) { ValueFragment(a.values, *a.value_table, lane, k, fv[lane]); });
      for (int j = 0; j < NT; ++j) {
        auto c = [&](int lane) { return state[lane].acc[j][k]; };
        auto v = [&](int lane) { return &fv[lane][0]; };
        w.Mma(c, v, [&](int lane) { return &pb[lane][j][0]; });
        w.Mma(c, v, [&](int lane) { return &pb[lane][j][2]; });
      }
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
  for (int j = 0; j < NT; ++j) {
    for (int h = 0; h < 2; ++h) {
      const int row = 8 * j + 2 * (lane & 3) + h;
      if (row >= rows) continue;
      float* o = out + row * (D + 2);
      if (g == 0) {
        o[0] = st.m[j][h] == -INFINITY ? -INFINITY : st.m[j][h] / kLog2e;
        o[1] = st.l[j][h];
      }
      for (int k = 0; k < D / 16; ++k) {
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
  for (int w = 0; w < warps; ++w) m = fmaxf(m, rows[w * stride]);
  if (i == 0) return m;
  float sum = 0.0f;
  for (int w = 0; w < warps; ++w) {
    const float mw = rows[w * stride];
    if (mw != -INFINITY) sum = fmaf(rows[w * stride + i], expf(mw - m), sum);
  }
  return sum;
}

}  // namespace turbokv::mma
