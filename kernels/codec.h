// The codec interface: turns key/value vectors into compressed bytes and back.
//
// A codec is fixed by a CodecSpec (kind, head dimension, rotation seed). Every
// implementation of one spec (scalar reference, SIMD, CUDA) reads and writes
// the same bytes, laid out as in layout.h and docs/FORMAT.md.
//
// Inputs must be finite: NaN and Inf are rejected by request validation before
// data reaches a codec, and what a codec makes of them is unspecified. Finite
// values whose fp16 scale or value would overflow saturate at +-65504.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/layout.h"
#include "kernels/rotation.h"

namespace turbokv {

// Largest head dimension accepted.
constexpr int kMaxHeadDim = 4096;

struct CodecSpec {
  CodecKind kind = CodecKind::kTurbo3;
  int head_dim = 128;
  // Rotation seed of this tensor (keys and values use different seeds, see
  // DeriveRotationSeed). Unused by f16, q8_0 and q4_0.
  uint64_t seed = 0;
};

// "f16", "q8_0", "q4_0", "turbo2", "turbo3", "turbo4".
const char* CodecName(CodecKind kind);
absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name);
// The layout for a spec, or INVALID_ARGUMENT naming the supported head dims.
absl::StatusOr<CodecLayout> CheckCodecSpec(const CodecSpec& spec);

// Upper bounds (inclusive, like Prometheus' `le`) of the buckets of
// EncodeStats::histogram, ascending, the last +Inf. Chosen from the per-vector
// relative error e of 20,000 Gaussian vectors at d = 64, 128 and 576, so that
// the codecs land in buckets of their own: f16 (e 1.3e-4 to 3.1e-4) at or
// below 0.0005, q8_0 (0.003 to 0.009) in (0.002, 0.01], turbo3 (0.12 to 0.36,
// median 0.18) mostly in (0.14, 0.25], turbo2 (0.23 to 0.54, median 0.34)
// mostly in (0.25, 0.5]. q4_0 and turbo4 make the same error on such data
// (0.05 to 0.27, medians 0.085 and 0.093): both fill (0.06, 0.14], split at
// 0.08 and 0.1. Above 0.5 a vector has lost most of itself (saturated or
// underflowed scales, or a codec far too coarse for the data).
inline constexpr double kEncodeErrorBounds[] = {
    0.0005, 0.002, 0.01, 0.03, 0.06, 0.08, 0.1, 0.14, 0.25, 0.5, 1.0,
    std::numeric_limits<double>::infinity()};
constexpr int kEncodeErrorBuckets = sizeof(kEncodeErrorBounds) / sizeof(kEncodeErrorBounds[0]);

// The quantization error of encoded vectors, as the encoder measured it from
// what it already computes (turbo: the block's sums ||z||^2, <z, c>, ||c||^2
// and the stored fp16 scale; q8_0 and q4_0: the stored fp16 scale and the
// chosen integers; f16: each value's fp16 rounding), with no decode pass.
//
// For one vector x, e = ||x - decode(encode(x))|| / ||x||. It agrees with the
// error measured by decoding up to float rounding: |e^2 - e_decoded^2| below
// about 5e-6 for turbo (float sums of B terms in a difference of sums whose
// result is e^2 ||x||^2) and relatively below 1e-4 for the others (float sums
// of squares); the fp16 rounding of scales and values is part of e, since the
// stored bits are used. ||x||^2 is a float sum of float squares: a vector where
// it is 0 (every |x_i| below about 1e-19, or 0) is a zero vector, counted in
// zero_vectors and not in `vectors`, error_sum or the histogram (it decodes to
// 0, but a relative error is undefined); one where it overflows float (values
// beyond about 1e19 / sqrt(head_dim)) counts as e = 1 (all lost: its scales
// saturated).
//
// Stats add up: Encode adds to the stats it is given, Add merges two. An
// EncodeStats is not synchronized: use one per thread and Add them. The CPU
// codecs measure them (scalar and every SIMD target, the same counts); the
// CUDA codecs (kernels/cuda/cuda_codec.h) do not take stats.
struct EncodeStats {
  uint64_t vectors = 0;       // vectors with ||x|| > 0
  uint64_t zero_vectors = 0;  // vectors with ||x|| = 0 (see above)
  double error_sum = 0;       // sum of e over `vectors`
  // histogram[k]: vectors with kEncodeErrorBounds[k - 1] < e <= kEncodeErrorBounds[k].
  uint64_t histogram[kEncodeErrorBuckets] = {};
  // fp16 fields written: one scale per block for turbo, q8_0 and q4_0 (turbo's
  // is the MSE-optimal scale, close to the block's norm), every value for f16.
  uint64_t fp16_fields = 0;
  // ... whose float value was beyond +-65504 and was stored as +-65504.
  uint64_t saturated = 0;
  // ... whose float value was nonzero and was stored as an fp16 zero or
  // subnormal (magnitude below 2^-14), so with fewer than 11 significant bits.
  uint64_t underflowed = 0;

  // Merges `other` into this.
  void Add(const EncodeStats& other);
  // Counts one vector: what its blocks lost (the encoders call this).
  void AddVector(const QuantizationError& error);
  // error_sum / vectors; 0 when no vector was counted.
  double mean_error() const;
};

// The bucket of kEncodeErrorBounds that e falls in.
int EncodeErrorBucket(double e);

class Codec {
 public:
  virtual ~Codec() = default;

  const CodecSpec& spec() const { return spec_; }
  const CodecLayout& layout() const { return layout_; }
  // Bytes of one encoded vector.
  size_t code_size() const { return layout_.code_size(); }

  // x: n * head_dim floats; codes: n * code_size() bytes. When `stats` is not
  // null, the quantization error of the n vectors is added to it (see
  // EncodeStats); the bytes written are the same with and without it.
  virtual void Encode(size_t n, const float* x, uint8_t* codes, EncodeStats* stats) const = 0;
  void Encode(size_t n, const float* x, uint8_t* codes) const { Encode(n, x, codes, nullptr); }
  // codes: n * code_size() bytes; x: n * head_dim floats.
  virtual void Decode(size_t n, const uint8_t* codes, float* x) const = 0;
  // Which code runs, e.g. "scalar" or "simd:AVX3".
  virtual std::string implementation() const = 0;

 protected:
  Codec(const CodecSpec& spec, const CodecLayout& layout);

  CodecSpec spec_;
  CodecLayout layout_;
  // Set for the turbo codecs only.
  std::unique_ptr<HadamardRotation> rotation_;
  const Codebook* codebook_ = nullptr;
};

enum class CpuPath {
  kScalar,  // the plain reference, the oracle of the tests
  kSimd,    // Highway, best target of this CPU chosen at run time
};

absl::StatusOr<std::unique_ptr<Codec>> MakeCpuCodec(const CodecSpec& spec,
                                                    CpuPath path = CpuPath::kSimd);

}  // namespace turbokv
