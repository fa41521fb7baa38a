// The integer attention scan, written once for every SIMD target (SSSE3,
// SSE4, AVX2, AVX-512 at 256 bits, NEON): keys scored and values accumulated
// with int16 x int16 -> int32 multiply-adds (ReorderWidenMulAccumulate:
// vpmaddwd on x86, vmlal on Arm), turbo centroids looked up with byte
// shuffles (TableLookupBytes), q8_0 / q4_0 values widened from their bytes.
// Highway's -inl.h pattern: included once per target by attention_simd.cc.
//
// Integer ranges (every sum stays below 2^31 on every target):
// - keys: turbo centroids scale to at most 8191 and the query to at most 8191
//   per key block; q8_0 (|x| <= 127) and q4_0 (|x| <= 8) keys take a query of
//   up to 32767. The query's scale also keeps the block's sum of |q| at most
//   (2^31 - 1) / (largest key integer), so that the whole block's dot
//   product fits, not only each lane's (the lanes of a one-block head are
//   summed as integers). It binds only on flat queries: a rotated query of
//   128 values keeps about 12.8 of its 13 bits.
// - values: turbo centroids scale to at most 4095; the weights of a tile
//   (softmax weight times the block's scale) to at most
//   (2^31 - 1) / (kScanTile * largest value), so that a lane summing one
//   product per token of the tile cannot overflow.
// Each is a relative rounding of about 1e-4 (the tests hold outputs to 5e-4
// of the scalar reference on every target).
#if defined(TURBOKV_KERNELS_CPU_INT_SCAN_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TURBOKV_KERNELS_CPU_INT_SCAN_INL_H_
#undef TURBOKV_KERNELS_CPU_INT_SCAN_INL_H_
#else
#define TURBOKV_KERNELS_CPU_INT_SCAN_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/turbo_simd-inl.h"
#include "kernels/half.h"

HWY_BEFORE_NAMESPACE();
namespace turbokv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// A buffer kept per thread across scan tasks (sized by head_dim and rows
// only), zero-filled when it grows: tasks are short, and allocating and
// clearing their buffers each time cost about a tenth of a 256-token task.
template <class T>
struct Scratch {
  hwy::AlignedFreeUniquePtr<T[]> data;
  size_t size = 0;
  T* Get(size_t n) {
    if (n > size) {
      data = hwy::AllocateAligned<T>(n);
      std::fill(data.get(), data.get() + n, T());
      size = n;
    }
    return data.get();
  }
};

// Requests, one token at a time while a tile's keys are scored, the memory
// the scan reads next: the tile's value records (read after its softmax)
// and the next tile's key records, which may lie on another page. A cache
// larger than the CPU's caches was otherwise read at about half the speed
// of one inside them (f16 keys and values, q8_0 keys); the same requests
// issued together at the start of a tile measured no faster than none.
class TilePrefetch {
 public:
  TilePrefetch(const ScanTask& task, int64_t t0, int n) {
    const PagedKvCache& c = *task.cache;
    values_ = c.value_record(task.head, t0);
    value_bytes_ = c.value_layout.code_size();
    key_bytes_ = c.key_layout.code_size();
    if (t0 + n < task.end) next_keys_ = c.key_record(task.head, t0 + n);
  }
  // Token j of the tile (and of the next).
  HWY_INLINE void Token(int j) const {
    for (size_t b = 0; b < value_bytes_; b += 64) __builtin_prefetch(values_ + j * value_bytes_ + b, 0, 3);
    if (next_keys_ == nullptr) return;
    for (size_t b = 0; b < key_bytes_; b += 64) __builtin_prefetch(next_keys_ + j * key_bytes_ + b, 0, 2);
  }

 private:
  const uint8_t* values_ = nullptr;
  const uint8_t* next_keys_ = nullptr;
  size_t value_bytes_ = 0;
  size_t key_bytes_ = 0;
};

#if HWY_TARGET != HWY_SCALAR

// At most 256 bits: the transposed sums below assume 128-bit blocks and at
// most two of them, and AVX-512 gains nothing on a scan this short per token.
using IntD16 = hn::CappedTag<int16_t, 16>;
using IntD32 = hn::Repartition<int32_t, IntD16>;
using IntDU8 = hn::Repartition<uint8_t, IntD16>;
using IntDU16 = hn::Repartition<uint16_t, IntD16>;
using IntDU64 = hn::Repartition<uint64_t, IntD16>;
using IntDF = hn::Repartition<float, IntD16>;
constexpr int kL16 = static_cast<int>(hn::MaxLanes(IntD16()));  // 8 or 16
constexpr int kL32 = kL16 / 2;
constexpr int kL8 = kL16 * 2;
static_assert(kL16 == 8 || kL16 == 16, "the integer scan needs 128- or 256-bit vectors");

constexpr int kKeyIntMax = 8191;     // turbo key centroids
constexpr int kQueryTurboMax = 8191; // the query against turbo keys
constexpr int kQueryByteMax = 32767; // the query against q8_0 / q4_0 keys
constexpr int kValueIntMax = 4095;   // turbo value centroids

inline bool IntCodecApplies(CodecKind kind) { return kind != CodecKind::kF16; }

// How the integer scan reads one tensor (keys or values) of a cache.
struct IntCodec {
  CodecLayout layout;
  int bits = 0;       // turbo bits, 0 for q8_0 / q4_0
  float unit = 1.0f;  // the value of one integer step, before the block's scale
  int max_int = 0;    // largest |decoded integer|
  HWY_ALIGN uint8_t table_lo[16] = {};  // int16 centroids, low and high bytes
  HWY_ALIGN uint8_t table_hi[16] = {};
  // Decoded position -> dimension of the record: turbo blocks come out of the
  // byte shuffles in an order of their own; q8_0 and q4_0 in natural order.
  std::vector<int> order;
  // Position -> dimension of the weighted sums over token pairs (values): a
  // chunk of kL16 positions accumulates into two vectors of kL32, the lower
  // and upper interleaves of a pair.
  std::vector<int> sum_dims;
  // Decodes n consecutive records (record_bytes apart) into out[n][head_dim]
  // integers, decoded order; a value is integer * unit * its block's fp16
  // scale (BlockScales). One call per tile keeps the constants in registers.
  void (*decode)(const IntCodec&, const uint8_t* records, size_t record_bytes, int n, int16_t* out) = nullptr;
  // Turbo and q8_0 values: the tile's records straight into token pairs (see
  // DecodeTurboPairsInt); null for q4_0, whose decoded records are
  // interleaved afterwards.
  void (*decode_pairs)(const IntCodec&, const uint8_t* records, size_t record_bytes, int n, int16_t* out) = nullptr;

