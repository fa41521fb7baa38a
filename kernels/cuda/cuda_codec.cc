#include "kernels/cuda/cuda_codec.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/codec_kernels.cuh"

namespace turbokv::cuda {
namespace {

// Device memory released on scope exit.
class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes) {
    return CudaStatus(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes), "cudaMalloc");
  }
  template <class T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Runs `launch` on device buffers filled from `in` (in_bytes), copies
// out_bytes back to `out` and waits.
template <class In, class Out, class Launch>
absl::Status RunOnDevice(int device, const In* in, size_t in_bytes, Out* out, size_t out_bytes,
                         Launch launch) {
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  DeviceBuffer d_in, d_out;
  if (absl::Status s = d_in.Allocate(in_bytes); !s.ok()) return s;
  if (absl::Status s = d_out.Allocate(out_bytes); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaMemcpy(d_in.get<void>(), in, in_bytes, cudaMemcpyHostToDevice),
                                  "cudaMemcpy to device");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = launch(d_in.get<const In>(), d_out.get<Out>()); !s.ok()) return s;
  return CudaStatus(cudaMemcpy(out, d_out.get<void>(), out_bytes, cudaMemcpyDeviceToHost),
                    "cudaMemcpy to host");
}

}  // namespace

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

absl::Status CheckDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA driver or device: ",
                                               cudaGetErrorString(error)));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " found)"));
  }
  cudaDeviceProp prop;
  if (absl::Status s = CudaStatus(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " (", prop.name,
                                               ") has compute capability ", prop.major, ".",
                                               prop.minor, "; turbokv needs 8.0 or newer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaCodec>> CudaCodec::Create(const CodecSpec& spec, int device) {
  absl::StatusOr<CodecLayout> layout = CheckCodecSpec(spec);
  if (!layout.ok()) return layout.status();
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  return std::unique_ptr<CudaCodec>(new CudaCodec(spec, *layout, device));
}

absl::Status CudaCodec::EncodeAsync(size_t n, const float* x, uint8_t* codes,
                                    cudaStream_t stream) const {
  const cudaError_t error = LaunchEncode(layout_, spec_.seed, n, x, codes, stream);
  if (error == cudaErrorNotSupported) {
    return absl::UnimplementedError(absl::StrCat("no CUDA encode kernel for ", CodecName(spec_.kind),
                                                 " at head_dim ", spec_.head_dim));
  }
  return CudaStatus(error, "encode kernel launch");
}

absl::Status CudaCodec::DecodeAsync(size_t n, const uint8_t* codes, float* x,
                                    cudaStream_t stream) const {
  const cudaError_t error = LaunchDecode(layout_, spec_.seed, n, codes, x, stream);
  if (error == cudaErrorNotSupported) {
    return absl::UnimplementedError(absl::StrCat("no CUDA decode kernel for ", CodecName(spec_.kind),
                                                 " at head_dim ", spec_.head_dim));
  }
  return CudaStatus(error, "decode kernel launch");
}

absl::Status CudaCodec::Encode(size_t n, const float* x, uint8_t* codes) const {
  return RunOnDevice(device_, x, n * layout_.head_dim * sizeof(float), codes, n * code_size(),
                     [&](const float* d_x, uint8_t* d_codes) {
                       absl::Status s = EncodeAsync(n, d_x, d_codes, nullptr);
                       return s.ok() ? CudaStatus(cudaDeviceSynchronize(), "encode kernel") : s;
                     });
}

absl::Status CudaCodec::Decode(size_t n, const uint8_t* codes, float* x) const {
  return RunOnDevice(device_, codes, n * code_size(), x, n * layout_.head_dim * sizeof(float),
                     [&](const uint8_t* d_codes, float* d_x) {
                       absl::Status s = DecodeAsync(n, d_codes, d_x, nullptr);
                       return s.ok() ? CudaStatus(cudaDeviceSynchronize(), "decode kernel") : s;
                     });
}

}  // namespace turbokv::cuda
