// CPU implementations of the Codec interface (internal to kernels/).
#pragma once

#include <memory>

#include "kernels/codec.h"

namespace turbokv {

// The plain scalar reference: the oracle every other path is tested against.
std::unique_ptr<Codec> NewScalarCodec(const CodecSpec& spec, const CodecLayout& layout);
// Highway SIMD with run-time dispatch to the best target of this CPU.
std::unique_ptr<Codec> NewSimdCodec(const CodecSpec& spec, const CodecLayout& layout);

// Name of the SIMD target the dispatcher picks on this CPU, e.g. "AVX3".
const char* ChosenSimdTarget();

}  // namespace turbokv
