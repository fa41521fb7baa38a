// Highway SIMD scan of the CPU attention (compiled once per target, dispatched
// at run time). Tiles of up to 64 tokens: each key record is decoded once for
// all query rows of its GQA group and scored, then the tile's softmax update
// runs vectorized over tokens, then each value record is decoded once and
// accumulated into every row. Keys and values of every codec but f16 take the
// integer scan (int_scan-inl.h; on AVX3_DL, turbo keys with turbo values the
// VNNI path below); f16 takes the register-blocked f16 scan; the float scan
// is the reference (AttentionOptions::integer_dot_products = false) and the
// SCALAR target's only path.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cpu/int_scan-inl.h"
#include "kernels/cpu/turbo_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace turbokv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Decodes one record into the kernel's domain (see DecodeRow in attention.cc);
// `out` is aligned.
void DecodeRowSimd(const CodecLayout& layout, const float* centroids, const uint8_t* in,
                   float* HWY_RESTRICT out) {
  const int bits = TurboBits(layout.kind);
  if (bits != 0) {
    for (int b = 0; b < layout.blocks; ++b) {
      const uint8_t* block = in + static_cast<size_t>(b) * layout.block_bytes;
      float* w = out + b * layout.block_values;
      DispatchTurbo(layout.block_values, bits, [&](auto bv, auto kbits) {
        DecodeTurboBlockRotated<bv.value, kbits.value>(block, centroids, w);
      });
    }
    return;
  }
  if (layout.kind == CodecKind::kF16) {
    DecodeF16Values(layout.head_dim, in, out);
    return;
  }
  for (int b = 0; b < layout.blocks; ++b) {  // q8_0, q4_0: the scalar block decoders
    DecodeBlockToKernelDomain(layout, in + static_cast<size_t>(b) * layout.block_bytes, nullptr,
                              out + b * layout.block_values);
  }
}

// Per task: the codebooks of both tensors.
struct ScanSetup {
  explicit ScanSetup(const PagedKvCache& c)
      : key_table(LayoutCentroids(c.key_layout)), value_table(LayoutCentroids(c.value_layout)) {}
  const float* key_table;
  const float* value_table;
};

// <q, k> over dim floats (a multiple of twice the lanes; k aligned), in two
// chains of multiply-adds.
HWY_INLINE float DotFloat(const float* q, const float* HWY_RESTRICT k, int dim) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  auto acc0 = hn::Zero(d), acc1 = hn::Zero(d);
  for (int i = 0; i < dim; i += 2 * lanes) {
    acc0 = hn::MulAdd(hn::LoadU(d, q + i), hn::Load(d, k + i), acc0);
    acc1 = hn::MulAdd(hn::LoadU(d, q + i + lanes), hn::Load(d, k + i + lanes), acc1);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
}

// Raw scores <q_r, k_t> of the tile's n tokens into logits[r * kScanTile + j]:
// each key record decoded once, dotted with every row.
void ScoreTileFloat(const ScanTask& task, const ScanSetup& setup, int64_t t0, int n, float* k,
                    float* logits) {
  const PagedKvCache& c = *task.cache;
  const int dim = c.key_layout.head_dim;
  // A tile lies in one page: its records are consecutive.
  const uint8_t* records = c.key_record(task.head, t0);
  const size_t record_bytes = c.key_layout.code_size();
  for (int j = 0; j < n; ++j) {
    DecodeRowSimd(c.key_layout, setup.key_table, records + j * record_bytes, k);
    for (int r = 0; r < task.rows; ++r) {
      logits[r * kScanTile + j] = DotFloat(task.q + static_cast<size_t>(r) * dim, k, dim);
    }
  }
}

// acc_r += sum_j weights[r * kScanTile + j] * v_j: each value record decoded once.
void AccumulateTileFloat(const ScanTask& task, const ScanSetup& setup, int64_t t0, int n,
                         const float* weights, float* v, ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const int dim = c.key_layout.head_dim;
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const uint8_t* records = c.value_record(task.head, t0);
  const size_t record_bytes = c.value_layout.code_size();
  for (int j = 0; j < n; ++j) {
    DecodeRowSimd(c.value_layout, setup.value_table, records + j * record_bytes, v);
    for (int r = 0; r < task.rows; ++r) {
      const float weight = weights[r * kScanTile + j];
      if (weight == 0.0f) continue;
      const auto p = hn::Set(d, weight);
      float* acc = state->acc.data() + static_cast<size_t>(r) * dim;
      for (int i = 0; i < dim; i += lanes) {
        hn::StoreU(hn::MulAdd(p, hn::Load(d, v + i), hn::LoadU(d, acc + i)), d, acc + i);
      }
    }
  }
}

