// Highway SIMD codecs with run-time dispatch. This file is compiled once per
// SIMD target (foreach_target.h); the best target of the CPU is chosen at the
// first call. Every path computes the same operations in the same order as the
// scalar reference (block_math.h), so the bytes agree exactly.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_codec.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>

#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/codec.h"
#include "kernels/cpu/turbo_simd-inl.h"

#ifndef TURBOKV_SIMD_CODEC_ONCE
#define TURBOKV_SIMD_CODEC_ONCE
namespace turbokv {

// What the per-target kernels need of a turbo codec.
struct TurboArgs {
  int head_dim;
  int block_values;
  int blocks;
  int block_bytes;
  const float* signs;  // head_dim values of +-1
  const Codebook* codebook;
};

}  // namespace turbokv
#endif

HWY_BEFORE_NAMESPACE();
namespace turbokv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <int kB, int kBits>
void EncodeTurboT(const TurboArgs& args, size_t n, const float* HWY_RESTRICT x,
                  uint8_t* HWY_RESTRICT codes, EncodeStats* stats) {
  const BlockTag<kB> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(di)> du8;
  using VF = hn::Vec<decltype(d)>;
  constexpr int kLevels = 1 << kBits;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const int accs = kSumLanes / lanes;
  const float* centroids = args.codebook->centroids;
  const float* boundaries = args.codebook->boundaries;
  HWY_ALIGN float z[kB];
  HWY_ALIGN int32_t idx[kB];
  const size_t code_size = static_cast<size_t>(args.blocks) * args.block_bytes;

  for (size_t v = 0; v < n; ++v) {
    QuantizationError error;
    for (int blk = 0; blk < args.blocks; ++blk) {
      const float* in = x + v * args.head_dim + blk * kB;
      const float* signs = args.signs + blk * kB;
      uint8_t* out = codes + v * code_size + blk * args.block_bytes;
      for (int j = 0; j < kB; j += lanes) {
        hn::Store(hn::Mul(hn::LoadU(d, in + j), hn::LoadU(d, signs + j)), d, z + j);
      }
      Fwht<kB>(z);

      VF acc[kSumLanes];
      for (int a = 0; a < accs; ++a) acc[a] = hn::Zero(d);
      for (int j = 0, a = 0; j < kB; j += lanes, a = (a + 1) % accs) {
        const auto zj = hn::Load(d, z + j);
        acc[a] = hn::Add(acc[a], hn::Mul(zj, zj));
      }
      const float sum_squares = FinishSum(d, acc);
      const auto inv = hn::Set(d, TurboNormalizer(sum_squares, kB));

      VF dot[kSumLanes], csq[kSumLanes];
      for (int a = 0; a < accs; ++a) dot[a] = csq[a] = hn::Zero(d);
      for (int j = 0, a = 0; j < kB; j += lanes, a = (a + 1) % accs) {
        const auto zj = hn::Load(d, z + j);
        const auto u = hn::Mul(zj, inv);
        auto index = hn::Zero(di);
        auto c = hn::Set(d, centroids[0]);
        for (int k = 0; k + 1 < kLevels; ++k) {
          const auto above = hn::Lt(hn::Set(d, boundaries[k]), u);
          index = hn::IfThenElse(hn::RebindMask(di, above), hn::Set(di, k + 1), index);
          c = hn::IfThenElse(above, hn::Set(d, centroids[k + 1]), c);
        }
        hn::Store(index, di, idx + j);
        dot[a] = hn::Add(dot[a], hn::Mul(zj, c));
        csq[a] = hn::Add(csq[a], hn::Mul(c, c));
      }
      const float dot_sum = FinishSum(d, dot);
      const float csq_sum = FinishSum(d, csq);
      const float scale = TurboScale(dot_sum, csq_sum);
      const uint16_t scale_bits = FloatToHalfBits(scale);
      StoreHalfBits(out, scale_bits);
      if (stats) AddTurboBlockError(sum_squares, dot_sum, csq_sum, scale, scale_bits, kB, &error);

      uint8_t* planes = out + kTurboScaleBytes;
      if (kBits == 4) {
        constexpr int kPlane = kB / 2;
        for (int j = 0; j < kPlane; j += lanes) {
          const auto lo = hn::Load(di, idx + j);
          const auto hi = hn::Load(di, idx + j + kPlane);
          hn::StoreU(hn::DemoteTo(du8, hn::Or(lo, hn::ShiftLeft<4>(hi))), du8, planes + j);
        }
      } else {
        constexpr int kLow = kB / 4;
        const auto three = hn::Set(di, 3);
        for (int j = 0; j < kLow; j += lanes) {
          auto byte = hn::And(hn::Load(di, idx + j), three);
          byte = hn::Or(byte, hn::ShiftLeft<2>(hn::And(hn::Load(di, idx + j + kLow), three)));
          byte = hn::Or(byte, hn::ShiftLeft<4>(hn::And(hn::Load(di, idx + j + 2 * kLow), three)));
          byte = hn::Or(byte, hn::ShiftLeft<6>(hn::And(hn::Load(di, idx + j + 3 * kLow), three)));
          hn::StoreU(hn::DemoteTo(du8, byte), du8, planes + j);
        }
        if (kBits == 3) {
          constexpr int kHigh = kB / 8;
          for (int j = 0; j < kHigh; j += lanes) {
            auto byte = hn::Zero(di);
            for (int m = 0; m < 8; ++m) {
              const auto bit = hn::ShiftRight<2>(hn::Load(di, idx + j + m * kHigh));
              byte = hn::Or(byte, hn::ShiftLeftSame(bit, m));
            }
            hn::StoreU(hn::DemoteTo(du8, byte), du8, planes + kLow + j);
          }
        }
      }
    }
    if (stats) stats->AddVector(error);
  }
}