  IntCodec(const CodecLayout& l, int int_max);
};

// Shift counts of PlaneField when a plane of kP bytes is shorter than a
// vector: vector v, 8-byte lane u holds the fields of dims v * kL8 + 8 u ...
// at bit kField * ((v * kL8 + 8 u) / kP). Constants in memory: a vector
// built lane by lane on the stack would stall on store forwarding.
template <int kP, int kField>
struct FieldShifts {
  struct Table {
    alignas(32) uint64_t counts[8][4];
  };
  static constexpr Table Make() {
    Table t{};
    for (int v = 0; v < 8; ++v) {
      for (int u = 0; u < 4; ++u) t.counts[v][u] = static_cast<uint64_t>(kField * ((v * kL8 + 8 * u) / kP));
    }
    return t;
  }
  static constexpr Table kTable = Make();
};

// Indices of dims [v * kL8, (v + 1) * kL8) of a plane of kP bytes holding
// kField-bit fields: the field of dim i sits at bit kField * (i / kP) of byte
// i % kP. One index per byte.
template <int kP, int kField>
HWY_INLINE hn::Vec<IntDU8> PlaneField(const uint8_t* plane, int v) {
  const IntDU8 d8;
  const IntDU64 d64;
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1 << kField) - 1));
  if constexpr (kL8 <= kP) {
    const auto bytes = hn::LoadU(d8, plane + (v * kL8) % kP);
    const int shift = kField * (v * kL8 / kP);
    return hn::And(hn::BitCast(d8, hn::ShiftRightSame(hn::BitCast(d64, bytes), shift)), mask);
  } else {
    // The plane repeats across the vector; each 8-byte lane u (dims
    // v * kL8 + 8 u ...) takes its own shift.
    hn::Vec<IntDU8> bytes;
    if constexpr (kP == 16) {
      bytes = hn::LoadDup128(d8, plane);
    } else {
      static_assert(kP == 8, "planes are 8 bytes or more");
      uint64_t word;
      std::memcpy(&word, plane, sizeof(word));
      bytes = hn::BitCast(d8, hn::Set(d64, word));
    }
    const auto counts = hn::Load(d64, FieldShifts<kP, kField>::kTable.counts[v]);
    return hn::And(hn::BitCast(d8, hn::BitCast(d64, bytes) >> counts), mask);
  }
}

// The centroid indices of dims [v * kL8, (v + 1) * kL8) of a turbo block
// whose planes start at `planes`, one per byte.
template <int kB, int kBits>
HWY_INLINE hn::Vec<IntDU8> TurboIndices(const uint8_t* planes, int v) {
  if constexpr (kBits == 4) {
    return PlaneField<kB / 2, 4>(planes, v);
  } else {
    const auto low = PlaneField<kB / 4, 2>(planes, v);
    if constexpr (kBits == 2) return low;
    const IntDU8 d8;
    const IntDU16 du16;
    const auto high = PlaneField<kB / 8, 1>(planes + kB / 4, v);  // 0 or 1 per byte
    return hn::Or(low, hn::BitCast(d8, hn::ShiftLeft<2>(hn::BitCast(du16, high))));
  }
}

// One turbo block of kB values: int16 centroids in decoded order (see
// TurboOrder).
template <int kB, int kBits, class V>
HWY_INLINE void DecodeTurboBlockInt(V lo_table, V hi_table, const uint8_t* block, int16_t* out) {
  const IntDU8 d8;
  const IntD16 d16;
  const uint8_t* planes = block + kTurboScaleBytes;
  for (int v = 0; v < kB / kL8; ++v) {
    const auto index = TurboIndices<kB, kBits>(planes, v);
    const auto lo = hn::TableLookupBytes(lo_table, index);
    const auto hi = hn::TableLookupBytes(hi_table, index);
    hn::Store(hn::BitCast(d16, hn::InterleaveLower(d8, lo, hi)), d16, out + 2 * v * kL16);
    hn::Store(hn::BitCast(d16, hn::InterleaveUpper(d8, lo, hi)), d16, out + (2 * v + 1) * kL16);
  }
}

// Dimension (within its block) of decoded position p of a turbo block:
// vector v of indices covers dims [v * kL8, (v + 1) * kL8); the interleaves
// of low and high bytes take bytes 0-7 (then 8-15) of each 128-bit block.
inline int TurboOrder(int p) {
  const int vec16 = p / kL16, lane = p % kL16;
  return (vec16 / 2) * kL8 + (lane / 8) * 16 + (vec16 % 2) * 8 + lane % 8;
}

template <int kB, int kBits>
void DecodeTurboInt(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, int16_t* out) {
  const IntDU8 d8;
  const auto lo_table = hn::LoadDup128(d8, c.table_lo);
  const auto hi_table = hn::LoadDup128(d8, c.table_hi);
  const int dim = c.layout.head_dim;
  for (int j = 0; j < n; ++j) {
    const uint8_t* record = records + j * record_bytes;
    for (int b = 0; b < c.layout.blocks; ++b) {
      DecodeTurboBlockInt<kB, kBits>(lo_table, hi_table, record + static_cast<size_t>(b) * c.layout.block_bytes,
                                     out + static_cast<size_t>(j) * dim + b * kB);
    }
  }
}