// Turns the raw scores of a tile into softmax weights (in place) and updates
// each row's running max, sum and accumulator scale. Invisible tokens and the
// slots past n get weight 0.
void SoftmaxTile(const ScanTask& task, int64_t t0, int n, float* logits, ScanState* state) {
  const int dim = task.cache->key_layout.head_dim;
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto scale = hn::Set(d, task.scale);
  const auto cap = hn::Set(d, task.softcap);
  const auto inv_cap = hn::Set(d, task.softcap > 0.0f ? 1.0f / task.softcap : 0.0f);
  for (int r = 0; r < task.rows; ++r) {
    float* lr = logits + r * kScanTile;
    const auto offset = hn::Set(d, task.offset != nullptr ? task.offset[r] : 0.0f);
    const int query = r / task.group;
    const int64_t lo = std::max<int64_t>(task.first[query] - t0, 0);
    const int64_t hi = std::min<int64_t>(task.last[query] - t0 + 1, n);  // visible: [lo, hi)
    if (lo >= hi) {  // nothing visible: no weight on any token of the tile
      for (int j = 0; j < kScanTile; ++j) lr[j] = 0.0f;
      continue;
    }
    const bool whole = lo == 0 && hi == kScanTile;  // every slot visible: no masks
    // The vectors past the last visible token are all weight 0: not computed.
    const int end = static_cast<int>((hi + lanes - 1) / lanes * lanes);
    auto max = hn::Set(d, -INFINITY);
    for (int j = 0; j < end; j += lanes) {
      auto x = hn::MulAdd(hn::Load(d, lr + j), scale, offset);
      // Not inlined: GCC 12 miscompiles Highway's inlined Tanh in this loop on
      // the AVX-512 targets (wrong logits, caught by the softcap tests).
      if (task.softcap > 0.0f) x = hn::Mul(cap, hn::CallTanh(d, hn::Mul(x, inv_cap)));
      // Invisible tokens (and slots past n) get -inf.
      if (!whole) {
        const auto index = hn::Iota(d, static_cast<float>(j));
        x = hn::IfThenElse(hn::And(hn::Ge(index, hn::Set(d, static_cast<float>(lo))),
                                   hn::Lt(index, hn::Set(d, static_cast<float>(hi)))),
                           x, hn::Set(d, -INFINITY));
      }
      max = hn::Max(max, x);
      hn::Store(x, d, lr + j);
    }
    const float tile_max = hn::GetLane(hn::MaxOfLanes(d, max));
    if (task.top_k > 0) {
      for (int64_t j = lo; j < hi; ++j) state->top[r].Push(lr[j], t0 + j);
    }
    const float m_old = state->m[r];
    const float m_new = std::max(m_old, tile_max);
    const float correction = std::exp(m_old - m_new);
    const auto m = hn::Set(d, m_new);
    const auto floor = hn::Set(d, -100.0f);
    auto sum = hn::Zero(d);
    for (int j = 0; j < end; j += lanes) {
      const auto x = hn::Load(d, lr + j);
      auto p = hn::Exp(d, hn::Max(hn::Sub(x, m), floor));
      if (!whole) p = hn::IfThenElseZero(hn::Gt(x, hn::Set(d, -INFINITY)), p);
      hn::Store(p, d, lr + j);
      sum = hn::Add(sum, p);
    }
    for (int j = end; j < kScanTile; ++j) lr[j] = 0.0f;
    if (correction != 1.0f) {
      float* acc = state->acc.data() + static_cast<size_t>(r) * dim;
      const auto corr = hn::Set(d, correction);
      for (int i = 0; i < dim; i += lanes) hn::StoreU(hn::Mul(hn::LoadU(d, acc + i), corr), d, acc + i);
    }
    state->l[r] = state->l[r] * correction + hn::GetLane(hn::SumOfLanes(d, sum));
    state->m[r] = m_new;
  }
}

#if HWY_TARGET != HWY_SCALAR
// f16 keys and values, the in-run baseline of the benchmarks: each record is
// converted once (F16C, or native on Arm) for every row of its GQA group,
// straight from the page into registers, and the rows' sums stay in
// registers. Two keys at a time: a GQA group of four rows then has eight
// independent chains of multiply-adds (enough to keep two FMA pipes busy),
// and each load of the query serves both keys. 512-bit vectors and four
// keys at a time measured slower on AVX-512 (Zen 4).
constexpr int kF16Tokens = 2;

// Raw scores of keys j .. j + kTok - 1 of the tile (records from `keys`)
// against rows q[0 .. kRows) into partial[r][j] (IntScan's layout), summed
// across lanes by SumsOfRows.
template <int kRows, int kTok>
HWY_INLINE void ScoreF16Tokens(const float* const* q, const uint8_t* keys, size_t record_bytes, int dim, int j,
                               const TilePrefetch* prefetch, float* partial) {
  const IntDF df;
  const hn::Rebind<hwy::float16_t, IntDF> dh;
  if (prefetch != nullptr) {
    for (int t = 0; t < kTok; ++t) prefetch->Token(j + t);
  }
  hn::Vec<IntDF> acc[kRows][kTok];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTok; ++t) acc[r][t] = hn::Zero(df);
  }
  const hwy::float16_t* k[kTok];
  for (int t = 0; t < kTok; ++t) k[t] = reinterpret_cast<const hwy::float16_t*>(keys + (j + t) * record_bytes);
  for (int i = 0; i < dim; i += kL32) {
    hn::Vec<IntDF> kv[kTok];
    for (int t = 0; t < kTok; ++t) kv[t] = hn::PromoteTo(df, hn::LoadU(dh, k[t] + i));
    for (int r = 0; r < kRows; ++r) {
      const auto qv = hn::LoadU(df, q[r] + i);
      for (int t = 0; t < kTok; ++t) acc[r][t] = hn::MulAdd(kv[t], qv, acc[r][t]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTok; ++t) hn::Store(acc[r][t], df, partial + (r * kScanTile + j + t) * kL32);
  }
}