template <int kB, int kBits>
void DecodeTurboT(const TurboArgs& args, size_t n, const uint8_t* HWY_RESTRICT codes,
                  float* HWY_RESTRICT x) {
  const BlockTag<kB> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  HWY_ALIGN float w[kB];
  const size_t code_size = static_cast<size_t>(args.blocks) * args.block_bytes;
  for (size_t v = 0; v < n; ++v) {
    for (int blk = 0; blk < args.blocks; ++blk) {
      DecodeTurboBlockRotated<kB, kBits>(codes + v * code_size + blk * args.block_bytes,
                                         args.codebook->centroids, w);
      Fwht<kB>(w);
      const float* signs = args.signs + blk * kB;
      float* out = x + v * args.head_dim + blk * kB;
      for (int j = 0; j < kB; j += lanes) {
        hn::StoreU(hn::Mul(hn::Load(d, w + j), hn::LoadU(d, signs + j)), d, out + j);
      }
    }
  }
}

void EncodeTurbo(const TurboArgs& args, size_t n, const float* x, uint8_t* codes, EncodeStats* stats) {
  DispatchTurbo(args.block_values, args.codebook->bits,
                [&](auto b, auto bits) { EncodeTurboT<b.value, bits.value>(args, n, x, codes, stats); });
}

void DecodeTurbo(const TurboArgs& args, size_t n, const uint8_t* codes, float* x) {
  DispatchTurbo(args.block_values, args.codebook->bits,
                [&](auto b, auto bits) { DecodeTurboT<b.value, bits.value>(args, n, codes, x); });
}

// HadamardRotation::Forward (signs, then H) or Inverse (H, then signs) of
// every block of `rows` vectors of head_dim values, in place: the same
// operations in the same order, so the same bits.
template <int kB>
void RotateRowsT(const float* HWY_RESTRICT signs, int head_dim, bool inverse, float* HWY_RESTRICT x, int64_t rows) {
  const BlockTag<kB> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  HWY_ALIGN float z[kB];
  for (int64_t r = 0; r < rows; ++r) {
    for (int blk = 0; blk < head_dim / kB; ++blk) {
      float* block = x + r * head_dim + blk * kB;
      const float* s = signs + blk * kB;
      for (int j = 0; j < kB; j += lanes) {
        const auto v = hn::LoadU(d, block + j);
        hn::Store(inverse ? v : hn::Mul(v, hn::LoadU(d, s + j)), d, z + j);
      }
      Fwht<kB>(z);
      for (int j = 0; j < kB; j += lanes) {
        const auto v = hn::Load(d, z + j);
        hn::StoreU(inverse ? hn::Mul(v, hn::LoadU(d, s + j)) : v, d, block + j);
      }
    }
  }
}

void RotateRows(const float* signs, int head_dim, int block_values, bool inverse, float* x, int64_t rows) {
  if (block_values == 128) {
    RotateRowsT<128>(signs, head_dim, inverse, x, rows);
  } else {
    RotateRowsT<64>(signs, head_dim, inverse, x, rows);
  }
}

