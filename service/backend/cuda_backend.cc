#include "service/backend/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/cuda_stream.h"

namespace turbokv {
namespace {

// Pages start on this boundary: 16-byte vector loads of a page's records
// stay aligned, and a page's rounding wastes at most 15 bytes, so that the
// arena holds every page the budget admits (session metadata, charged to the
// budget, takes none of it).
constexpr size_t kPageAlignment = 16;

std::string GiB(size_t bytes) { return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1 << 30)); }

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const CudaBackendOptions& options) {
  const std::string label = absl::StrCat("cuda:", options.device);
  if (absl::Status usable = cuda::CheckDevice(options.device); !usable.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(label, ": ", usable.message()));
  }
  if (absl::Status s = cuda::CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !s.ok()) return s;
  // Threads that wait for the device sleep instead of spinning on a core the
  // request path needs (the device's flags, for this whole process).
  if (cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess) cudaGetLastError();
  cudaDeviceProp prop;
  if (absl::Status s = cuda::CudaStatus(cudaGetDeviceProperties(&prop, options.device), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (absl::Status s = cuda::CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"); !s.ok()) return s;
  // Each stream grows a scratch buffer of up to kScratchBytes outside the
  // arena (attention's workspace): the arena leaves room for all of them.
  // (Its staging of inputs and outputs grows beyond that with the largest
  // message; a call that finds no memory for it fails alone.)
  const int streams = std::max(1, options.streams);
  const size_t scratch = static_cast<size_t>(streams) * cuda::CudaStream::kScratchBytes;
  const size_t room = free_bytes > scratch ? free_bytes - scratch : 0;
  size_t arena_bytes = options.arena_bytes;
  if (arena_bytes == 0) {
    arena_bytes = std::min(room, static_cast<size_t>(static_cast<double>(free_bytes) * kDefaultArenaFraction));
  }
  arena_bytes = arena_bytes / kPageAlignment * kPageAlignment;
  const std::string has =
      absl::StrCat(label, " (", prop.name, ") has ", GiB(free_bytes), " free of ", GiB(total_bytes), "; ");
  if (room == 0) {
    return absl::FailedPreconditionError(absl::StrCat(has, streams, " streams' scratch of ", GiB(scratch),
                                                      " leaves no room for a page arena: the page arena does not fit"));
  }
  if (arena_bytes == 0 || arena_bytes > room) {
    return absl::FailedPreconditionError(absl::StrCat(has, "a page arena of ", GiB(arena_bytes),
                                                      " (--memory-budget) does not fit beside ", streams,
                                                      " streams' scratch of ", GiB(scratch)));
  }
  void* arena = nullptr;
  if (cudaMalloc(&arena, arena_bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat(label, ": cannot allocate a page arena of ", GiB(arena_bytes), " (", GiB(free_bytes), " free)"));
  }
  const std::string name =
      absl::StrCat(label, " (", prop.name, ", compute ", prop.major, ".", prop.minor, ", page arena ", GiB(arena_bytes),
                   " of ", GiB(free_bytes), " free, ", streams, streams == 1 ? " stream" : " streams",
                   options.tensor_cores ? ", tensor-core attention)" : ")");
  std::unique_ptr<CudaBackend> backend(new CudaBackend(name, label, options.device, static_cast<uint8_t*>(arena),
                                                       arena_bytes, options.tensor_cores));
  for (int i = 0; i < streams; ++i) {
    absl::StatusOr<std::unique_ptr<cuda::CudaStream>> stream = cuda::CudaStream::Create(options.device);
    if (!stream.ok()) return stream.status();
    backend->free_.push_back(stream->get());
    backend->streams_.push_back(*std::move(stream));
  }
  return backend;
}

CudaBackend::CudaBackend(std::string name, std::string label, int device, uint8_t* arena, size_t arena_bytes,
                         bool tensor_cores)
    : Backend(std::move(name), std::move(label)),
      device_(device),
      tensor_cores_(tensor_cores),
      arena_(arena),
      allocator_(arena_bytes, kPageAlignment) {}

CudaBackend::~CudaBackend() {
  streams_.clear();
  cudaSetDevice(device_);
  cudaFree(arena_);
}

CudaBackend::Lease::Lease(CudaBackend* backend) : backend_(backend) {
  std::unique_lock<std::mutex> lock(backend->mutex_);
  backend->released_.wait(lock, [&] { return !backend->free_.empty(); });
  stream_ = backend->free_.back();
  backend->free_.pop_back();
}

CudaBackend::Lease::~Lease() {
  {
    std::lock_guard<std::mutex> lock(backend_->mutex_);
    backend_->free_.push_back(stream_);
  }
  backend_->released_.notify_one();
}

absl::Status CudaBackend::CheckHeadDim(int head_dim) const {
  if (head_dim <= cuda::kMaxCudaHeadDim) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat("head_dim = ", head_dim, ": attention on the GPU (", label(),
                                               ") takes head_dim up to ", cuda::kMaxCudaHeadDim,
                                               "; a turbokvd with --device=cpu takes up to ", kMaxHeadDim));
}

absl::StatusOr<uint8_t*> CudaBackend::AllocatePage(size_t bytes) {
  const std::optional<size_t> offset = allocator_.Allocate(bytes);
  if (!offset.has_value()) {
    const ArenaAllocator::Usage usage = allocator_.usage();
    return absl::ResourceExhaustedError(absl::StrCat(
        "the page arena of ", label(), " has no free range of ", bytes, " bytes: ", usage.used, " of ", usage.capacity,
        " bytes used, the free ones in ", usage.free_ranges, " ranges, the largest ", usage.largest_free, " bytes"));
  }
  // Not zeroed here (a lease and a wait a page): Encode zeroes a chunk's
  // new pages in its own launch, and the other writers fill pages whole.
  return arena_ + *offset;
}

void CudaBackend::FreePage(uint8_t* page, size_t bytes) { allocator_.Free(static_cast<size_t>(page - arena_), bytes); }

PageOrder CudaBackend::NativeOrder(const CodecLayout& key_layout, const CodecLayout& value_layout,
                                   int page_tokens) const {
  const int d = key_layout.head_dim;
  return tensor_cores_ && (d == 64 || d == 128 || d == 256) && TokenGroupsApply(key_layout, value_layout, page_tokens)
             ? PageOrder::kTokenGroups
             : PageOrder::kCanonical;
}

absl::Status CudaBackend::ReadPage(const PageFormat& format, const uint8_t* page,
                                   const std::function<absl::Status(absl::string_view)>& use) {
  const size_t bytes = format.page_bytes();
  std::vector<uint8_t> host(bytes), canonical(bytes);
  if (absl::Status s = Watch(Lease(this)->CopyToHost(page, bytes, host.data())); !s.ok()) return s;
  PageToCanonical(format, host.data(), canonical.data());
  return use(absl::string_view(reinterpret_cast<const char*>(canonical.data()), bytes));
}

absl::Status CudaBackend::WritePage(const PageFormat& format, uint8_t* page,
                                    const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  const size_t bytes = format.page_bytes();
  std::vector<uint8_t> canonical(bytes), host(bytes);
  if (absl::Status s = fill(canonical.data(), bytes); !s.ok()) return s;
  PageToOrder(format, canonical.data(), host.data());
  return Watch(Lease(this)->CopyToDevice(host.data(), bytes, page));
}

absl::Status CudaBackend::Encode(absl::Span<const EncodeChunk> chunks) { return Watch(Lease(this)->Encode(chunks)); }

absl::Status CudaBackend::Decode(const Codec&, const Codec&, const PagedKvCache& cache, int64_t first, int64_t n,
                                 float* keys, float* values) {
  return Watch(Lease(this)->Decode(cache, first, n, keys, values));
}

absl::Status CudaBackend::Attend(const AttentionBatch& batch, const AttentionParams& params) {
  // Layers stored with a transform or sink tokens: the pages on the GPU,
  // the sinks (host memory, a few tokens) on the CPU, merged on the host.
  return AttendTransformed(
      batch, params,
      [this](const AttentionBatch& b, const AttentionParams& p) { return Watch(Lease(this)->Attend(b, p)); },
      [](const AttentionBatch& b, const AttentionParams& p) { return AttendCpu(b, p); });
}

absl::Status CudaBackend::Watch(absl::Status status) {
  if (absl::IsInternal(status)) suspect_ = true;
  return status;
}

absl::Status CudaBackend::Health() {
  if (!suspect_.exchange(false)) {
    std::lock_guard<std::mutex> lock(mutex_);
    return health_;
  }
  // A fault that poisons the context (an illegal address, a launch failure)
  // makes every later call on the device fail: a call that touches the
  // context tells it from an error of one call alone.
  cudaSetDevice(device_);
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t error = cudaMemGetInfo(&free_bytes, &total_bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (error != cudaSuccess && health_.ok()) {
    health_ = absl::UnavailableError(absl::StrCat(label(), " failed (", cudaGetErrorName(error), ": ",
                                                  cudaGetErrorString(error),
                                                  "): every call on it fails until turbokvd restarts"));
  }
  return health_;
}

}  // namespace turbokv