template <int kRows>
HWY_NOINLINE void ScoreF16Rows(const ScanTask& task, int r0, const uint8_t* records, size_t record_bytes, int n,
                               const TilePrefetch* prefetch, float* partial) {
  const int dim = task.cache->key_layout.head_dim;
  const float* q[kRows];
  for (int r = 0; r < kRows; ++r) q[r] = task.q + static_cast<size_t>(r0 + r) * dim;
  int j = 0;
  for (; j + kF16Tokens <= n; j += kF16Tokens) {
    ScoreF16Tokens<kRows, kF16Tokens>(q, records, record_bytes, dim, j, prefetch, partial);
  }
  for (; j < n; ++j) ScoreF16Tokens<kRows, 1>(q, records, record_bytes, dim, j, prefetch, partial);
}

void ScoreTileF16(const ScanTask& task, int64_t t0, int n, float* partial, float* logits) {
  const PagedKvCache& c = *task.cache;
  const uint8_t* records = c.key_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.key_layout.code_size();
  const TilePrefetch tile_prefetch(task, t0, n);
  const IntDF df;
  for (int r0 = 0; r0 < task.rows; r0 += 4) {
    const int group = std::min(4, task.rows - r0);
    const TilePrefetch* prefetch = r0 == 0 ? &tile_prefetch : nullptr;  // once per token
    switch (group) {
      case 4: ScoreF16Rows<4>(task, r0, records, record_bytes, n, prefetch, partial); break;
      case 3: ScoreF16Rows<3>(task, r0, records, record_bytes, n, prefetch, partial); break;
      case 2: ScoreF16Rows<2>(task, r0, records, record_bytes, n, prefetch, partial); break;
      default: ScoreF16Rows<1>(task, r0, records, record_bytes, n, prefetch, partial); break;
    }
    for (int r = 0; r < group; ++r) {
      for (int j = 0; j < n; j += kL32) {
        hn::Store(SumsOfRows(df, partial + (r * kScanTile + j) * kL32), df, logits + (r0 + r) * kScanTile + j);
      }
    }
  }
}

// acc_r += sum_j weights[r * kScanTile + j] * v_j for rows r0 .. r0 + kRows,
// 2 * kL32 dimensions at a time held in registers across the tile.
template <int kRows>
HWY_NOINLINE void AccumulateF16Rows(const uint8_t* records, size_t record_bytes, int n, int dim,
                                    const float* weights, float* acc) {
  const IntDF df;
  const hn::Rebind<hwy::float16_t, IntDF> dh;
  for (int i = 0; i < dim; i += 2 * kL32) {
    hn::Vec<IntDF> a0[kRows], a1[kRows];
    for (int r = 0; r < kRows; ++r) {
      a0[r] = hn::LoadU(df, acc + static_cast<size_t>(r) * dim + i);
      a1[r] = hn::LoadU(df, acc + static_cast<size_t>(r) * dim + i + kL32);
    }
    for (int j = 0; j < n; ++j) {
      const auto* v = reinterpret_cast<const hwy::float16_t*>(records + j * record_bytes) + i;
      const auto v0 = hn::PromoteTo(df, hn::LoadU(dh, v));
      const auto v1 = hn::PromoteTo(df, hn::LoadU(dh, v + kL32));
      for (int r = 0; r < kRows; ++r) {
        const auto w = hn::Set(df, weights[r * kScanTile + j]);
        a0[r] = hn::MulAdd(w, v0, a0[r]);
        a1[r] = hn::MulAdd(w, v1, a1[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      hn::StoreU(a0[r], df, acc + static_cast<size_t>(r) * dim + i);
      hn::StoreU(a1[r], df, acc + static_cast<size_t>(r) * dim + i + kL32);
    }
  }
}

void AccumulateTileF16(const ScanTask& task, int64_t t0, int n, const float* weights, ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const uint8_t* records = c.value_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.value_layout.code_size();
  const int dim = c.value_layout.head_dim;
  for (int r0 = 0; r0 < task.rows; r0 += 4) {
    const int group = std::min(4, task.rows - r0);
    const float* w = weights + r0 * kScanTile;
    float* acc = state->acc.data() + static_cast<size_t>(r0) * dim;
    switch (group) {
      case 4: AccumulateF16Rows<4>(records, record_bytes, n, dim, w, acc); break;
      case 3: AccumulateF16Rows<3>(records, record_bytes, n, dim, w, acc); break;
      case 2: AccumulateF16Rows<2>(records, record_bytes, n, dim, w, acc); break;
      default: AccumulateF16Rows<1>(records, record_bytes, n, dim, w, acc); break;
    }
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

#if HWY_TARGET == HWY_AVX3_DL
// Highway's AVX3_DL target string names the VEX avxvnni; the 512-bit dot
// products need avx512vnni, which the AVX3_DL run-time check requires.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
}  // namespace HWY_NAMESPACE
}  // namespace turbokv
#include <immintrin.h>
namespace turbokv {
namespace HWY_NAMESPACE {

// Integer path for turbo keys and values (rotation blocks of 64 or 128), on
// AVX-512 VNNI/VBMI. Key centroids become int16 (x 8192) and the rotated query
// int16 per block (x 8191 / max|q|); scores are vpdpwssd dot products, each
// int32 lane summing 8 products of at most 22037 x 8191 (< 2^31), the lanes
// then summed as floats (a key and query that agree overflow int32). Value
// centroids become int16 (x 1024) and the softmax weights int16 per tile
// (x 8191 / the tile's largest weight); a lane sums 64 products of at most
// 2755 x 8191 (< 2^31). Logits and outputs agree with the float path to about
// 1e-4 relative, far inside any codec's own error.
constexpr float kKeyCentroidScale = 8192.0f;
constexpr float kValueCentroidScale = 1024.0f;
constexpr float kQueryMax = 8191.0f;
constexpr float kWeightMax = 8191.0f;

bool IntPathApplies(CodecKind keys, CodecKind values) {
  // Keys and values share head_dim, hence the rotation block size.
  return TurboBits(keys) != 0 && TurboBits(values) != 0;
}

__m512i CentroidTable16(const float* centroids, int bits, float scale) {
  alignas(64) int16_t table[32] = {};
  for (int i = 0; i < (1 << bits); ++i) {
    table[i] = static_cast<int16_t>(std::lrint(centroids[i] * scale));
  }
  return _mm512_load_si512(table);
}

// A 16-bit shift count for every word of 128-bit lane m: counts[m] (lane m
// of a 512-bit vector holds bytes 16 m .. 16 m + 15).
HWY_INLINE __m512i LaneWordCounts(int16_t c0, int16_t c1, int16_t c2, int16_t c3) {
  constexpr long long kEveryWord = 0x0001000100010001LL;
  return _mm512_set_epi64(c3 * kEveryWord, c3 * kEveryWord, c2 * kEveryWord, c2 * kEveryWord,
                          c1 * kEveryWord, c1 * kEveryWord, c0 * kEveryWord, c0 * kEveryWord);
}

// Indices 0..63 and 64..127 of one block, one per byte.
template <int kBits>
HWY_INLINE void UnpackIndices(const uint8_t* planes, __m512i* lo, __m512i* hi) {
  if (kBits == 4) {
    const __m512i p = _mm512_loadu_si512(planes);
    const __m512i mask = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(p, mask);
    *hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
    return;
  }
  const __m512i p = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes)));
  const __m512i three = _mm512_set1_epi8(3);
  // Halves of the 2-bit plane: indices j, j + 32 | j + 64, j + 96.
  const __m512i shift_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  *lo = _mm512_and_si512(_mm512_srlv_epi16(p, shift_lo), three);
  *hi = _mm512_and_si512(_mm512_srlv_epi16(p, shift_hi), three);
  if (kBits == 3) {
    // High bits: 16 bytes, index j + 16 m at bit m; 128-bit lane m of the
    // result holds indices 16 m .. 16 m + 15.
    const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 32)));
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i bit_lo = _mm512_srlv_epi16(h, LaneWordCounts(0, 1, 2, 3));
    const __m512i bit_hi = _mm512_srlv_epi16(h, LaneWordCounts(4, 5, 6, 7));
    *lo = _mm512_or_si512(*lo, _mm512_slli_epi16(_mm512_and_si512(bit_lo, one), 2));
    *hi = _mm512_or_si512(*hi, _mm512_slli_epi16(_mm512_and_si512(bit_hi, one), 2));
  }
}

