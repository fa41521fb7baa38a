#include "kernels/codec.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_codecs.h"

namespace turbokv {
namespace {

constexpr struct {
  CodecKind kind;
  const char* name;
} kCodecNames[] = {
    {CodecKind::kF16, "f16"},       {CodecKind::kQ8_0, "q8_0"},
    {CodecKind::kQ4_0, "q4_0"},     {CodecKind::kTurbo2, "turbo2"},
    {CodecKind::kTurbo3, "turbo3"}, {CodecKind::kTurbo4, "turbo4"},
};

}  // namespace

const char* CodecName(CodecKind kind) {
  for (const auto& entry : kCodecNames) {
    if (entry.kind == kind) return entry.name;
  }
  return "unknown";
}

absl::StatusOr<CodecKind> ParseCodecKind(absl::string_view name) {
  for (const auto& entry : kCodecNames) {
    if (name == entry.name) return entry.kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec \"", name,
                   "\"; supported: f16, q8_0, q4_0, turbo2, turbo3, turbo4"));
}

absl::StatusOr<CodecLayout> CheckCodecSpec(const CodecSpec& spec) {
  if (CodecName(spec.kind) == absl::string_view("unknown")) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown codec kind ", static_cast<int>(spec.kind)));
  }
  const CodecLayout layout = MakeCodecLayout(spec.kind, spec.head_dim);
  if (layout.blocks == 0 || spec.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim ", spec.head_dim, " is not supported; supported head dims are multiples of 64 from 64 to ",
        kMaxHeadDim, " (rotation blocks of 128 when head_dim % 128 == 0, else 64): pad keys, values and queries "
        "with zeros to the next multiple of 64 and pass the model's softmax scale (turbokv.transformers does)"));
  }
  return layout;
}

int EncodeErrorBucket(double e) {
  return static_cast<int>(std::lower_bound(std::begin(kEncodeErrorBounds), std::end(kEncodeErrorBounds), e) -
                          std::begin(kEncodeErrorBounds));
}

void EncodeStats::Add(const EncodeStats& other) {
  vectors += other.vectors;
  zero_vectors += other.zero_vectors;
  error_sum += other.error_sum;
  for (int k = 0; k < kEncodeErrorBuckets; ++k) histogram[k] += other.histogram[k];
  fp16_fields += other.fp16_fields;
  saturated += other.saturated;
  underflowed += other.underflowed;
}

void EncodeStats::AddVector(const QuantizationError& error) {
  fp16_fields += error.fields;
  saturated += error.saturated;
  underflowed += error.underflowed;
  if (error.norm_sq == 0) {
    ++zero_vectors;
    return;
  }
  const double e = std::isfinite(error.norm_sq) ? std::sqrt(error.error_sq / error.norm_sq) : 1.0;
  ++vectors;
  error_sum += e;
  ++histogram[EncodeErrorBucket(e)];
}

double EncodeStats::mean_error() const { return vectors ? error_sum / vectors : 0.0; }

Codec::Codec(const CodecSpec& spec, const CodecLayout& layout) : spec_(spec), layout_(layout) {
  const int bits = TurboBits(spec.kind);
  if (bits != 0) {
    rotation_ = std::make_unique<HadamardRotation>(spec.head_dim, layout.block_values, spec.seed);
    codebook_ = FindCodebook(layout.block_values, bits);
  }
}

absl::StatusOr<std::unique_ptr<Codec>> MakeCpuCodec(const CodecSpec& spec, CpuPath path) {
  absl::StatusOr<CodecLayout> layout = CheckCodecSpec(spec);
  if (!layout.ok()) return layout.status();
  if (path == CpuPath::kScalar) return NewScalarCodec(spec, *layout);
  return NewSimdCodec(spec, *layout);
}

}  // namespace turbokv