// Calls f(block of a, block of b, out) for every block of every token pair
// (records 2p and 2p + 1; the second is the first again past n, its weight
// being 0) of a tile; out takes the pair's 2 * block_values int16 of that
// block.
template <class F>
HWY_INLINE void ForEachBlockPair(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n,
                                 int16_t* out, F&& f) {
  const int dim = c.layout.head_dim, bv = c.layout.block_values;
  for (int p = 0; 2 * p < n; ++p) {
    const uint8_t* a = records + 2 * p * record_bytes;
    const uint8_t* b = 2 * p + 1 < n ? a + record_bytes : a;
    for (int k = 0; k < c.layout.blocks; ++k) {
      const size_t offset = static_cast<size_t>(k) * c.layout.block_bytes;
      f(a + offset, b + offset, out + static_cast<size_t>(p) * 2 * dim + 2 * k * bv);
    }
  }
}

// Value records as token pairs, the layout the weighted sums read: each
// vector of kL16 int16 holds (a_i, b_i) for kL32 dims i (see TurboPairDims).
// Indices interleaved before the lookups: one shuffle pass serves both
// tokens.
template <int kB, int kBits>
void DecodeTurboPairsInt(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, int16_t* out) {
  const IntDU8 d8;
  const IntD16 d16;
  const auto lo_table = hn::LoadDup128(d8, c.table_lo);
  const auto hi_table = hn::LoadDup128(d8, c.table_hi);
  ForEachBlockPair(c, records, record_bytes, n, out, [&](const uint8_t* a, const uint8_t* b, int16_t* o) {
    const uint8_t* pa = a + kTurboScaleBytes;
    const uint8_t* pb = b + kTurboScaleBytes;
    for (int v = 0; v < kB / kL8; ++v, o += 4 * kL16) {
      const auto ia = TurboIndices<kB, kBits>(pa, v), ib = TurboIndices<kB, kBits>(pb, v);
      const auto x = hn::InterleaveLower(d8, ia, ib), y = hn::InterleaveUpper(d8, ia, ib);
      const auto xl = hn::TableLookupBytes(lo_table, x), xh = hn::TableLookupBytes(hi_table, x);
      const auto yl = hn::TableLookupBytes(lo_table, y), yh = hn::TableLookupBytes(hi_table, y);
      hn::Store(hn::BitCast(d16, hn::InterleaveLower(d8, xl, xh)), d16, o);
      hn::Store(hn::BitCast(d16, hn::InterleaveUpper(d8, xl, xh)), d16, o + kL16);
      hn::Store(hn::BitCast(d16, hn::InterleaveLower(d8, yl, yh)), d16, o + 2 * kL16);
      hn::Store(hn::BitCast(d16, hn::InterleaveUpper(d8, yl, yh)), d16, o + 3 * kL16);
    }
  });
}

// Dimension (within its block) of int32 lane pos of DecodeTurboPairsInt's
// output: vector t of a block covers dims of index vector t / 4; its part
// t % 4 takes, of each 128-bit block of 16 indices, 4 consecutive ones.
inline int TurboPairDims(int pos) {
  const int t = pos / kL32, i = pos % kL32;
  return (t / 4) * kL8 + (i / 4) * 16 + (t % 4) * 4 + i % 4;
}

void DecodeQ8Int(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, int16_t* out) {
  const IntD16 d16;
  const hn::Rebind<int8_t, IntD16> d8;
  for (int j = 0; j < n; ++j) {
    for (int b = 0; b < c.layout.blocks; ++b) {
      const uint8_t* block = records + j * record_bytes + static_cast<size_t>(b) * kQ8BlockBytes;
      const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
      int16_t* o = out + static_cast<size_t>(j) * c.layout.head_dim + b * kGgmlBlockValues;
      for (int i = 0; i < kGgmlBlockValues; i += kL16) hn::Store(hn::PromoteTo(d16, hn::LoadU(d8, q + i)), d16, o + i);
    }
  }
}

// q8_0 values as token pairs (see DecodeTurboPairsInt): the bytes of the two
// records interleaved, then widened; each vector of kL16 int16 holds
// (a_i, b_i) for kL32 consecutive dims, in natural order.
void DecodeQ8PairsInt(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, int16_t* out) {
  const IntD16 d16;
  const hn::Rebind<int8_t, IntD16> d8;
  ForEachBlockPair(c, records, record_bytes, n, out, [&](const uint8_t* a, const uint8_t* b, int16_t* o) {
    const auto* qa = reinterpret_cast<const int8_t*>(a + 2);
    const auto* qb = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < kGgmlBlockValues; i += kL16, o += 2 * kL16) {
      const auto x = hn::LoadU(d8, qa + i), y = hn::LoadU(d8, qb + i);
      hn::Store(hn::PromoteTo(d16, hn::InterleaveLower(d8, x, y)), d16, o);
      hn::Store(hn::PromoteTo(d16, hn::InterleaveUpper(d8, x, y)), d16, o + kL16);
    }
  });
}

void DecodeQ4Int(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, int16_t* out) {
  const IntD16 d16;
  const hn::RebindToUnsigned<IntD16> du16;
  const hn::Rebind<uint8_t, IntD16> d8;
  const auto mask = hn::Set(d8, 15);
  const auto eight = hn::Set(d16, 8);
  for (int j = 0; j < n; ++j) {
    for (int b = 0; b < c.layout.blocks; ++b) {
      const uint8_t* block = records + j * record_bytes + static_cast<size_t>(b) * kQ4BlockBytes;
      int16_t* o = out + static_cast<size_t>(j) * c.layout.head_dim + b * kGgmlBlockValues;
      for (int i = 0; i < kGgmlBlockValues / 2; i += kL16) {  // byte j: value j (low), j + 16 (high)
        const auto bytes = hn::LoadU(d8, block + 2 + i);
        hn::Store(hn::Sub(hn::BitCast(d16, hn::PromoteTo(du16, hn::And(bytes, mask))), eight), d16, o + i);
        hn::Store(hn::Sub(hn::BitCast(d16, hn::PromoteTo(du16, hn::ShiftRight<4>(bytes))), eight), d16,
                  o + kGgmlBlockValues / 2 + i);
      }
    }
  }
}