HWY_INLINE uint64_t LoadLittleEndian64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));  // x86 is little-endian
  return v;
}

// The 64 indices of a block of 64 values, one per byte.
template <int kBits>
HWY_INLINE __m512i UnpackIndices64(const uint8_t* planes) {
  if (kBits == 4) {  // 32 bytes: index j (low nibble), j + 32 (high nibble)
    const __m512i p = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes)));
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(p, shift), _mm512_set1_epi8(0x0f));
  }
  // 16 bytes of 2-bit fields: index j + 16 m at bits 2 m; lane m of the result
  // holds indices 16 m .. 16 m + 15.
  const __m512i p = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(planes)));
  __m512i index = _mm512_and_si512(_mm512_srlv_epi16(p, LaneWordCounts(0, 2, 4, 6)), _mm512_set1_epi8(3));
  if (kBits == 3) {
    // 8 bytes of high bits: index j + 8 m at bit m. In lane m, bytes 0-7 take
    // bit 2 m and bytes 8-15 bit 2 m + 1 of the same 8 bytes.
    const __m512i h = _mm512_set1_epi64(static_cast<long long>(LoadLittleEndian64(planes + 16)));
    constexpr long long kEveryWord = 0x0001000100010001LL;
    // 2 m in the low qword of lane m, 2 m + 1 in the high one.
    const __m512i shift = _mm512_set_epi64(7 * kEveryWord, 6 * kEveryWord, 5 * kEveryWord, 4 * kEveryWord,
                                           3 * kEveryWord, 2 * kEveryWord, 1 * kEveryWord, 0);
    index = _mm512_or_si512(
        index, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift), _mm512_set1_epi8(1)), 2));
  }
  return index;
}

// The int16 centroids of one block of kB values: kB / 32 vectors of 32
// values in index order.
template <int kB, int kBits>
HWY_INLINE void BlockCentroids16(const uint8_t* block, __m512i table, __m512i* c) {
  __m512i parts[2];
  if (kB == 128) {
    UnpackIndices<kBits>(block + kTurboScaleBytes, &parts[0], &parts[1]);
  } else {
    parts[0] = UnpackIndices64<kBits>(block + kTurboScaleBytes);
  }
  for (int h = 0; h < kB / 64; ++h) {
    c[2 * h] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(parts[h])), table);
    c[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(parts[h], 1)), table);
  }
}

