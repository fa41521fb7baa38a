#include "kernels/cuda/cuda_stream.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/codec_kernels.cuh"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/cuda_staging.h"
#include "kernels/mma_tile.h"
#include "kernels/page_layout.h"

namespace turbokv::cuda {
namespace {

absl::Status LaunchStatus(cudaError_t error, const char* what) {
  if (error == cudaErrorNotSupported) {
    return absl::UnimplementedError(absl::StrCat(what, ": not supported by the CUDA kernels"));
  }
  return CudaStatus(error, what);
}

// Waits for the stream when a call returns, whatever it returns: the next
// call must not overwrite staging an earlier copy still reads.
class Drain {
 public:
  explicit Drain(cudaStream_t stream) : stream_(stream) {}
  ~Drain() { cudaStreamSynchronize(stream_); }
  Drain(const Drain&) = delete;
  Drain& operator=(const Drain&) = delete;

 private:
  cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(int device) {
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  std::unique_ptr<CudaStream> stream(new CudaStream(device));
  if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream->stream_, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags");
      !s.ok()) {
    return s;
  }
  for (cudaEvent_t* event : {&stream->kernels_start_, &stream->kernels_end_}) {
    if (absl::Status s = CudaStatus(cudaEventCreate(event), "cudaEventCreate"); !s.ok()) return s;
  }
  return stream;
}

CudaStream::~CudaStream() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  for (cudaEvent_t event : {kernels_start_, kernels_end_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (device_buffer_ != nullptr) cudaFree(device_buffer_);
  if (host_buffer_ != nullptr) cudaFreeHost(host_buffer_);
}

absl::Status CudaStream::Reserve(size_t device_bytes, size_t host_bytes) {
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  // Calls wait for their work, so nothing in flight uses the old buffers.
  if (device_bytes > device_capacity_) {
    const size_t size = std::max(device_bytes, device_capacity_ + device_capacity_ / 2);
    if (device_buffer_ != nullptr) cudaFree(device_buffer_);
    device_buffer_ = nullptr;
    device_capacity_ = 0;
    if (cudaMalloc(&device_buffer_, size) != cudaSuccess) {
      cudaGetLastError();
      device_buffer_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("out of device memory for ", size,
                                                       " bytes of a CUDA stream's scratch on device ", device_));
    }
    device_capacity_ = size;
  }
  if (host_bytes > host_capacity_) {
    const size_t size = std::max(host_bytes, host_capacity_ + host_capacity_ / 2);
    if (host_buffer_ != nullptr) cudaFreeHost(host_buffer_);
    host_buffer_ = nullptr;
    host_capacity_ = 0;
    if (cudaHostAlloc(&host_buffer_, size, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      host_buffer_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("out of pinned host memory for ", size, " bytes of a CUDA stream's staging"));
    }
    host_capacity_ = size;
  }
  return absl::OkStatus();
}

absl::Status CudaStream::Wait(const char* what) {
  if (absl::Status s = CudaStatus(cudaStreamSynchronize(stream_), what); !s.ok()) return s;
  float ms = 0.0f;
  if (cudaEventElapsedTime(&ms, kernels_start_, kernels_end_) == cudaSuccess) last_kernel_seconds_ = ms * 1e-3;
  cudaGetLastError();  // an event never recorded is not an error of this call
  return absl::OkStatus();
}

absl::Status CudaStream::Attend(const AttentionBatch& batch, const AttentionParams& params,
                                TensorCoreVariant variant) {
  if (batch.count == 0) return absl::OkStatus();
  const AttentionProblem* problems = batch.problems;
  const size_t count = static_cast<size_t>(batch.count);
  const PagedKvCache& first = problems[0].cache;
  const int d = first.key_layout.head_dim;
  if (d > kMaxCudaHeadDim) {
    return absl::UnimplementedError(absl::StrCat("attention on the GPU takes head_dim up to ", kMaxCudaHeadDim,
                                                 "; this cache has head_dim ", d));
  }
  if (params.top_k > kMaxCudaTopK) {
    return absl::UnimplementedError(absl::StrCat("top_k on the GPU is at most ", kMaxCudaTopK));
  }
  for (size_t i = 0; i < count; ++i) {
    const AttentionProblem& p = problems[i];
    // CheckAttention reads the descriptor's sizes and the host queries and
    // positions, never the (device) pages.
    if (absl::Status s = CheckAttention(p.cache, params, p.queries, p.output); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("problem ", i, ": ", s.message()));
    }
    if (p.cache.kv_heads != first.kv_heads || p.cache.key_layout.head_dim != d || p.cache.order != first.order) {
      return absl::InvalidArgumentError(absl::StrCat(
          "problem ", i, " has ", p.cache.kv_heads, " kv heads, head_dim ", p.cache.key_layout.head_dim, " and pages in ",
          PageOrderName(p.cache.order), " order; problem 0 has ", first.kv_heads, ", ", d, " and ",
          PageOrderName(first.order), ": a batch shares its shape"));
    }
  }
  if (variant.warps != 0 || variant.stages != 0) {
    // The codec pair the launch picks a kernel by: every problem's, when
    // they share one.
    CodecKind keys = first.key_layout.kind, values = first.value_layout.kind;
    for (size_t i = 0; i < count; ++i) {
      if (problems[i].cache.key_layout.kind != keys || problems[i].cache.value_layout.kind != values) {
        keys = values = mma::kAnyCodec;
      }
    }
    if (first.order != PageOrder::kTokenGroups ||
        !TensorCoreVariantCompiled(d, RowsPerBlock(first, params.q_heads / first.kv_heads), keys, values, variant)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tensor-core kernel in ", variant.warps, " warps and ", variant.stages,
          " stages is not compiled for this batch (pages in ", PageOrderName(first.order), " order, head_dim ", d,
          ", ", params.q_heads / first.kv_heads,
          " query heads a kv head): {4, 2} runs every batch in token-group order; {4, 3}, {8, 2} and {2, 4} head_dim "
          "128 with at most 8 query heads a kv head and turbo4, turbo3 or f16 keys and values alike"));
    }
  }
  for (const std::vector<AttentionProblem>& pass : CutIntoPasses(problems, count, params, kScratchBytes)) {
    if (absl::Status s = AttendPass(pass.data(), pass.size(), params, variant); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CudaStream::AttendPass(const AttentionProblem* problems, size_t count, const AttentionParams& params,
                                    TensorCoreVariant variant) {
  AttentionStaging staging(problems, count, params);
  const StagingLayout& layout = staging.layout();
  if (absl::Status s = Reserve(layout.device_bytes, layout.host_bytes); !s.ok()) return s;
  uint8_t* host = host_at(0);
  uint8_t* device = device_at(0);
  const std::vector<DeviceProblem>& described = staging.Fill(host, device);
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(device, host, layout.up, cudaMemcpyHostToDevice, stream_),
                                  "copy the batch in");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_start_, stream_);
  if (absl::Status s = LaunchStatus(LaunchAttention(described.data(), staging.device_problems(device),
                                                    static_cast<int64_t>(count), staging.plan(), params,
                                                    staging.workspace(device), stream_, variant),
                                    "attention kernels");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_end_, stream_);
  if (absl::Status s = CopyBack(layout, "copy the results out"); !s.ok()) return s;
  if (absl::Status s = Wait("attention kernels"); !s.ok()) return s;
  staging.Deliver(host);
  return absl::OkStatus();
}