// fp16 values: the F16C conversion where the target has it (round to nearest
// even, after clamping to the finite range, as FloatToHalfBits does),
// the scalar conversion elsewhere. With kStats, `error` gains what the values
// lost (in float lanes on F16C targets, as QuantizationError does elsewhere).
template <bool kStats>
void EncodeF16Values(size_t count, const float* HWY_RESTRICT x, uint8_t* HWY_RESTRICT codes,
                     QuantizationError* error) {
  size_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  const hn::ScalableTag<float> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  const auto hi = hn::Set(d, kHalfMax);
  const auto lo = hn::Set(d, -kHalfMax);
  const size_t lanes = hn::Lanes(d);
  auto* out = reinterpret_cast<hwy::float16_t*>(codes);
  auto error_sq = hn::Zero(d);
  auto norm_sq = hn::Zero(d);
  auto largest = hn::Zero(d);
  auto smallest = hn::Set(d, kHalfMinNormal);
  for (; i + lanes <= count; i += lanes) {
    const auto v = hn::LoadU(d, x + i);
    const auto h = hn::DemoteTo(dh, hn::Min(hn::Max(v, lo), hi));
    hn::StoreU(h, dh, out + i);
    if (kStats) {
      const auto r = hn::Sub(v, hn::PromoteTo(d, h));
      error_sq = hn::Add(error_sq, hn::Mul(r, r));
      norm_sq = hn::Add(norm_sq, hn::Mul(v, v));
      largest = hn::Max(largest, hn::Abs(v));
      smallest = hn::Min(smallest, hn::Abs(v));
    }
  }
  if (kStats) {
    error->error_sq += hn::GetLane(hn::SumOfLanes(d, error_sq));
    error->norm_sq += hn::GetLane(hn::SumOfLanes(d, norm_sq));
    // Values that may saturate or underflow are rare: count them one by one
    // only when some |x| is beyond 65504 or below 2^-14 (zeros included).
    if (hn::GetLane(hn::MaxOfLanes(d, largest)) > kHalfMax ||
        hn::GetLane(hn::MinOfLanes(d, smallest)) < kHalfMinNormal) {
      for (size_t j = 0; j < i; ++j) error->CountField(x[j], FloatToHalfBits(x[j]));
    } else {
      error->fields += static_cast<int>(i);
    }
  }
#endif
  for (; i < count; ++i) {
    const uint16_t h = FloatToHalfBits(x[i]);
    StoreHalfBits(codes + 2 * i, h);
    if (kStats) {
      error->AddValue(x[i], HalfBitsToFloat(h));
      error->CountField(x[i], h);
    }
  }
}

void EncodeF16(size_t n, int head_dim, const float* HWY_RESTRICT x, uint8_t* HWY_RESTRICT codes,
               EncodeStats* stats) {
  if (!stats) return EncodeF16Values<false>(n * head_dim, x, codes, nullptr);
  for (size_t v = 0; v < n; ++v) {
    QuantizationError error;
    EncodeF16Values<true>(head_dim, x + v * head_dim, codes + 2 * v * head_dim, &error);
    stats->AddVector(error);
  }
}

void DecodeF16(size_t count, const uint8_t* HWY_RESTRICT codes, float* HWY_RESTRICT x) {
  DecodeF16Values(count, codes, x);
}

double DotDoubleT(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int lanes = static_cast<int>(hn::Lanes(dd));
  auto s0 = hn::Zero(dd), s1 = hn::Zero(dd);
  int i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    s0 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(df, a + i)), hn::PromoteTo(dd, hn::LoadU(df, b + i)), s0);
    s1 = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(df, a + i + lanes)), hn::PromoteTo(dd, hn::LoadU(df, b + i + lanes)),
                    s1);
  }
  double sum = hn::GetLane(hn::SumOfLanes(dd, hn::Add(s0, s1)));
  for (; i < n; ++i) sum += static_cast<double>(a[i]) * b[i];
  return sum;
}

// |x| + 2^23, as integers, carries into the sign bit exactly when the
// exponent field is all ones (inf, NaN): or-ed over whole vectors, then the
// values searched one at a time only when one is there.
size_t FirstNonFiniteT(const float* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::RebindToSigned<decltype(df)> di;
  const size_t lanes = hn::Lanes(df);
  const auto magnitude = hn::Set(du, 0x7fffffffu);
  const auto carry = hn::Set(du, 0x00800000u);
  auto any = hn::Zero(du);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    any = hn::Or(any, hn::Add(hn::And(hn::BitCast(du, hn::LoadU(df, x + i)), magnitude), carry));
  }
  const auto non_finite = [&](size_t k) { return (FloatBits(x[k]) & 0x7f800000u) == 0x7f800000u; };
  bool found = !hn::AllFalse(di, hn::Lt(hn::BitCast(di, any), hn::Zero(di)));
  for (; i < n && !found; ++i) found = non_finite(i);
  if (!found) return n;
  size_t first = 0;
  while (!non_finite(first)) ++first;
  return first;
}