// Sums of the 16 lanes of v[0..15], in order: result lane t = sum of v[t].
// Summed as floats: each lane is below 2^31, a sum of them need not be.
HWY_INLINE __m512 ReduceLanes16(const __m512i* v) {
  __m512 f[16], w[8], x[4], y[2];
  for (int k = 0; k < 16; ++k) f[k] = _mm512_cvtepi32_ps(v[k]);
  for (int k = 0; k < 8; ++k) {
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(f[2 * k], f[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(f[2 * k], f[2 * k + 1], 0xee));
  }
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xdd));
  }
  const auto pairs_lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto pairs_hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int k = 0; k < 2; ++k) y[k] = _mm512_add_ps(pairs_lo(x[2 * k], x[2 * k + 1]), pairs_hi(x[2 * k], x[2 * k + 1]));
  const __m512 t1 = _mm512_unpacklo_ps(y[0], y[1]);
  const __m512 t2 = _mm512_unpackhi_ps(y[0], y[1]);
  const __m512 z = _mm512_add_ps(pairs_lo(t1, t2), pairs_hi(t1, t2));
  // Lane 4 L + p of z holds token L, 8 + L, 4 + L, 12 + L for p = 0, 1, 2, 3.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 13, 9, 5, 1, 14, 10, 6, 2, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, z);
}

// Buffers kept per thread across scan tasks (see Scratch).
struct IntPathWorkspace {
  Scratch<int16_t> q, values;
  Scratch<float> q_scale;
  Scratch<int32_t> pair_weights;
};

struct IntPath {
  int dim = 0;
  int block_values = 0;
  int blocks = 0;
  int key_bits = 0;
  int value_bits = 0;
  __m512i key_table, value_table;
  int16_t* q = nullptr;              // [rows][dim]
  float* q_scale = nullptr;          // [rows][blocks]: float score per integer unit
  int16_t* values = nullptr;         // [kScanTile][block_values]: one block of the tile's values, decoded
  int32_t* pair_weights = nullptr;   // [rows][kScanTile / 2]

  IntPath(const ScanTask& task, const ScanSetup& setup) {
    const PagedKvCache& c = *task.cache;
    dim = c.key_layout.head_dim;
    block_values = c.key_layout.block_values;
    blocks = c.key_layout.blocks;
    key_bits = TurboBits(c.key_layout.kind);
    value_bits = TurboBits(c.value_layout.kind);
    key_table = CentroidTable16(setup.key_table, key_bits, kKeyCentroidScale);
    value_table = CentroidTable16(setup.value_table, value_bits, kValueCentroidScale);
    thread_local IntPathWorkspace w;
    q = w.q.Get(static_cast<size_t>(task.rows) * dim);
    q_scale = w.q_scale.Get(static_cast<size_t>(task.rows) * blocks);
    values = w.values.Get(static_cast<size_t>(kScanTile) * block_values);
    pair_weights = w.pair_weights.Get(static_cast<size_t>(task.rows) * (kScanTile / 2));
    // 16 values a vector (block_values is 64 or 128); the largest |q| is
    // exact in any order, and the conversion rounds to nearest even as
    // lrint does.
    for (int r = 0; r < task.rows; ++r) {
      for (int b = 0; b < blocks; ++b) {
        const float* src = task.q + static_cast<size_t>(r) * dim + b * block_values;
        __m512 largest = _mm512_setzero_ps();
        for (int i = 0; i < block_values; i += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
        const float max = _mm512_reduce_max_ps(largest);
        const __m512 to_int = _mm512_set1_ps(max > 0.0f ? kQueryMax / max : 0.0f);
        int16_t* dst = q + static_cast<size_t>(r) * dim + b * block_values;
        for (int i = 0; i < block_values; i += 16) {
          const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), to_int));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtsepi32_epi16(rounded));
        }
        q_scale[r * blocks + b] = max > 0.0f ? max / kQueryMax / kKeyCentroidScale : 0.0f;
      }
    }
  }
};

