// Which device holds the sessions and runs the kernels, from --device.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace turbokv {

struct DeviceChoice {
  std::string name;  // e.g. "cpu (simd:AVX3_DL, 2 threads)"
  std::string why;   // for the start-up log
};

// flag: "auto", "cpu" or "cuda:N". This version keeps sessions in host memory
// and computes on the CPU: "auto" says what it found on the GPU side and
// picks the CPU; "cuda:N" is refused with FAILED_PRECONDITION saying so.
// INVALID_ARGUMENT for anything else.
absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag, int threads);

}  // namespace turbokv
