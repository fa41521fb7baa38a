#include "service/tensor.h"

#include "service/status_macros.h"

#include <cmath>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/half.h"

namespace turbokv {
namespace {

uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

uint16_t Load16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Every fp16 bit pattern as f32: one lookup per value on the append path.
const std::vector<float>& HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = HalfBitsToFloat(static_cast<uint16_t>(h));
    return t;
  }();
  return table;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

size_t DTypeSize(int dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16: return 2;
    default: return 0;
  }
}

absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor,
                                                  absl::Span<const int64_t> shape,
                                                  absl::string_view field, bool check_finite) {
  return TensorToFloats(tensor, tensor.data(), "data", shape, field, check_finite);
}

absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& tensor, absl::string_view bytes,
                                                  absl::string_view where, absl::Span<const int64_t> shape,
                                                  absl::string_view field, bool check_finite) {
  const size_t value_bytes = DTypeSize(tensor.dtype());
  if (value_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16 (got ", tensor.dtype(), ")"));
  }
  if (!std::equal(shape.begin(), shape.end(), tensor.shape().begin(), tensor.shape().end())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape is ", ShapeString(tensor.shape()),
                                                   ", expected ", ShapeString(shape)));
  }
  // Counted so that no product can overflow: a shape larger than the data
  // fails the length check.
  size_t count = 1;
  bool too_large = false;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && count > bytes.size() / static_cast<size_t>(d))) {
      too_large = true;
      break;
    }
    count *= static_cast<size_t>(d);
  }
  if (too_large || bytes.size() != count * value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".", where, " holds ", bytes.size(), " bytes, shape ", ShapeString(shape), " of ",
        v1::DType_Name(tensor.dtype()), " needs ", too_large ? "more" : absl::StrCat(count * value_bytes)));
  }
  std::vector<float> values(count);
  const char* data = bytes.data();
  switch (tensor.dtype()) {
    case v1::DTYPE_F32: std::memcpy(values.data(), data, count * 4); break;
    case v1::DTYPE_F16: {
      const float* table = HalfTable().data();
      for (size_t i = 0; i < count; ++i) values[i] = table[Load16(data + 2 * i)];
      break;
    }
    default:
      for (size_t i = 0; i < count; ++i) values[i] = BitsToFloat(uint32_t{Load16(data + 2 * i)} << 16);
      break;
  }
  if (check_finite) TURBOKV_RETURN_IF_ERROR(CheckFinite(values, absl::StrCat(field, ".", where)));
  return values;
}

absl::Status CheckFinite(absl::Span<const float> values, absl::string_view what) {
  const size_t i = FirstNonFinite(values.data(), values.size());
  if (i == values.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " value ", i, " is not finite (", values[i], ")"));
}

void FloatsToTensor(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DType dtype,
                    v1::Tensor* tensor) {
  tensor->set_dtype(dtype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = tensor->mutable_data();
  if (dtype == v1::DTYPE_F32) {
    data->assign(reinterpret_cast<const char*>(values.data()), values.size() * 4);
    return;
  }
  data->resize(values.size() * 2);
  FloatsToBytes(values, dtype, data->data());
}

void FloatsToBytes(absl::Span<const float> values, v1::DType dtype, char* out) {
  const size_t n = values.size();
  if (dtype == v1::DTYPE_F32) {
    std::memcpy(out, values.data(), n * 4);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const uint16_t bits =
        dtype == v1::DTYPE_F16 ? FloatToHalfBits(values[i]) : FloatToBf16Bits(values[i]);
    std::memcpy(out + 2 * i, &bits, 2);
  }
}

}  // namespace turbokv