template <int kB, int kBits>
void ScoreTileVnni(const ScanTask& task, IntPath& ip, int64_t t0, int n, float* logits) {
  const PagedKvCache& c = *task.cache;
  const int blocks = ip.blocks;
  const uint8_t* records = c.key_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.key_layout.code_size();
  const TilePrefetch prefetch(task, t0, n);
  for (int j = 0; j < kScanTile * task.rows; ++j) logits[j] = 0.0f;
  alignas(64) float scales[kScanTile];
  alignas(64) __m512i acc[4][kScanTile];
  for (int r = 0; r < 4; ++r) {
    for (int j = n; j < kScanTile; ++j) acc[r][j] = _mm512_setzero_si512();
  }
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* first = records + b * c.key_layout.block_bytes;
    {  // the blocks' fp16 scales, 16 tokens a conversion (0 past n)
      alignas(64) uint16_t bits[kScanTile] = {};
      for (int j = 0; j < n; ++j) bits[j] = LoadHalfBits(first + j * record_bytes);
      const __m512 per_value = _mm512_set1_ps(1.0f / static_cast<float>(kB));
      for (int j = 0; j < kScanTile; j += 16) {
        const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits + j));
        _mm512_store_ps(scales + j, _mm512_mul_ps(_mm512_cvtph_ps(h), per_value));
      }
    }
    // Rows in groups of four share each decoded key block.
    for (int r0 = 0; r0 < task.rows; r0 += 4) {
      const int rows = std::min(4, task.rows - r0);
      const int16_t* q = ip.q + static_cast<size_t>(r0) * ip.dim + b * kB;
      const bool first_pass = b == 0 && r0 == 0;
      auto score = [&](auto kRows) {
        for (int j = 0; j < n; ++j) {
          if (first_pass) prefetch.Token(j);
          __m512i cent[kB / 32];
          BlockCentroids16<kB, kBits>(first + j * record_bytes, ip.key_table, cent);
          for (int r = 0; r < kRows.value; ++r) {
            const int16_t* qr = q + r * ip.dim;
            __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), cent[0], _mm512_loadu_si512(qr));
            for (int k = 1; k < kB / 32; ++k) a = _mm512_dpwssd_epi32(a, cent[k], _mm512_loadu_si512(qr + 32 * k));
            acc[r][j] = a;
          }
        }
      };
      switch (rows) {
        case 4: score(std::integral_constant<int, 4>()); break;
        case 3: score(std::integral_constant<int, 3>()); break;
        case 2: score(std::integral_constant<int, 2>()); break;
        default: score(std::integral_constant<int, 1>()); break;
      }
      for (int r = 0; r < rows; ++r) {
        const __m512 unit = _mm512_set1_ps(ip.q_scale[(r0 + r) * blocks + b]);
        float* lr = logits + (r0 + r) * kScanTile;
        for (int j = 0; j < n; j += 16) {  // slots past the tile's tokens keep their 0
          const __m512 dot = ReduceLanes16(&acc[r][j]);
          const __m512 contribution = _mm512_mul_ps(_mm512_mul_ps(dot, unit), _mm512_load_ps(scales + j));
          _mm512_storeu_ps(lr + j, _mm512_add_ps(_mm512_loadu_ps(lr + j), contribution));
        }
      }
    }
  }
}

// acc_r += sum_j w_rj v_j over a tile for kRows rows (kept in registers).
template <int kB, int kRows>
HWY_INLINE void AccumulateRowsVnni(const int16_t* values, int pairs, const int32_t* pair_weights,
                                  const float* unit, int dim, int block, float* acc_out) {
  // Natural dimension order of the two halves that unpacklo/hi_epi16 make of a
  // 32-value chunk: lo = dims 0-3, 8-11, 16-19, 24-27; hi = 4-7, 12-15, ...
  const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int chunk = 0; chunk < kB / 32; ++chunk) {  // 32 dimensions at a time
    __m512i acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int p = 0; p < pairs; ++p) {
      const int16_t* v0 = values + static_cast<size_t>(2 * p) * kB + 32 * chunk;
      const __m512i a = _mm512_loadu_si512(v0);
      const __m512i a1 = _mm512_loadu_si512(v0 + kB);
      const __m512i lo = _mm512_unpacklo_epi16(a, a1);
      const __m512i hi = _mm512_unpackhi_epi16(a, a1);
      for (int r = 0; r < kRows; ++r) {
        const __m512i w = _mm512_set1_epi32(pair_weights[r * (kScanTile / 2) + p]);
        acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], lo, w);
        acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], hi, w);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 u = _mm512_set1_ps(unit[r]);
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][0]), u);
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][1]), u);
      float* out = acc_out + static_cast<size_t>(r) * dim + block * kB + 32 * chunk;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_permutex2var_ps(lo, first16, hi)));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16), _mm512_permutex2var_ps(lo, second16, hi)));
    }
  }
}

template <int kB, int kBits>
void AccumulateTileVnni(const ScanTask& task, IntPath& ip, int64_t t0, int n, const float* weights,
                       ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const int blocks = ip.blocks;
  const int dim = c.value_layout.head_dim;
  const int pairs = (n + 1) / 2;
  const uint8_t* records = c.value_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.value_layout.code_size();
  alignas(64) float scales[kScanTile];
  for (int b = 0; b < blocks; ++b) {
    for (int j = 0; j < kScanTile; ++j) scales[j] = 0.0f;
    for (int j = 0; j < n; ++j) {
      const uint8_t* block = records + j * record_bytes + b * c.value_layout.block_bytes;
      scales[j] = TurboDecodeFactor(block, kB);
      __m512i cent[kB / 32];
      BlockCentroids16<kB, kBits>(block, ip.value_table, cent);
      int16_t* dst = ip.values + static_cast<size_t>(j) * kB;
      for (int k = 0; k < kB / 32; ++k) _mm512_storeu_si512(dst + 32 * k, cent[k]);
    }
    // With n odd the last pair's second slot holds stale values; its weight is 0.
    for (int r0 = 0; r0 < task.rows; r0 += 4) {
      const int rows = std::min(4, task.rows - r0);
      float unit[4] = {};
      for (int r = 0; r < rows; ++r) {
        // Weights times value scales, as int16 pairs: (w_2p, w_2p+1).
        const float* w = weights + (r0 + r) * kScanTile;
        // Only the vectors that hold the tile's n tokens: the pairs read
        // stop there.
        const int vectors = (n + 15) / 16;
        __m512 scaled[kScanTile / 16];
        __m512 max = _mm512_setzero_ps();
        for (int h = 0; h < vectors; ++h) {
          scaled[h] = _mm512_mul_ps(_mm512_loadu_ps(w + 16 * h), _mm512_load_ps(scales + 16 * h));
          max = _mm512_max_ps(max, scaled[h]);
        }
        const float m = _mm512_reduce_max_ps(max);
        const __m512 to_int = _mm512_set1_ps(m > 0.0f ? kWeightMax / m : 0.0f);
        int16_t* pw = reinterpret_cast<int16_t*>(ip.pair_weights + static_cast<size_t>(r0 + r) * (kScanTile / 2));
        for (int h = 0; h < vectors; ++h) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + 16 * h),
                              _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(scaled[h], to_int))));
        }
        unit[r] = m / kWeightMax / kValueCentroidScale;
      }
      const int32_t* pw = ip.pair_weights + static_cast<size_t>(r0) * (kScanTile / 2);
      float* out = state->acc.data() + static_cast<size_t>(r0) * dim;
      switch (rows) {
        case 4: AccumulateRowsVnni<kB, 4>(ip.values, pairs, pw, unit, dim, b, out); break;
        case 3: AccumulateRowsVnni<kB, 3>(ip.values, pairs, pw, unit, dim, b, out); break;
        case 2: AccumulateRowsVnni<kB, 2>(ip.values, pairs, pw, unit, dim, b, out); break;
        default: AccumulateRowsVnni<kB, 1>(ip.values, pairs, pw, unit, dim, b, out); break;
      }
    }
  }
}