IntCodec::IntCodec(const CodecLayout& l, int int_max) : layout(l), bits(TurboBits(l.kind)) {
  order.resize(layout.head_dim);
  if (bits != 0) {
    const float* centroids = LayoutCentroids(layout);
    float largest = 0.0f;
    for (int i = 0; i < (1 << bits); ++i) largest = std::max(largest, std::fabs(centroids[i]));
    const float scale = static_cast<float>(int_max) / largest;
    for (int i = 0; i < (1 << bits); ++i) {
      const int v = static_cast<int>(std::lrint(centroids[i] * scale));
      max_int = std::max(max_int, std::abs(v));
      const uint16_t u = static_cast<uint16_t>(static_cast<int16_t>(v));
      table_lo[i] = static_cast<uint8_t>(u & 0xff);
      table_hi[i] = static_cast<uint8_t>(u >> 8);
    }
    unit = 1.0f / (scale * static_cast<float>(layout.block_values));  // s / B per step
    for (int p = 0; p < layout.head_dim; ++p) {
      order[p] = p / layout.block_values * layout.block_values + TurboOrder(p % layout.block_values);
    }
    DispatchTurbo(layout.block_values, bits, [&](auto bv, auto kbits) {
      decode = &DecodeTurboInt<bv.value, kbits.value>;
      decode_pairs = &DecodeTurboPairsInt<bv.value, kbits.value>;
    });
    sum_dims.resize(layout.head_dim);
    for (int pos = 0; pos < layout.head_dim; ++pos) {
      sum_dims[pos] = pos / layout.block_values * layout.block_values + TurboPairDims(pos % layout.block_values);
    }
    return;
  }
  for (int p = 0; p < layout.head_dim; ++p) order[p] = p;
  sum_dims.resize(layout.head_dim);
  if (layout.kind == CodecKind::kQ8_0) {
    max_int = 127;
    decode = &DecodeQ8Int;
    decode_pairs = &DecodeQ8PairsInt;
    for (int pos = 0; pos < layout.head_dim; ++pos) sum_dims[pos] = pos;
    return;
  }
  max_int = 8;
  decode = &DecodeQ4Int;
  for (int pos = 0; pos < layout.head_dim; ++pos) {  // lanes 0-3, then 4-7, of each 8-position block
    const int chunk = pos / kL16, lane = pos % kL16;
    const int upper = lane / kL32, i = lane % kL32;
    sum_dims[pos] = chunk * kL16 + (i / 4) * 8 + upper * 4 + i % 4;
  }
}

// One IntCodec per layout and integer range, built on first use and kept:
// scan tasks are short, and the tables and orders depend on the layout only.
const IntCodec& CachedIntCodec(const CodecLayout& layout, int int_max) {
  static std::mutex mu;
  static auto* cache = new std::map<std::tuple<int, int, int>, std::unique_ptr<IntCodec>>();
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<IntCodec>& codec = (*cache)[{static_cast<int>(layout.kind), layout.head_dim, int_max}];
  if (!codec) codec = std::make_unique<IntCodec>(layout, int_max);
  return *codec;
}

// The fp16 scales of block b of the tile's n records into
// out[b * kScanTile + j] (F16C or native conversions); slots from n up to
// the next whole vector get 0.
void BlockScales(const IntCodec& c, const uint8_t* records, size_t record_bytes, int n, float* out) {
  const IntDF df;
  const hn::Rebind<hwy::float16_t, IntDF> dh;
  HWY_ALIGN uint16_t bits[kScanTile];
  const int padded = (n + kL32 - 1) / kL32 * kL32;
  for (int b = 0; b < c.layout.blocks; ++b) {
    const uint8_t* first = records + static_cast<size_t>(b) * c.layout.block_bytes;
    for (int j = 0; j < n; ++j) bits[j] = LoadHalfBits(first + j * record_bytes);
    for (int j = n; j < padded; ++j) bits[j] = 0;
    for (int j = 0; j < padded; j += kL32) {
      hn::StoreU(hn::PromoteTo(df, hn::Load(dh, reinterpret_cast<const hwy::float16_t*>(bits + j))), df,
                 out + b * kScanTile + j);
    }
  }
}

// Lane t of the result: the sum of the kL32 lanes at p[t * kL32 ...] (float
// or int32). Two rounds of interleaves inside 128-bit blocks, then (256-bit)
// one fold of the blocks.
template <class D>
HWY_INLINE hn::Vec<D> SumsOfRows(D d, const hn::TFromD<D>* HWY_RESTRICT p) {
  const hn::Repartition<uint64_t, D> d64;  // only moves 64-bit halves
  auto quad = [&](const hn::TFromD<D>* q) {
    const auto a = hn::Load(d, q), b = hn::Load(d, q + kL32), c = hn::Load(d, q + 2 * kL32),
               e = hn::Load(d, q + 3 * kL32);
    const auto ab = hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b));
    const auto ce = hn::Add(hn::InterleaveLower(d, c, e), hn::InterleaveUpper(d, c, e));
    const auto lo = hn::BitCast(d, hn::InterleaveLower(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce)));
    const auto hi = hn::BitCast(d, hn::InterleaveUpper(d64, hn::BitCast(d64, ab), hn::BitCast(d64, ce)));
    return hn::Add(lo, hi);  // block k: partial sums of a, b, c, e over block k
  };
  if constexpr (kL32 == 4) {
    return quad(p);
  } else {
    const auto u = quad(p), w = quad(p + 4 * kL32);
    return hn::Add(hn::ConcatLowerLower(d, w, u), hn::ConcatUpperUpper(d, w, u));
  }
}

// Per scan task: both tensors' decoders, the quantized query, and buffers
// (this thread's).
struct IntScan {
  IntScan(const ScanTask& task, bool int_keys, bool int_values);

