// Tensors on the wire (turbokv.v1.Tensor: bytes + dtype + shape,
// little-endian, row-major) to and from f32.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {

// Bytes of one value of dtype; 0 for an unknown dtype.
size_t DTypeSize(int dtype);

// The tensor as f32, after checking that it is set, that its dtype is known,
// that its shape equals `shape`, that its byte length matches, and (with
// check_finite) that every value is finite. INVALID_ARGUMENT naming `field`
// otherwise.
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor,
                                                  absl::Span<const int64_t> shape,
                                                  absl::string_view field, bool check_finite = true);
// The same with the values' bytes given apart (a slice of shared memory,
// copied before they are checked), `where` naming them in errors
// ("shared").
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor, absl::string_view bytes,
                                                  absl::string_view where, absl::Span<const int64_t> shape,
                                                  absl::string_view field, bool check_finite = true);

// INVALID_ARGUMENT naming `what` and the first value that is Inf or NaN.
absl::Status CheckFinite(absl::Span<const float> values, absl::string_view what);

// Writes values of `shape` into tensor as dtype (f32, f16 round to nearest
// even, bf16 round to nearest even).
void FloatsToTensor(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DType dtype,
                    v1::Tensor* tensor);
// The values as dtype into out (values.size() * DTypeSize(dtype) bytes).
void FloatsToBytes(absl::Span<const float> values, v1::DType dtype, char* out);

}  // namespace turbokv
