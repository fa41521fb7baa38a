#include "kernels/codec.h"

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
        kMaxHeadDim, " (rotation blocks of 128 when head_dim % 128 == 0, else 64)"));
  }
  return layout;
}

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