  int dim = 0;
  int rows = 0;
  const IntCodec* key = nullptr;  // null: that side runs the float scan
  const IntCodec* value = nullptr;
  int16_t* q = nullptr;             // [rows][dim], key decoded order
  float* q_unit = nullptr;          // [rows][key blocks]
  int16_t* keys = nullptr;          // [kScanTile][dim]
  float* key_scales = nullptr;      // [key blocks][kScanTile]
  float* partial = nullptr;         // [4][kScanTile][kL32]
  int32_t* partial_int = nullptr;   // the same, keys of one block
  int16_t* decoded = nullptr;       // [kScanTile][dim]: the tile's values
  int16_t* pairs = nullptr;         // [kScanTile / 2][dim * 2], interleaved
  float* value_scales = nullptr;    // [value blocks][kScanTile]
  int16_t* weights = nullptr;       // [4][kScanTile]
  int weight_max = 0;
};

struct IntWorkspace {
  Scratch<int16_t> q, rounded, keys, decoded, pairs, weights;
  Scratch<float> q_unit, key_scales, partial, value_scales;
  Scratch<int32_t> partial_int;
};

IntScan::IntScan(const ScanTask& task, bool int_keys, bool int_values) {
  thread_local IntWorkspace w;
  const PagedKvCache& c = *task.cache;
  dim = c.key_layout.head_dim;
  rows = task.rows;
  if (int_keys) {
    key = &CachedIntCodec(c.key_layout, kKeyIntMax);
    const int blocks = key->layout.blocks, bv = key->layout.block_values;
    const float q_max = key->bits != 0 ? kQueryTurboMax : kQueryByteMax;
    q = w.q.Get(static_cast<size_t>(rows) * dim);
    q_unit = w.q_unit.Get(static_cast<size_t>(rows) * blocks);
    int16_t* rounded = w.rounded.Get(bv);
    const IntDF df;
    const hn::Rebind<int16_t, IntDF> d16half;
    const size_t nf = hn::Lanes(df);  // bv (32, 64 or 128) is a multiple
    for (int r = 0; r < rows; ++r) {
      const float* src = task.q + static_cast<size_t>(r) * dim;
      for (int b = 0; b < blocks; ++b) {
        const float* block = src + b * bv;
        auto largest_lanes = hn::Zero(df);
        double l1 = 0.0;  // in order, in double: the same bits as the scalar loop it replaced
        for (size_t i = 0; i < static_cast<size_t>(bv); i += nf) {
          largest_lanes = hn::Max(largest_lanes, hn::Abs(hn::LoadU(df, block + i)));
        }
        for (int i = 0; i < bv; ++i) l1 += std::fabs(block[i]);
        const float largest = hn::GetLane(hn::MaxOfLanes(df, largest_lanes));
        // Also sum |q| <= (2^31 - 1) / max_int, so that no sum of the block's
        // products, over any lanes, can overflow.
        const float to_int =
            largest > 0.0f ? std::min(q_max / largest, static_cast<float>(2147483647.0 / key->max_int / l1)) : 0.0f;
        const auto scale = hn::Set(df, to_int);
        for (size_t i = 0; i < static_cast<size_t>(bv); i += nf) {
          hn::StoreU(hn::DemoteTo(d16half, hn::NearestInt(hn::Mul(hn::LoadU(df, block + i), scale))), d16half,
                     rounded + i);
        }
        int16_t* dst = q + static_cast<size_t>(r) * dim + b * bv;
        const int* order = key->order.data() + b * bv;
        for (int p = 0; p < bv; ++p) dst[p] = rounded[order[p] - b * bv];
        q_unit[static_cast<size_t>(r) * blocks + b] = largest > 0.0f ? key->unit / to_int : 0.0f;
      }
    }
    keys = w.keys.Get(static_cast<size_t>(kScanTile) * dim);
    key_scales = w.key_scales.Get(static_cast<size_t>(kScanTile) * blocks);
    partial = w.partial.Get(4 * kScanTile * kL32);
    partial_int = w.partial_int.Get(4 * kScanTile * kL32);
  }
  if (int_values) {
    value = &CachedIntCodec(c.value_layout, kValueIntMax);
    // q4_0 only; odd tiles leave the last pair's second row stale, with weight 0.
    if (value->decode_pairs == nullptr) decoded = w.decoded.Get(static_cast<size_t>(kScanTile) * dim);
    pairs = w.pairs.Get(static_cast<size_t>(kScanTile) * dim);
    value_scales = w.value_scales.Get(static_cast<size_t>(value->layout.blocks) * kScanTile);
    weights = w.weights.Get(4 * kScanTile);
    weight_max = std::min(32767, static_cast<int>(2147483647LL / (int64_t{kScanTile} * value->max_int)));
  }
}

// MultiplyAddPeak's loop on the scan's ReorderWidenMulAccumulate: `steps` of
// it over registers, in chains whose operands are their last results (nothing
// can be hoisted). Returns a checksum.
HWY_NOINLINE int64_t IntScanMultiplyAdds(int64_t steps) {
  const IntD16 d16;
  const IntD32 d32;
  // Chains enough to cover the step's latency at its rate: 8 where 16
  // registers must hold them, 12 on AVX-512's 32.
  constexpr int kChains = HWY_TARGET <= HWY_AVX3 ? 12 : 8;
  hn::Vec<IntD32> acc[kChains], other[kChains];
  for (int c = 0; c < kChains; ++c) {
    acc[c] = hn::Set(d32, c + 1);
    other[c] = hn::Zero(d32);
  }
  const auto three = hn::Set(d16, 3);
  for (int64_t i = 0; i < steps; i += kChains) {
    for (int c = 0; c < kChains; ++c) {
      acc[c] = hn::ReorderWidenMulAccumulate(d32, hn::BitCast(d16, acc[c]), three, acc[c], other[c]);
    }
  }
  for (int c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], hn::Add(acc[c], other[c]));
  return hn::GetLane(hn::SumOfLanes(d32, hn::Add(acc[0], other[0])));
}

