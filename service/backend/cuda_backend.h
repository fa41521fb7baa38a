// Pages in device memory, kernels on the GPU: one arena of device memory
// allocated at start and carved into pages (ArenaAllocator: no cudaMalloc
// on the request path), and a few CUDA streams (kernels/cuda/cuda_stream.h)
// that calls take turns on, each with its own staging and scratch. Built
// only with CUDA (TURBOKV_HAVE_CUDA).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "service/backend/arena.h"
#include "service/backend/backend.h"

namespace turbokv {

namespace cuda {
class CudaStream;
}

struct CudaBackendOptions {
  int device = 0;
  // Bytes of the page arena. 0: kDefaultArenaFraction of the device's free
  // memory at start, less where the streams' scratch would not fit beside
  // it. The arena and streams x CudaStream::kScratchBytes must fit the free
  // memory.
  size_t arena_bytes = 0;
  // Calls that run on the device at once (a CUDA stream each); more wait.
  int streams = 4;
  // Pages of head dims 64, 128 and 256 kept in the token groups order
  // (kernels/page_layout.h), attended by the tensor-core kernel
  // (kernels/mma_tile.h); false: the canonical order and the CUDA-core
  // split kernel for every head dim.
  bool tensor_cores = false;
};

class CudaBackend : public Backend {
 public:
  // What the arena takes of the device's free memory by default: the rest is
  // for the CUDA context, the streams' scratch and other processes.
  static constexpr double kDefaultArenaFraction = 0.8;

  // FAILED_PRECONDITION naming why when the device cannot serve (no driver
  // or device, compute capability below 8.0, an arena that with the
  // streams' scratch does not fit its free memory); RESOURCE_EXHAUSTED when
  // the arena cannot be allocated.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;

  size_t capacity_bytes() const override { return allocator_.usage().capacity; }
  absl::Status Health() override;
  absl::Status CheckHeadDim(int head_dim) const override;
  absl::StatusOr<uint8_t*> AllocatePage(size_t bytes) override;
  void FreePage(uint8_t* page, size_t bytes) override;
  PageOrder NativeOrder(const CodecLayout& key_layout, const CodecLayout& value_layout,
                        int page_tokens) const override;
  absl::Status ReadPage(const PageFormat& format, const uint8_t* page,
                        const std::function<absl::Status(absl::string_view)>& use) override;
  absl::Status WritePage(const PageFormat& format, uint8_t* page,
                         const std::function<absl::Status(uint8_t*, size_t)>& fill) override;
  absl::Status Encode(absl::Span<const EncodeChunk> chunks) override;
  absl::Status Decode(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache, int64_t first,
                      int64_t n, float* keys, float* values) override;
  absl::Status Attend(const AttentionBatch& batch, const AttentionParams& params) override;

 private:
  // A stream held for one call: waits for a free one, gives it back.
  class Lease {
   public:
    explicit Lease(CudaBackend* backend);
    ~Lease();
    Lease(const Lease&) = delete;  // a copy would give the stream back twice
    Lease& operator=(const Lease&) = delete;
    cuda::CudaStream* operator->() const { return stream_; }

   private:
    CudaBackend* backend_;
    cuda::CudaStream* stream_;
  };

  CudaBackend(std::string name, std::string label, int device, uint8_t* arena, size_t arena_bytes, bool tensor_cores);
  // A call's status, as it returns: a CUDA error (INTERNAL) makes Health
  // look at the device.
  absl::Status Watch(absl::Status status);

  const int device_;
  const bool tensor_cores_;
  uint8_t* const arena_;
  ArenaAllocator allocator_;
  std::vector<std::unique_ptr<cuda::CudaStream>> streams_;
  std::mutex mutex_;
  std::condition_variable released_;
  std::vector<cuda::CudaStream*> free_;  // under mutex_
  std::atomic<bool> suspect_{false};     // a call failed with a CUDA error
  absl::Status health_;                  // under mutex_: once the device failed, why
};

}  // namespace turbokv