absl::Status CudaStream::Encode(absl::Span<const EncodeChunk> chunks) {
  EncodeStaging staging(chunks);
  const StagingLayout& layout = staging.layout();
  if (layout.up == 0) return absl::OkStatus();  // nothing new to encode
  if (absl::Status s = Reserve(layout.device_bytes, layout.host_bytes); !s.ok()) return s;
  uint8_t* host = host_at(0);
  uint8_t* device = device_at(0);
  staging.Fill(host, device);
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(device, host, layout.up, cudaMemcpyHostToDevice, stream_),
                                  "copy the chunks in");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_start_, stream_);
  if (absl::Status s = LaunchStatus(LaunchZeroPages(staging.zeroes(device), staging.zero_count(), stream_),
                                    "zero the new pages");
      !s.ok()) {
    return s;
  }
  for (const EncodeStaging::PageCopy& copy : staging.copies()) {
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(copy.to, copy.from, copy.bytes, cudaMemcpyDeviceToDevice, stream_),
                                    "copy a shared page");
        !s.ok()) {
      return s;
    }
  }
  for (const EncodeStaging::Launch& launch : staging.launches()) {
    if (absl::Status s = LaunchStatus(
            LaunchEncodeChunks(launch.layout, launch.chunks, launch.count, launch.vectors, launch.errors, stream_),
            "encode kernels");
        !s.ok()) {
      return s;
    }
  }
  cudaEventRecord(kernels_end_, stream_);
  if (absl::Status s = CopyBack(layout, "copy the errors out"); !s.ok()) return s;
  if (absl::Status s = Wait("encode kernels"); !s.ok()) return s;
  staging.Deliver(host);
  return absl::OkStatus();
}

