// The backend a device name asks for (--device), as MakeTierChain builds
// the tiers: apart from the Backend interface, which the backends include.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/backend/backend.h"

namespace turbokv {

class ThreadPool;

// The backend of `device`: "cpu" (host memory, kernels over `pool`) or
// "cuda:N" (GPU N, a page arena of arena_bytes, 0: CudaBackend's default
// share of its free memory; `streams` calls at once on it; tensor_cores:
// its pages in the token groups order and attention on the tensor-core
// kernel, CudaBackendOptions). FAILED_PRECONDITION naming why a GPU cannot
// serve (a build without CUDA, no driver or device, too old a GPU, too
// little free memory); INVALID_ARGUMENT for another name.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view device, ThreadPool* pool, size_t arena_bytes = 0,
                                                     int streams = 4, bool tensor_cores = false);

}  // namespace turbokv
