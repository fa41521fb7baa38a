#include "service/device.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_codecs.h"
#if TURBOKV_HAVE_CUDA
#include "kernels/cuda/cuda_codec.h"
#endif

namespace turbokv {
namespace {

// What the GPU side offers, in words.
std::string CudaFinding(int device) {
#if TURBOKV_HAVE_CUDA
  const absl::Status status = cuda::CheckDevice(device);
  if (status.ok()) return absl::StrCat("CUDA device ", device, " is usable");
  return absl::StrCat("no usable CUDA device ", device, ": ", status.message());
#else
  (void)device;
  return "built without CUDA";
#endif
}

}  // namespace

absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag, int threads) {
  DeviceChoice choice;
  choice.name = absl::StrCat("cpu (simd:", ChosenSimdTarget(), ", ", threads, " threads)");
  if (flag == "cpu") {
    choice.why = "--device=cpu";
    return choice;
  }
  if (flag == "auto") {
    choice.why = absl::StrCat("--device=auto: ", CudaFinding(0),
                              "; this version keeps sessions in host memory and computes on the CPU");
    return choice;
  }
  int device = 0;
  if (absl::StartsWith(flag, "cuda:") && absl::SimpleAtoi(flag.substr(5), &device) && device >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", flag, ": ", CudaFinding(device),
        ", but this version keeps sessions in host memory and computes on the CPU; use --device=cpu or auto"));
  }
  return absl::InvalidArgumentError(absl::StrCat("--device=", flag, ": expected auto, cpu or cuda:N"));
}

}  // namespace turbokv
