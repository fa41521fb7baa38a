#include "service/dataplane/tensor_io.h"

#include "absl/strings/str_cat.h"
#include "service/status_macros.h"
#include "service/tensor.h"

namespace turbokv {
namespace {

constexpr size_t kAlignment = 64;

absl::StatusOr<std::shared_ptr<const SharedRegion>> CallersRegion(const SharedMemory* shared_memory,
                                                                 const std::string& tenant,
                                                                 const v1::SharedSlice& slice,
                                                                 absl::string_view field) {
  if (shared_memory == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, " names shared memory, which this daemon does not serve "
                                                          "(--shared-memory-socket is empty)"));
  }
  return shared_memory->Find(tenant, slice.region());
}

}  // namespace

size_t SharedResultBytes(size_t values, v1::DType dtype) {
  const size_t bytes = values * DTypeSize(dtype);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

absl::StatusOr<std::vector<float>> InputFloats(const SharedMemory* shared_memory, const std::string& tenant,
                                               const v1::Tensor& tensor, absl::Span<const int64_t> shape,
                                               absl::string_view field, bool check_finite) {
  if (!tensor.has_shared()) return TensorToFloats(tensor, shape, field, check_finite);
  if (!tensor.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " sets both data and shared; set one"));
  }
  const std::string where = absl::StrCat(field, ".shared");
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<const SharedRegion> region,
                           CallersRegion(shared_memory, tenant, tensor.shared(), where));
  TURBOKV_ASSIGN_OR_RETURN(absl::Span<uint8_t> bytes,
                           region->Slice(tensor.shared().offset(), tensor.shared().length(), where));
  return TensorToFloats(tensor, absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                        "shared", shape, field, check_finite);
}

absl::StatusOr<ResultSink> ResultSink::Open(const SharedMemory* shared_memory, const std::string& tenant,
                                            const v1::SharedSlice* output_to, absl::Span<const size_t> bytes) {
  ResultSink sink;
  if (output_to == nullptr) return sink;
  TURBOKV_ASSIGN_OR_RETURN(sink.region_, CallersRegion(shared_memory, tenant, *output_to, "output_to"));
  if (output_to->offset() % kAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_to.offset = ", output_to->offset(), " must be a multiple of ", kAlignment));
  }
  size_t needed = 0;
  for (size_t b : bytes) needed += b;
  if (output_to->length() < needed) {
    return absl::InvalidArgumentError(absl::StrCat("output_to holds ", output_to->length(), " bytes; the result needs ",
                                                   needed));
  }
  TURBOKV_ASSIGN_OR_RETURN(absl::Span<uint8_t> slice,
                           sink.region_->Slice(output_to->offset(), output_to->length(), "output_to"));
  sink.region_id_ = output_to->region();
  sink.next_ = slice.data();
  sink.offset_ = output_to->offset();
  return sink;
}

void ResultSink::Put(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DType dtype,
                     v1::Tensor* tensor) {
  if (region_ == nullptr) {
    FloatsToTensor(values, shape, dtype, tensor);
    return;
  }
  tensor->set_dtype(dtype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  FloatsToBytes(values, dtype, reinterpret_cast<char*>(next_));
  v1::SharedSlice* slice = tensor->mutable_shared();
  slice->set_region(region_id_);
  slice->set_offset(offset_);
  slice->set_length(values.size() * DTypeSize(dtype));
  const size_t step = SharedResultBytes(values.size(), dtype);
  next_ += step;
  offset_ += step;
}

}  // namespace turbokv