// MultiplyAddPeak on this path's instruction: 512-bit vpdpwssd.
int64_t VnniMultiplyAdds(int64_t steps) {
  // Each chain waits on its last result: 12 chains cover vpdpwssd's latency
  // at one a cycle.
  constexpr int kChains = 12;
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c + 1);
  const __m512i three = _mm512_set1_epi16(3);
  for (int64_t i = 0; i < steps; i += kChains) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpwssd_epi32(acc[c], acc[c], three);
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
  return _mm512_reduce_add_epi32(acc[0]);
}

#pragma GCC pop_options
#endif  // HWY_TARGET == HWY_AVX3_DL

// Scan's own buffers, kept per thread (see Scratch).
struct ScanWorkspace {
  Scratch<float> row, logits, f16_partial;
};

void Scan(const ScanTask& task, ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const ScanSetup setup(c);
  thread_local ScanWorkspace w;
  float* const row_buffer = w.row.Get(c.key_layout.head_dim);
  float* const logits = w.logits.Get(static_cast<size_t>(task.rows) * kScanTile);
  bool vnni = false;
#if HWY_TARGET == HWY_AVX3_DL
  std::optional<IntPath> int_path;  // on the stack: a short session's items are many
  if (task.integer_dot_products && IntPathApplies(c.key_layout.kind, c.value_layout.kind)) {
    int_path.emplace(task, setup);
    vnni = true;
  }
#endif
#if HWY_TARGET != HWY_SCALAR
  std::unique_ptr<IntScan> ints;
  const bool int_keys = task.integer_dot_products && IntCodecApplies(c.key_layout.kind);
  const bool int_values = task.integer_dot_products && IntCodecApplies(c.value_layout.kind);
  if (!vnni && (int_keys || int_values)) ints = std::make_unique<IntScan>(task, int_keys, int_values);
  const bool f16_keys = c.key_layout.kind == CodecKind::kF16;
  const bool f16_values = c.value_layout.kind == CodecKind::kF16;
  float* const f16_partial = f16_keys ? w.f16_partial.Get(4 * kScanTile * kL32) : nullptr;
#endif
  for (int64_t t0 = task.begin; t0 < task.end;) {
    // A tile never crosses a page.
    const int64_t page_end = (t0 / c.page_tokens + 1) * c.page_tokens;
    const int n = static_cast<int>(std::min<int64_t>({kScanTile, task.end - t0, page_end - t0}));
#if HWY_TARGET == HWY_AVX3_DL
    if (int_path) {
      IntPath& ip = *int_path;
      DispatchTurbo(ip.block_values, ip.key_bits, [&](auto bv, auto bits) {
        ScoreTileVnni<bv.value, bits.value>(task, ip, t0, n, logits);
      });
      SoftmaxTile(task, t0, n, logits, state);
      DispatchTurbo(ip.block_values, ip.value_bits, [&](auto bv, auto bits) {
        AccumulateTileVnni<bv.value, bits.value>(task, ip, t0, n, logits, state);
      });
      t0 += n;
      continue;
    }
#endif
#if HWY_TARGET != HWY_SCALAR
    if (ints && ints->key) {
      ScoreTileInt(task, *ints, t0, n, logits);
    } else if (f16_keys) {
      ScoreTileF16(task, t0, n, f16_partial, logits);
    } else {
      ScoreTileFloat(task, setup, t0, n, row_buffer, logits);
    }
    SoftmaxTile(task, t0, n, logits, state);
    if (ints && ints->value) {
      AccumulateTileInt(task, *ints, t0, n, logits, state);
    } else if (f16_values) {
      AccumulateTileF16(task, t0, n, logits, state);
    } else {
      AccumulateTileFloat(task, setup, t0, n, logits, row_buffer, state);
    }
#else
    ScoreTileFloat(task, setup, t0, n, row_buffer, logits);
    SoftmaxTile(task, t0, n, logits, state);
    AccumulateTileFloat(task, setup, t0, n, logits, row_buffer, state);
#endif
    t0 += n;
  }
#if HWY_TARGET != HWY_SCALAR
  if (ints && ints->value) UnpermuteValues(*ints, state);
#endif
  (void)vnni;
}

