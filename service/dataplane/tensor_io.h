// A call's tensors wherever they travel: in the message (Tensor.data) or in
// the caller's shared memory (Tensor.shared for inputs, the request's
// output_to for results). The handler reads and writes every tensor through
// these, so a call gives the same results either way.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "service/dataplane/shared_memory.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {

// The tensor as f32, checked as TensorToFloats checks it. From shared
// memory (the caller's tenant's region) the bytes are copied out before
// they are checked, so a client that writes them meanwhile cannot change
// what the daemon checked. INVALID_ARGUMENT when both data and shared are
// set, or shared is set where the daemon has no shared memory; NOT_FOUND
// for a region the caller does not hold.
absl::StatusOr<std::vector<float>> InputFloats(const SharedMemory* shared_memory, const std::string& tenant,
                                               const v1::Tensor& tensor, absl::Span<const int64_t> shape,
                                               absl::string_view field, bool check_finite = true);

// Where a call's result tensors go: into the response's bytes, or one after
// another (each at a 64-byte boundary) into the slice of shared memory the
// request names.
class ResultSink {
 public:
  // Into the response when output_to is nullptr. Else the caller's region
  // must hold every tensor of `bytes` from the slice's offset on, within its
  // length: INVALID_ARGUMENT naming the bytes needed otherwise, before the
  // call changes anything.
  static absl::StatusOr<ResultSink> Open(const SharedMemory* shared_memory, const std::string& tenant,
                                         const v1::SharedSlice* output_to, absl::Span<const size_t> bytes);

  // Writes values of `shape` as dtype and describes them in `tensor` (data,
  // or the slice they went to).
  void Put(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DType dtype, v1::Tensor* tensor);

 private:
  std::shared_ptr<const SharedRegion> region_;  // null: into the response
  std::string region_id_;
  uint8_t* next_ = nullptr;
  uint64_t offset_ = 0;
};

// Bytes a result tensor of `values` values of dtype takes in shared memory,
// rounded up to the 64-byte boundary the next one starts at.
size_t SharedResultBytes(size_t values, v1::DType dtype);

}  // namespace turbokv
