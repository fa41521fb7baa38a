// Per-target SIMD building blocks of the turbo codecs, shared by the codec and
// the attention kernels (Highway's -inl.h pattern: included once per target).
#if defined(TURBOKV_KERNELS_CPU_TURBO_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TURBOKV_KERNELS_CPU_TURBO_SIMD_INL_H_
#undef TURBOKV_KERNELS_CPU_TURBO_SIMD_INL_H_
#else
#define TURBOKV_KERNELS_CPU_TURBO_SIMD_INL_H_
#endif

#include <type_traits>

#include "hwy/highway.h"
#include "kernels/block_math.h"

HWY_BEFORE_NAMESPACE();
namespace turbokv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <int kValue>
using IntConstant = std::integral_constant<int, kValue>;

// Calls f(IntConstant<B>(), IntConstant<bits>()) for a rotation block size
// (64 or 128) and bit width (2, 3 or 4): where the SIMD code turns a layout
// into template arguments.
template <class F>
void DispatchTurbo(int block_values, int bits, F&& f) {
  if (block_values == 128) {
    if (bits == 2) return f(IntConstant<128>(), IntConstant<2>());
    if (bits == 3) return f(IntConstant<128>(), IntConstant<3>());
    return f(IntConstant<128>(), IntConstant<4>());
  }
  if (bits == 2) return f(IntConstant<64>(), IntConstant<2>());
  if (bits == 3) return f(IntConstant<64>(), IntConstant<3>());
  return f(IntConstant<64>(), IntConstant<4>());
}

// At most B/8 float lanes: then every index plane (strides B/8, B/4, B/2) is a
// whole number of vectors and packing needs no shuffles.
template <int kB>
using BlockTag = hn::CappedTag<float, kB / 8>;

// In-place H*x over one block held in `z` (aligned), the butterflies of
// FastWalshHadamard: stages with h >= lanes pair whole vectors, smaller stages
// pair lanes i and i ^ h inside a vector.
template <int kB>
HWY_INLINE void Fwht(float* HWY_RESTRICT z) {
  const BlockTag<kB> d;
  const hn::RebindToSigned<decltype(d)> di;
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int h = 1; h < lanes; h *= 2) {
    HWY_ALIGN int32_t partner[16];
    for (int i = 0; i < lanes; ++i) partner[i] = i ^ h;
    const auto indices = hn::IndicesFromVec(d, hn::Load(di, partner));
    const auto upper = hn::RebindMask(
        d, hn::Ne(hn::And(hn::Iota(di, 0), hn::Set(di, h)), hn::Zero(di)));
    for (int j = 0; j < kB; j += lanes) {
      const auto v = hn::Load(d, z + j);
      const auto other = hn::TableLookupLanes(v, indices);
      hn::Store(hn::IfThenElse(upper, hn::Sub(other, v), hn::Add(v, other)), d, z + j);
    }
  }
  for (int h = lanes; h < kB; h *= 2) {
    for (int i = 0; i < kB; i += 2 * h) {
      for (int j = i; j < i + h; j += lanes) {
        const auto a = hn::Load(d, z + j);
        const auto b = hn::Load(d, z + j + h);
        hn::Store(hn::Add(a, b), d, z + j);
        hn::Store(hn::Sub(a, b), d, z + j + h);
      }
    }
  }
}

// Sum of a block-long product in the fixed order of SumPartials16: lane l of
// accumulator a holds partial sum a * lanes + l.
template <class D, class V>
HWY_INLINE float FinishSum(D d, const V* acc) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  HWY_ALIGN float partial[kSumLanes];
  for (int a = 0; a < kSumLanes / lanes; ++a) hn::Store(acc[a], d, partial + a * lanes);
  return SumPartials16(partial);
}

// Centroids of an index vector: a lane permute when the table fits in one
// vector, a gather otherwise.
template <class D, class VI>
HWY_INLINE hn::Vec<D> Centroids(D d, const float* table, int levels, VI index) {
  if (levels <= static_cast<int>(hn::Lanes(d))) {
    return hn::TableLookupLanes(hn::LoadU(d, table), hn::IndicesFromVec(d, index));
  }
  return hn::GatherIndex(d, table, index);
}

// fp16 values to float, whole vectors on every SIMD target: F16C where the
// target has it, Highway's integer conversion elsewhere (SSE4, where the
// scalar one made AttendFewCpu slower than the scan). Exact for finite
// values, which is all a cache stores (inf and NaN halves may come out
// finite where there is no F16C).
HWY_INLINE void DecodeF16Values(size_t count, const uint8_t* HWY_RESTRICT codes,
                                float* HWY_RESTRICT x) {
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  const size_t lanes = hn::Lanes(d);
  const auto* in = reinterpret_cast<const hwy::float16_t*>(codes);
  for (; i + lanes <= count; i += lanes) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, in + i)), d, x + i);
#endif
  for (; i < count; ++i) x[i] = HalfBitsToFloat(LoadHalfBits(codes + 2 * i));
}

// One stored block in the rotated domain: w = (s / B) * c[index], B floats
// (w aligned), the values DecodeTurboRotatedBlock computes.
template <int kB, int kBits>
HWY_INLINE void DecodeTurboBlockRotated(const uint8_t* HWY_RESTRICT in,
                                        const float* HWY_RESTRICT table, float* HWY_RESTRICT w) {
  const BlockTag<kB> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(di)> du8;
  constexpr int kLevels = 1 << kBits;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const uint8_t* planes = in + kTurboScaleBytes;
  const auto f = hn::Set(d, TurboDecodeFactor(in, kB));
  auto put = [&](int i, decltype(hn::Zero(di)) index) {
    hn::Store(hn::Mul(f, Centroids(d, table, kLevels, index)), d, w + i);
  };
  if (kBits == 4) {
    constexpr int kPlane = kB / 2;
    const auto mask = hn::Set(di, 15);
    for (int j = 0; j < kPlane; j += lanes) {
      const auto byte = hn::PromoteTo(di, hn::LoadU(du8, planes + j));
      put(j, hn::And(byte, mask));
      put(j + kPlane, hn::ShiftRight<4>(byte));
    }
  } else {
    constexpr int kLow = kB / 4;
    constexpr int kHigh = kB / 8;
    const auto three = hn::Set(di, 3);
    const auto one = hn::Set(di, 1);
    for (int j = 0; j < kLow; j += lanes) {
      const auto byte = hn::PromoteTo(di, hn::LoadU(du8, planes + j));
      for (int m = 0; m < 4; ++m) {
        const int i = j + m * kLow;
        auto index = hn::And(hn::ShiftRightSame(byte, 2 * m), three);
        if (kBits == 3) {
          const auto high = hn::PromoteTo(di, hn::LoadU(du8, planes + kLow + i % kHigh));
          index = hn::Or(index, hn::ShiftLeft<2>(hn::And(hn::ShiftRightSame(high, i / kHigh), one)));
        }
        put(i, index);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace turbokv
HWY_AFTER_NAMESPACE();

#endif  // TURBOKV_KERNELS_CPU_TURBO_SIMD_INL_H_