void LargestMagnitudesT(const float* HWY_RESTRICT x, size_t n, size_t block, float* largest,
                        float* largest_block_square) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  auto top = hn::Zero(d);
  float top_tail = 0.0f, top_square = 0.0f;
  for (size_t b = 0; b < n; b += block) {
    auto sum = hn::Zero(d);
    size_t i = b;
    for (; i + lanes <= b + block; i += lanes) {
      const auto v = hn::LoadU(d, x + i);
      top = hn::Max(top, hn::Abs(v));
      if (largest_block_square != nullptr) sum = hn::MulAdd(v, v, sum);
    }
    float square = hn::GetLane(hn::SumOfLanes(d, sum));
    for (; i < b + block; ++i) {
      top_tail = std::max(top_tail, std::fabs(x[i]));
      square += x[i] * x[i];
    }
    top_square = std::max(top_square, square);
  }
  *largest = std::max(top_tail, hn::GetLane(hn::MaxOfLanes(d, top)));
  if (largest_block_square != nullptr) *largest_block_square = top_square;
}

}  // namespace HWY_NAMESPACE
}  // namespace turbokv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "hwy/targets.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/key_transform.h"

namespace turbokv {

HWY_EXPORT(EncodeTurbo);
HWY_EXPORT(DecodeTurbo);
HWY_EXPORT(EncodeF16);
HWY_EXPORT(RotateRows);
HWY_EXPORT(DecodeF16);
HWY_EXPORT(FirstNonFiniteT);
HWY_EXPORT(DotDoubleT);
HWY_EXPORT(LargestMagnitudesT);

double DotDouble(const float* a, const float* b, int n) { return HWY_DYNAMIC_DISPATCH(DotDoubleT)(a, b, n); }

size_t FirstNonFinite(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(FirstNonFiniteT)(x, n); }

void LargestMagnitudes(const float* x, size_t n, size_t block, float* largest, float* largest_block_square) {
  HWY_DYNAMIC_DISPATCH(LargestMagnitudesT)(x, n, block, largest, largest_block_square);
}

const char* ChosenSimdTarget() {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

void RotateRowsSimd(const HadamardRotation& rotation, bool inverse, float* x, int64_t rows) {
  HWY_DYNAMIC_DISPATCH(RotateRows)(rotation.signs(), rotation.head_dim(), rotation.block_values(), inverse, x, rows);
}

absl::Status ForceSimdTarget(absl::string_view name) {
  std::string names;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    if (absl::EqualsIgnoreCase(name, hwy::TargetName(target))) {
      hwy::SetSupportedTargetsForTest(target);
      return absl::OkStatus();
    }
    absl::StrAppend(&names, names.empty() ? "" : ", ", hwy::TargetName(target));
  }
  return absl::InvalidArgumentError(absl::StrCat("no SIMD target '", name, "' on this CPU: it has ", names));
}

namespace {

// Turbo codecs and f16 run SIMD code; q8_0 and q4_0 (baselines kept for
// comparison) run the scalar reference.
class SimdCodec final : public Codec {
 public:
  SimdCodec(const CodecSpec& spec, const CodecLayout& layout)
      : Codec(spec, layout), fallback_(NewScalarCodec(spec, layout)) {
    if (rotation_) {
      args_ = TurboArgs{layout.head_dim, layout.block_values, layout.blocks,
                        layout.block_bytes, rotation_->signs(), codebook_};
    }
  }

  void Encode(size_t n, const float* x, uint8_t* codes, EncodeStats* stats) const override {
    if (rotation_) {
      HWY_DYNAMIC_DISPATCH(EncodeTurbo)(args_, n, x, codes, stats);
    } else if (layout_.kind == CodecKind::kF16) {
      HWY_DYNAMIC_DISPATCH(EncodeF16)(n, layout_.head_dim, x, codes, stats);
    } else {
      fallback_->Encode(n, x, codes, stats);
    }
  }

  void Decode(size_t n, const uint8_t* codes, float* x) const override {
    if (rotation_) {
      HWY_DYNAMIC_DISPATCH(DecodeTurbo)(args_, n, codes, x);
    } else if (layout_.kind == CodecKind::kF16) {
      HWY_DYNAMIC_DISPATCH(DecodeF16)(n * layout_.head_dim, codes, x);
    } else {
      fallback_->Decode(n, codes, x);
    }
  }

  std::string implementation() const override {
    if (!rotation_ && layout_.kind != CodecKind::kF16) return "scalar";
    return std::string("simd:") + ChosenSimdTarget();
  }

 private:
  std::unique_ptr<Codec> fallback_;
  TurboArgs args_{};
};

}  // namespace

std::unique_ptr<Codec> NewSimdCodec(const CodecSpec& spec, const CodecLayout& layout) {
  return std::make_unique<SimdCodec>(spec, layout);
}

}  // namespace turbokv
#endif  // HWY_ONCE