// MultiplyAddPeak (cpu_codecs.h) on this target: the step of the
// path Scan takes for these codecs, `steps` times over registers, each
// operand the chain's last result so that nothing is hoisted.
int64_t MultiplyAddPeakT(CodecKind keys, CodecKind values, int64_t steps, int* per_step) {
  *per_step = 0;
#if HWY_TARGET != HWY_SCALAR
  if (!IntCodecApplies(keys) || !IntCodecApplies(values)) return 0;  // f16: float products
#if HWY_TARGET == HWY_AVX3_DL
  if (IntPathApplies(keys, values)) {
    *per_step = 32;
    return VnniMultiplyAdds(steps);
  }
#endif
  *per_step = kL16;
  return IntScanMultiplyAdds(steps);
#else
  (void)keys;
  (void)values;
  (void)steps;
  return 0;
#endif
}

// AttendFewCpu: the head's visible tokens' keys and values decoded once,
// then each row's logits, softmax and weighted sum in one pass over them.
struct FewWorkspace {
  Scratch<float> keys, values, logits, weights;
};

void AttendFew(const AttentionProblem& p, const AttentionParams& params, int h, int64_t first_query,
               int64_t queries) {
  const PagedKvCache& c = p.cache;
  const int dim = c.key_layout.head_dim;
  const int group = params.q_heads / c.kv_heads;
  const int tokens = static_cast<int>(c.tokens);
  const float scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(dim));
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  thread_local FewWorkspace w;
  float* const keys = w.keys.Get(static_cast<size_t>(tokens) * dim);
  float* const values = w.values.Get(static_cast<size_t>(tokens) * dim);
  float* const logits = w.logits.Get(kMaxFewTokens);
  float* const weights = w.weights.Get(kMaxFewTokens);
  std::vector<TopEntry> top;
  for (int64_t t = c.first_token; t < tokens; ++t) {
    DecodeRowSimd(c.key_layout, nullptr, c.key_record(h, t), keys + static_cast<size_t>(t) * dim);
    DecodeRowSimd(c.value_layout, nullptr, c.value_record(h, t), values + static_cast<size_t>(t) * dim);
  }
  for (int64_t i = first_query; i < first_query + queries; ++i) {
    const int64_t position = p.queries.positions[i];
    const int64_t first = std::max<int64_t>(c.first_token, params.window > 0 ? position - params.window + 1 : 0);
    const int64_t last = std::min<int64_t>(position, tokens - 1);
    const int count = static_cast<int>(std::max<int64_t>(last - first + 1, 0));
    for (int g = 0; g < group; ++g) {
      const size_t o = static_cast<size_t>(i) * params.q_heads + h * group + g;
      const float* q = p.queries.q + o * dim;
      float* out = p.output.out + o * dim;
      const float offset = p.queries.logit_offset != nullptr ? p.queries.logit_offset[o] : 0.0f;
      float m = -INFINITY;
      for (int j = 0; j < count; ++j) {
        const float score = DotFloat(q, keys + static_cast<size_t>(first + j) * dim, dim);
        logits[j] = Logit(score, scale, offset, params.softcap);
        m = std::max(m, logits[j]);
      }
      auto sum = hn::Zero(d);
      for (int j = 0; j < count; j += lanes) {
        const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, logits + j), hn::Set(d, m)));
        const auto kept = hn::IfThenElseZero(hn::FirstN(d, static_cast<size_t>(count - j)), e);
        hn::StoreU(kept, d, weights + j);
        sum = hn::Add(sum, kept);
      }
      const float l = hn::GetLane(hn::SumOfLanes(d, sum));
      for (int x = 0; x < dim; x += lanes) {
        auto acc = hn::Zero(d);
        for (int j = 0; j < count; ++j) {
          acc = hn::MulAdd(hn::Set(d, weights[j]), hn::Load(d, values + static_cast<size_t>(first + j) * dim + x), acc);
        }
        hn::StoreU(hn::Mul(acc, hn::Set(d, count > 0 ? 1.0f / l : 0.0f)), d, out + x);
      }
      p.output.lse[o] = count > 0 ? m + std::log(l) : -INFINITY;
      if (params.top_k == 0) continue;
      top.clear();
      for (int j = 0; j < count; ++j) top.push_back({logits[j], first + j});
      std::sort(top.begin(), top.end(), Ranks);
      for (int k = 0; k < params.top_k; ++k) {
        const bool have = k < static_cast<int>(top.size());
        p.output.topk_tokens[o * params.top_k + k] = have ? top[k].token : -1;
        p.output.topk_logits[o * params.top_k + k] = have ? top[k].logit : -INFINITY;
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace turbokv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace turbokv {

HWY_EXPORT(Scan);
HWY_EXPORT(AttendFew);
HWY_EXPORT(MultiplyAddPeakT);

void ScanSimd(const ScanTask& task, ScanState* state) { HWY_DYNAMIC_DISPATCH(Scan)(task, state); }

void AttendFewCpu(const AttentionProblem& problem, const AttentionParams& params, int head, int64_t first_query,
                  int64_t queries) {
  HWY_DYNAMIC_DISPATCH(AttendFew)(problem, params, head, first_query, queries);
}

int64_t MultiplyAddPeak(CodecKind keys, CodecKind values, int64_t steps, int* per_step) {
  return HWY_DYNAMIC_DISPATCH(MultiplyAddPeakT)(keys, values, steps, per_step);
}

}  // namespace turbokv
#endif  // HWY_ONCE