// <k, q> of one key block of kVectors vectors (key(i) gives vector i, from
// registers or memory) and one query row, as int32 lanes still to be summed.
template <int kVectors, class Key>
HWY_INLINE hn::Vec<IntD32> DotLanes(const Key& key, const int16_t* q) {
  const IntD16 d16;
  const IntD32 d32;
  auto sum0 = hn::Zero(d32), sum1 = hn::Zero(d32);
  HWY_UNROLL(16)
  for (int i = 0; i < kVectors; ++i) {
    sum0 = hn::ReorderWidenMulAccumulate(d32, key(i), hn::Load(d16, q + i * kL16), sum0, sum1);
  }
  return hn::Add(sum0, sum1);
}

// Raw scores of the tile's n decoded keys against rows r0 .. r0 + kRows into
// partial[r][j]: one vector per row and token, summed across lanes later.
// Key blocks of kBv values.
template <int kRows, int kBv>
HWY_NOINLINE void ScoreGroupInt(const IntScan& s, int r0, int n) {
  const IntD16 d16;
  const IntDF df;
  const int blocks = s.key->layout.blocks, dim = s.dim;
  const int16_t* q[kRows];
  const float* q_unit[kRows];
  float* partial[kRows];
  for (int r = 0; r < kRows; ++r) {
    q[r] = s.q + static_cast<size_t>(r0 + r) * dim;
    q_unit[r] = s.q_unit + static_cast<size_t>(r0 + r) * blocks;
    partial[r] = s.partial + r * kScanTile * kL32;
  }
  const int16_t* k = s.keys;
  for (int j = 0; j < n; ++j, k += dim) {
    hn::Vec<IntDF> f[kRows];
    for (int r = 0; r < kRows; ++r) f[r] = hn::Zero(df);
    for (int b = 0; b < blocks; ++b) {
      const int base = b * kBv;
      const float key_scale = s.key_scales[static_cast<size_t>(b) * kScanTile + j];
      // Row by row, the key's vectors reloaded from L1: interleaving the rows
      // over shared key registers makes GCC compute every product first and
      // spill them.
      const auto key = [&](int i) { return hn::Load(d16, k + base + i * kL16); };
      for (int r = 0; r < kRows; ++r) {
        const auto dot = DotLanes<kBv / kL16>(key, q[r] + base);
        f[r] = hn::MulAdd(hn::ConvertTo(df, dot), hn::Set(df, key_scale * q_unit[r][b]), f[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) hn::Store(f[r], df, partial[r] + j * kL32);
  }
}

// Records of one block (turbo, head_dim = B): integer sums into
// partial_int[r][j]; the scales apply after the sums across lanes.
template <int kRows, int kBv>
HWY_NOINLINE void ScoreOneBlockInt(const IntScan& s, int r0, int n) {
  const IntD16 d16;
  const IntD32 d32;
  const int16_t* q[kRows];
  int32_t* partial[kRows];
  for (int r = 0; r < kRows; ++r) {
    q[r] = s.q + static_cast<size_t>(r0 + r) * kBv;
    partial[r] = s.partial_int + r * kScanTile * kL32;
  }
  const int16_t* k = s.keys;
  for (int j = 0; j < n; ++j, k += kBv) {
    const auto key = [&](int i) { return hn::Load(d16, k + i * kL16); };
    for (int r = 0; r < kRows; ++r) hn::Store(DotLanes<kBv / kL16>(key, q[r]), d32, partial[r] + j * kL32);
  }
}

// Turbo keys of one block and at most four rows (one decode step's GQA
// group): each key decoded into registers and scored at once, integer sums
// into partial_int[r][j] as ScoreOneBlockInt's.
template <int kRows, int kB, int kBits>
HWY_NOINLINE void ScoreTurboDecoded(const IntScan& s, const uint8_t* records, size_t record_bytes, int n,
                                    const TilePrefetch& prefetch) {
  const IntDU8 d8;
  const IntD16 d16;
  const IntD32 d32;
  const auto lo_table = hn::LoadDup128(d8, s.key->table_lo);
  const auto hi_table = hn::LoadDup128(d8, s.key->table_hi);
  const int16_t* q[kRows];
  int32_t* partial[kRows];
  for (int r = 0; r < kRows; ++r) {
    q[r] = s.q + static_cast<size_t>(r) * kB;
    partial[r] = s.partial_int + r * kScanTile * kL32;
  }
  for (int j = 0; j < n; ++j) {
    prefetch.Token(j);
    const uint8_t* planes = records + j * record_bytes + kTurboScaleBytes;
    hn::Vec<IntD16> k[kB / kL16];
    for (int v = 0; v < kB / kL8; ++v) {
      const auto index = TurboIndices<kB, kBits>(planes, v);
      const auto lo = hn::TableLookupBytes(lo_table, index);
      const auto hi = hn::TableLookupBytes(hi_table, index);
      k[2 * v] = hn::BitCast(d16, hn::InterleaveLower(d8, lo, hi));
      k[2 * v + 1] = hn::BitCast(d16, hn::InterleaveUpper(d8, lo, hi));
    }
    const auto key = [&](int i) { return k[i]; };
    for (int r = 0; r < kRows; ++r) hn::Store(DotLanes<kB / kL16>(key, q[r]), d32, partial[r] + j * kL32);
  }
}

// q8_0 keys and at most four rows: each block's bytes widened into
// registers and dotted at once, the block's sums scaled into one float
// vector per row and token (partial[r][j], summed across lanes later).
template <int kRows>
HWY_NOINLINE void ScoreQ8Decoded(const IntScan& s, const uint8_t* records, size_t record_bytes, int n,
                                 const TilePrefetch& prefetch) {
  const IntD16 d16;
  const IntDF df;
  const hn::Rebind<int8_t, IntD16> d8;
  constexpr int kVectors = kGgmlBlockValues / kL16;
  const int blocks = s.key->layout.blocks, dim = s.dim;
  for (int j = 0; j < n; ++j) {
    prefetch.Token(j);
    const uint8_t* record = records + j * record_bytes;
    hn::Vec<IntDF> f[kRows];
    for (int r = 0; r < kRows; ++r) f[r] = hn::Zero(df);
    for (int b = 0; b < blocks; ++b) {
      const int8_t* bytes = reinterpret_cast<const int8_t*>(record + static_cast<size_t>(b) * kQ8BlockBytes + 2);
      hn::Vec<IntD16> k[kVectors];
      for (int i = 0; i < kVectors; ++i) k[i] = hn::PromoteTo(d16, hn::LoadU(d8, bytes + i * kL16));
      const float key_scale = s.key_scales[static_cast<size_t>(b) * kScanTile + j];
      const auto key = [&](int i) { return k[i]; };
      for (int r = 0; r < kRows; ++r) {
        const auto dot = DotLanes<kVectors>(key, s.q + static_cast<size_t>(r) * dim + b * kGgmlBlockValues);
        f[r] = hn::MulAdd(hn::ConvertTo(df, dot), hn::Set(df, key_scale * s.q_unit[static_cast<size_t>(r) * blocks + b]),
                          f[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) hn::Store(f[r], df, s.partial + (r * kScanTile + j) * kL32);
  }
}

template <int kBv>
void ScoreRowsInt(const IntScan& s, int r0, int rows, int n) {
  if (s.key->layout.blocks == 1) {
    switch (rows) {
      case 4: return ScoreOneBlockInt<4, kBv>(s, r0, n);
      case 3: return ScoreOneBlockInt<3, kBv>(s, r0, n);
      case 2: return ScoreOneBlockInt<2, kBv>(s, r0, n);
      default: return ScoreOneBlockInt<1, kBv>(s, r0, n);
    }
  }
  switch (rows) {
    case 4: return ScoreGroupInt<4, kBv>(s, r0, n);
    case 3: return ScoreGroupInt<3, kBv>(s, r0, n);
    case 2: return ScoreGroupInt<2, kBv>(s, r0, n);
    default: return ScoreGroupInt<1, kBv>(s, r0, n);
  }
}

// Raw scores <q_r, k_t> of the tile's n tokens into logits[r * kScanTile + j]
// (slots past n hold anything: the softmax masks them).
void ScoreTileInt(const ScanTask& task, IntScan& s, int64_t t0, int n, float* logits) {
  const PagedKvCache& c = *task.cache;
  const uint8_t* records = c.key_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.key_layout.code_size();
  BlockScales(*s.key, records, record_bytes, n, s.key_scales);
  const bool q8_in_registers = s.key->layout.kind == CodecKind::kQ8_0 && task.rows <= 4;
  const bool in_registers = (s.key->bits != 0 && s.key->layout.blocks == 1 && task.rows <= 4) || q8_in_registers;
  const TilePrefetch prefetch(task, t0, n);
  if (q8_in_registers) {
    switch (task.rows) {
      case 4: ScoreQ8Decoded<4>(s, records, record_bytes, n, prefetch); break;
      case 3: ScoreQ8Decoded<3>(s, records, record_bytes, n, prefetch); break;
      case 2: ScoreQ8Decoded<2>(s, records, record_bytes, n, prefetch); break;
      default: ScoreQ8Decoded<1>(s, records, record_bytes, n, prefetch); break;
    }
  } else if (in_registers) {
    DispatchTurbo(s.key->layout.block_values, s.key->bits, [&](auto bv, auto bits) {
      switch (task.rows) {
        case 4: return ScoreTurboDecoded<4, bv.value, bits.value>(s, records, record_bytes, n, prefetch);
        case 3: return ScoreTurboDecoded<3, bv.value, bits.value>(s, records, record_bytes, n, prefetch);
        case 2: return ScoreTurboDecoded<2, bv.value, bits.value>(s, records, record_bytes, n, prefetch);
        default: return ScoreTurboDecoded<1, bv.value, bits.value>(s, records, record_bytes, n, prefetch);
      }
    });
  } else {
    s.key->decode(*s.key, records, record_bytes, n, s.keys);
  }
  const IntDF df;
  for (int r0 = 0; r0 < task.rows; r0 += 4) {
    const int group = std::min(4, task.rows - r0);
    if (!in_registers) {
      switch (s.key->layout.block_values) {
        case 128: ScoreRowsInt<128>(s, r0, group, n); break;
        case 64: ScoreRowsInt<64>(s, r0, group, n); break;
        default: ScoreRowsInt<kGgmlBlockValues>(s, r0, group, n); break;
      }
    }
    for (int r = 0; r < group; ++r) {
      float* out = logits + (r0 + r) * kScanTile;
      if (s.key->layout.blocks == 1) {
        const IntD32 d32;
        const auto unit = hn::Set(df, s.q_unit[r0 + r]);
        for (int j = 0; j < n; j += kL32) {
          const auto sums = hn::ConvertTo(df, SumsOfRows(d32, s.partial_int + (r * kScanTile + j) * kL32));
          hn::Store(hn::Mul(hn::Mul(sums, unit), hn::LoadU(df, s.key_scales + j)), df, out + j);
        }
      } else {
        for (int j = 0; j < n; j += kL32) {
          hn::Store(SumsOfRows(df, s.partial + (r * kScanTile + j) * kL32), df, out + j);
        }
      }
    }
  }
}

// acc_r += sum over the tile's token pairs of (w_2p, w_2p+1) . (v_2p, v_2p+1)
// for the decoded positions [begin, end) of one value block, kRows rows.
template <int kRows>
HWY_INLINE void AccumulateRowsInt(const IntScan& s, int pair_count, int begin, int end,
                                  const float* unit, float* acc) {
  const IntD16 d16;
  const IntD32 d32;
  const IntDF df;
  const int32_t* w = reinterpret_cast<const int32_t*>(s.weights);  // [4][kScanTile / 2] pairs
  for (int chunk = begin; chunk < end; chunk += kL16) {
    hn::Vec<IntD32> lo0[kRows], lo1[kRows], hi0[kRows], hi1[kRows];
    for (int r = 0; r < kRows; ++r) lo0[r] = lo1[r] = hi0[r] = hi1[r] = hn::Zero(d32);
    HWY_UNROLL(2)
    for (int p = 0; p < pair_count; ++p) {
      const int16_t* pair = s.pairs + (static_cast<size_t>(p) * s.dim + chunk) * 2;
      const auto lo = hn::Load(d16, pair), hi = hn::Load(d16, pair + kL16);
      for (int r = 0; r < kRows; ++r) {
        const auto weight = hn::BitCast(d16, hn::Set(d32, w[r * (kScanTile / 2) + p]));
        lo0[r] = hn::ReorderWidenMulAccumulate(d32, lo, weight, lo0[r], lo1[r]);
        hi0[r] = hn::ReorderWidenMulAccumulate(d32, hi, weight, hi0[r], hi1[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const auto u = hn::Set(df, unit[r]);
      float* out = acc + static_cast<size_t>(r) * s.dim + chunk;
      hn::StoreU(hn::MulAdd(hn::ConvertTo(df, hn::RearrangeToOddPlusEven(lo0[r], lo1[r])), u, hn::LoadU(df, out)),
                 df, out);
      hn::StoreU(hn::MulAdd(hn::ConvertTo(df, hn::RearrangeToOddPlusEven(hi0[r], hi1[r])), u,
                            hn::LoadU(df, out + kL32)),
                 df, out + kL32);
    }
  }
}

// acc_r += sum_j weights[r * kScanTile + j] * v_j, accumulators in the
// positions of sum_dims (UnpermuteValues puts them back).
void AccumulateTileInt(const ScanTask& task, IntScan& s, int64_t t0, int n, const float* weights,
                       ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const IntCodec& v = *s.value;
  const uint8_t* records = c.value_record(task.head, t0);  // a tile lies in one page
  const size_t record_bytes = c.value_layout.code_size();
  const int blocks = v.layout.blocks, bv = v.layout.block_values;
  const int pair_count = (n + 1) / 2;
  const IntD16 d16;
  // n odd: the last pair's second token has scale 0 (BlockScales).
  if (v.decode_pairs != nullptr) {
    v.decode_pairs(v, records, record_bytes, n, s.pairs);
  } else {
    v.decode(v, records, record_bytes, n, s.decoded);
  }
  for (int p = 0; p < pair_count && v.decode_pairs == nullptr; ++p) {
    const int16_t* a = s.decoded + static_cast<size_t>(2 * p) * s.dim;
    const int16_t* b = a + s.dim;
    int16_t* out = s.pairs + static_cast<size_t>(p) * s.dim * 2;
    for (int i = 0; i < s.dim; i += kL16) {
      const auto x = hn::Load(d16, a + i), y = hn::Load(d16, b + i);
      hn::Store(hn::InterleaveLower(d16, x, y), d16, out + 2 * i);
      hn::Store(hn::InterleaveUpper(d16, x, y), d16, out + 2 * i + kL16);
    }
  }
  BlockScales(v, records, record_bytes, n, s.value_scales);
  const IntDF df;
  const hn::Rebind<int16_t, IntDF> d16half;
  for (int k = 0; k < blocks; ++k) {
    const float* scale = s.value_scales + static_cast<size_t>(k) * kScanTile;
    for (int r0 = 0; r0 < task.rows; r0 += 4) {
      const int group = std::min(4, task.rows - r0);
      float unit[4] = {};
      for (int r = 0; r < group; ++r) {
        // Weight times block scale, as int16 against the tile's largest.
        const float* w = weights + (r0 + r) * kScanTile;
        auto largest = hn::Zero(df);
        for (int j = 0; j < 2 * pair_count; j += kL32) {
          largest = hn::Max(largest, hn::Abs(hn::Mul(hn::Load(df, w + j), hn::LoadU(df, scale + j))));
        }
        const float m = hn::GetLane(hn::MaxOfLanes(df, largest));
        const auto to_int = hn::Set(df, m > 0.0f ? static_cast<float>(s.weight_max) / m : 0.0f);
        int16_t* dst = s.weights + r * kScanTile;
        for (int j = 0; j < 2 * pair_count; j += kL32) {
          const auto x = hn::Mul(hn::Mul(hn::Load(df, w + j), hn::LoadU(df, scale + j)), to_int);
          hn::StoreU(hn::DemoteTo(d16half, hn::NearestInt(x)), d16half, dst + j);
        }
        // int16 pairs as int32 words: the weights array is read as [4][kScanTile / 2] int32.
        unit[r] = m / static_cast<float>(s.weight_max) * v.unit;
      }
      float* acc = state->acc.data() + static_cast<size_t>(r0) * s.dim;
      switch (group) {
        case 4: AccumulateRowsInt<4>(s, pair_count, k * bv, (k + 1) * bv, unit, acc); break;
        case 3: AccumulateRowsInt<3>(s, pair_count, k * bv, (k + 1) * bv, unit, acc); break;
        case 2: AccumulateRowsInt<2>(s, pair_count, k * bv, (k + 1) * bv, unit, acc); break;
        default: AccumulateRowsInt<1>(s, pair_count, k * bv, (k + 1) * bv, unit, acc); break;
      }
    }
  }
}

// The accumulators back in dimension order, at the end of a scan.
void UnpermuteValues(const IntScan& s, ScanState* state) {
  std::vector<float> row(s.dim);
  for (int r = 0; r < s.rows; ++r) {
    float* acc = state->acc.data() + static_cast<size_t>(r) * s.dim;
    for (int pos = 0; pos < s.dim; ++pos) row[s.value->sum_dims[pos]] = acc[pos];
    std::copy(row.begin(), row.end(), acc);
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace turbokv
HWY_AFTER_NAMESPACE();

#endif  // TURBOKV_KERNELS_CPU_INT_SCAN_INL_H_
