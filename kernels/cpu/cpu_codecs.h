// CPU implementations of the Codec interface (internal to kernels/).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/codec.h"
#include "kernels/rotation.h"

namespace turbokv {

// The plain scalar reference: the oracle every other path is tested against.
std::unique_ptr<Codec> NewScalarCodec(const CodecSpec& spec, const CodecLayout& layout);
// Highway SIMD with run-time dispatch to the best target of this CPU.
std::unique_ptr<Codec> NewSimdCodec(const CodecSpec& spec, const CodecLayout& layout);

// rotation.Forward (inverse: Inverse) of every block of `rows` vectors of
// head_dim values at x, in place, with SIMD; the same bits as the scalar
// HadamardRotation.
void RotateRowsSimd(const HadamardRotation& rotation, bool inverse, float* x, int64_t rows);

// Name of the SIMD target the dispatcher picks on this CPU, e.g. "AVX3".
const char* ChosenSimdTarget();

// The SIMD scan's 16-bit multiply-adds alone, at their peak rate, for
// turbokv-bench attend's floor: the scan's multiply-add step for these codecs
// run `steps` times over registers on the dispatched target. The step is the
// VNNI path's 512-bit vpdpwssd on AVX3_DL with turbo keys and values (32
// multiply-adds); elsewhere the integer scan's ReorderWidenMulAccumulate:
// vpmaddwd + vpaddd, or vmlal + vmlal2 (16 on 256-bit vectors, 8 on 128-bit
// ones). Sets per_step to the multiply-adds of one step, 0 where the
// scan multiplies floats for these codecs (SCALAR, f16 keys or values).
// Returns a checksum of the results.
int64_t MultiplyAddPeak(CodecKind keys, CodecKind values, int64_t steps, int* per_step);

// Restricts dispatch to the target named `name` (as ChosenSimdTarget spells
// it, any case), so that a benchmark can measure a lower target than this
// CPU's best. INVALID_ARGUMENT listing the targets this CPU has otherwise.
absl::Status ForceSimdTarget(absl::string_view name);

}  // namespace turbokv
