#include "service/backend/make_backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "service/backend/cpu_backend.h"
#if TURBOKV_HAVE_CUDA
#include "service/backend/cuda_backend.h"
#endif

namespace turbokv {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view device, ThreadPool* pool, size_t arena_bytes,
                                                     int streams, bool tensor_cores) {
  if (device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(pool));
  int index = 0;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device \"", device, "\": expected cpu or cuda:N"));
  }
#if TURBOKV_HAVE_CUDA
  CudaBackendOptions options;
  options.device = index;
  options.arena_bytes = arena_bytes;
  options.streams = streams;
  options.tensor_cores = tensor_cores;
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(options);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(*std::move(backend));
#else
  (void)arena_bytes;
  (void)streams;
  (void)tensor_cores;
  return absl::FailedPreconditionError(absl::StrCat(device, ": this turbokv was built without CUDA"));
#endif
}

}  // namespace turbokv