absl::Status CudaStream::Decode(const PagedKvCache& cache, int64_t first, int64_t n, float* keys, float* values) {
  if (n <= 0) return absl::OkStatus();
  DecodeStaging staging(cache, first, n, keys, values);
  const StagingLayout& layout = staging.layout();
  if (absl::Status s = Reserve(layout.device_bytes, layout.host_bytes); !s.ok()) return s;
  uint8_t* host = host_at(0);
  uint8_t* device = device_at(0);
  const VectorChunk* chunks = staging.Fill(host, device);
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(device, host, layout.up, cudaMemcpyHostToDevice, stream_),
                                  "copy the range in");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_start_, stream_);
  if (absl::Status s = LaunchStatus(LaunchDecodeChunks(cache.key_layout, chunks, 1, staging.vectors(), stream_),
                                    "decode kernels");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = LaunchStatus(LaunchDecodeChunks(cache.value_layout, chunks + 1, 1, staging.vectors(), stream_),
                                    "decode kernels");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_end_, stream_);
  if (absl::Status s = CopyBack(layout, "copy the range out"); !s.ok()) return s;
  if (absl::Status s = Wait("decode kernels"); !s.ok()) return s;
  staging.Deliver(host);
  return absl::OkStatus();
}

absl::Status CudaStream::CopyBack(const StagingLayout& layout, const char* what) {
  if (layout.down_end <= layout.down_begin) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(host_at(layout.down_begin), device_at(layout.down_begin),
                                    layout.down_end - layout.down_begin, cudaMemcpyDeviceToHost, stream_),
                    what);
}

absl::Status CudaStream::CopyToHost(const void* device, size_t bytes, void* host) {
  if (absl::Status s = Reserve(0, bytes); !s.ok()) return s;
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(host_buffer_, device, bytes, cudaMemcpyDeviceToHost, stream_),
                                  "copy to the host");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaStreamSynchronize(stream_), "copy to the host"); !s.ok()) return s;
  std::memcpy(host, host_buffer_, bytes);
  return absl::OkStatus();
}

absl::Status CudaStream::CopyToDevice(const void* host, size_t bytes, void* device) {
  if (absl::Status s = Reserve(0, bytes); !s.ok()) return s;
  const Drain drain(stream_);
  std::memcpy(host_buffer_, host, bytes);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(device, host_buffer_, bytes, cudaMemcpyHostToDevice, stream_),
                                  "copy to the device");
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaStreamSynchronize(stream_), "copy to the device");
}

}  // namespace turbokv::cuda
