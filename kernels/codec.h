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
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

class Codec {
 public:
  virtual ~Codec() = default;

  const CodecSpec& spec() const { return spec_; }
  const CodecLayout& layout() const { return layout_; }
  // Bytes of one encoded vector.
  size_t code_size() const { return layout_.code_size(); }

  // x: n * head_dim floats; codes: n * code_size() bytes.
  virtual void Encode(size_t n, const float* x, uint8_t* codes) const = 0;
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
