#include "kernels/cuda/cuda_stream.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/codec_kernels.cuh"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/vector_chunks.h"

namespace turbokv::cuda {
namespace {

constexpr size_t kAlign = 256;

size_t Align(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Consecutive aligned regions of one buffer: where each piece of a call goes.
class Regions {
 public:
  explicit Regions(size_t start = 0) : size_(start) {}
  size_t Add(size_t bytes) {
    const size_t at = Align(size_);
    size_ = at + bytes;
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_;
};

int64_t PagesOf(const PagedKvCache& cache) { return (cache.tokens + cache.page_tokens - 1) / cache.page_tokens; }

// The page a chunk's first token is in: an encode needs the table from there.
int64_t FirstPage(const EncodeChunk& chunk) { return chunk.first / chunk.cache.page_tokens; }

absl::Status LaunchStatus(cudaError_t error, const char* what) {
  if (error == cudaErrorNotSupported) {
    return absl::UnimplementedError(absl::StrCat(what, ": not supported by the CUDA kernels"));
  }
  return CudaStatus(error, what);
}

bool SameLayout(const CodecLayout& a, const CodecLayout& b) { return a.kind == b.kind && a.head_dim == b.head_dim; }

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

absl::Status CudaStream::Attend(const AttentionBatch& batch, const AttentionParams& params) {
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
    if (p.cache.kv_heads != first.kv_heads || p.cache.key_layout.head_dim != d) {
      return absl::InvalidArgumentError(
          absl::StrCat("problem ", i, " has ", p.cache.kv_heads, " kv heads and head_dim ", p.cache.key_layout.head_dim,
                       "; problem 0 has ", first.kv_heads, " and ", d, ": a batch shares its shape"));
    }
  }
  for (const std::vector<AttentionProblem>& pass : CutIntoPasses(problems, count, params, kScratchBytes)) {
    if (absl::Status s = AttendPass(pass.data(), pass.size(), params); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CudaStream::AttendPass(const AttentionProblem* problems, size_t count, const AttentionParams& params) {
  const int d = problems[0].cache.key_layout.head_dim;
  // Up: the problems, then each one's page table, queries and positions.
  // Down: each one's outputs. Then the kernels' scratch (device only).
  std::vector<DeviceProblem> device(count);
  Regions up;
  const size_t problems_at = up.Add(count * sizeof(DeviceProblem));
  std::vector<size_t> table_at(count), q_at(count), positions_at(count);
  for (size_t i = 0; i < count; ++i) {
    const AttentionProblem& p = problems[i];
    table_at[i] = up.Add(static_cast<size_t>(PagesOf(p.cache)) * sizeof(uint8_t*));
    q_at[i] = up.Add(static_cast<size_t>(p.queries.n) * params.q_heads * d * sizeof(float));
    positions_at[i] = up.Add(static_cast<size_t>(p.queries.n) * sizeof(int64_t));
    device[i].cache = p.cache;
    device[i].n = p.queries.n;
  }
  Regions down(Align(up.size()));
  std::vector<size_t> out_at(count), lse_at(count), tokens_at(count), logits_at(count);
  for (size_t i = 0; i < count; ++i) {
    const size_t rows = static_cast<size_t>(problems[i].queries.n) * params.q_heads;
    out_at[i] = down.Add(rows * d * sizeof(float));
    lse_at[i] = down.Add(rows * sizeof(float));
    tokens_at[i] = down.Add(rows * params.top_k * sizeof(int64_t));
    logits_at[i] = down.Add(rows * params.top_k * sizeof(float));
  }
  const AttentionPlan plan = PlanAttention(device.data(), static_cast<int64_t>(count), params.q_heads, params.top_k);
  const size_t workspace_at = Align(down.size());
  if (absl::Status s = Reserve(workspace_at + plan.workspace_bytes(d), down.size()); !s.ok()) return s;

  for (size_t i = 0; i < count; ++i) {
    const AttentionProblem& p = problems[i];
    DeviceProblem& dp = device[i];
    dp.cache.pages = reinterpret_cast<const uint8_t* const*>(device_at(table_at[i]));
    dp.q = reinterpret_cast<const float*>(device_at(q_at[i]));
    dp.positions = reinterpret_cast<const int64_t*>(device_at(positions_at[i]));
    dp.out = reinterpret_cast<float*>(device_at(out_at[i]));
    dp.lse = reinterpret_cast<float*>(device_at(lse_at[i]));
    dp.topk_tokens = params.top_k > 0 ? reinterpret_cast<int64_t*>(device_at(tokens_at[i])) : nullptr;
    dp.topk_logits = params.top_k > 0 ? reinterpret_cast<float*>(device_at(logits_at[i])) : nullptr;
    std::memcpy(host_at(table_at[i]), p.cache.pages, static_cast<size_t>(PagesOf(p.cache)) * sizeof(uint8_t*));
    std::memcpy(host_at(q_at[i]), p.queries.q, static_cast<size_t>(p.queries.n) * params.q_heads * d * sizeof(float));
    std::memcpy(host_at(positions_at[i]), p.queries.positions, static_cast<size_t>(p.queries.n) * sizeof(int64_t));
  }
  std::memcpy(host_at(problems_at), device.data(), count * sizeof(DeviceProblem));
  const size_t down_at = Align(up.size());
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(
          cudaMemcpyAsync(device_at(0), host_at(0), up.size(), cudaMemcpyHostToDevice, stream_), "copy the batch in");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_start_, stream_);
  if (absl::Status s = LaunchStatus(LaunchAttention(device.data(), reinterpret_cast<const DeviceProblem*>(device_at(problems_at)),
                                                    static_cast<int64_t>(count), plan, params, device_at(workspace_at),
                                                    stream_),
                                    "attention kernels");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_end_, stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(host_at(down_at), device_at(down_at), down.size() - down_at,
                                                  cudaMemcpyDeviceToHost, stream_),
                                  "copy the results out");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Wait("attention kernels"); !s.ok()) return s;
  for (size_t i = 0; i < count; ++i) {
    const AttentionOutput& out = problems[i].output;
    const size_t rows = static_cast<size_t>(problems[i].queries.n) * params.q_heads;
    std::memcpy(out.out, host_at(out_at[i]), rows * d * sizeof(float));
    std::memcpy(out.lse, host_at(lse_at[i]), rows * sizeof(float));
    if (params.top_k > 0) {
      std::memcpy(out.topk_tokens, host_at(tokens_at[i]), rows * params.top_k * sizeof(int64_t));
      std::memcpy(out.topk_logits, host_at(logits_at[i]), rows * params.top_k * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaStream::Encode(absl::Span<const EncodeChunk> chunks) {
  // The keys or values of one chunk: one side of it.
  struct Side {
    size_t chunk;
    bool values;
  };
  struct Group {
    CodecLayout layout;
    std::vector<Side> sides;
    size_t chunks_at = 0;  // its VectorChunk array, in the up region
    size_t errors_at = 0;  // its errors, in the down region
    int64_t vectors = 0;
  };
  std::vector<Group> groups;
  bool errors = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const EncodeChunk& chunk = chunks[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    errors = errors || chunk.key_errors != nullptr || chunk.value_errors != nullptr;
    for (const bool values : {false, true}) {
      const CodecLayout& layout = values ? chunk.cache.value_layout : chunk.cache.key_layout;
      auto group = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return SameLayout(g.layout, layout); });
      if (group == groups.end()) group = groups.insert(groups.end(), Group{layout, {}});
      group->sides.push_back(Side{c, values});
    }
  }
  if (groups.empty()) return absl::OkStatus();
  Regions up;
  std::vector<size_t> table_at(chunks.size()), keys_at(chunks.size()), values_at(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    const EncodeChunk& chunk = chunks[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    const size_t floats = static_cast<size_t>(chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads *
                          chunk.cache.key_layout.head_dim * sizeof(float);
    table_at[c] = up.Add(static_cast<size_t>(PagesOf(chunk.cache) - FirstPage(chunk)) * sizeof(uint8_t*));
    keys_at[c] = up.Add(floats);
    values_at[c] = up.Add(floats);
  }
  for (Group& group : groups) group.chunks_at = up.Add(group.sides.size() * sizeof(VectorChunk));
  Regions down(Align(up.size()));
  for (Group& group : groups) {
    for (const Side& side : group.sides) {
      const EncodeChunk& chunk = chunks[side.chunk];
      group.vectors += (chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads;
    }
    if (errors) group.errors_at = down.Add(static_cast<size_t>(group.vectors) * group.layout.blocks * sizeof(QuantizationError));
  }
  if (absl::Status s = Reserve(down.size(), down.size()); !s.ok()) return s;

  for (size_t c = 0; c < chunks.size(); ++c) {
    const EncodeChunk& chunk = chunks[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    const size_t floats = static_cast<size_t>(chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads *
                          chunk.cache.key_layout.head_dim * sizeof(float);
    std::memcpy(host_at(table_at[c]), chunk.cache.pages + FirstPage(chunk),
                static_cast<size_t>(PagesOf(chunk.cache) - FirstPage(chunk)) * sizeof(uint8_t*));
    std::memcpy(host_at(keys_at[c]), chunk.keys, floats);
    std::memcpy(host_at(values_at[c]), chunk.values, floats);
  }
  for (Group& group : groups) {
    auto* out = reinterpret_cast<VectorChunk*>(host_at(group.chunks_at));
    int64_t first_vector = 0;
    for (size_t i = 0; i < group.sides.size(); ++i) {
      const Side& side = group.sides[i];
      const EncodeChunk& chunk = chunks[side.chunk];
      const int64_t tokens = chunk.cache.tokens - chunk.first;
      out[i] = MakeVectorChunk(chunk.cache, side.values, chunk.first, tokens,
                               reinterpret_cast<float*>(device_at(side.values ? values_at[side.chunk] : keys_at[side.chunk])),
                               first_vector, reinterpret_cast<const uint8_t* const*>(device_at(table_at[side.chunk])),
                               FirstPage(chunk));
      first_vector += tokens * chunk.cache.kv_heads;
    }
  }
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(
          cudaMemcpyAsync(device_at(0), host_at(0), up.size(), cudaMemcpyHostToDevice, stream_), "copy the chunks in");
      !s.ok()) {
    return s;
  }
  for (const EncodeChunk& chunk : chunks) {
    if (chunk.first >= chunk.cache.tokens || chunk.copy_from == nullptr) continue;
    void* page = const_cast<uint8_t*>(chunk.cache.pages[chunk.first / chunk.cache.page_tokens]);
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(page, chunk.copy_from, chunk.cache.page_bytes(),
                                                    cudaMemcpyDeviceToDevice, stream_),
                                    "copy a shared page");
        !s.ok()) {
      return s;
    }
  }
  cudaEventRecord(kernels_start_, stream_);
  for (const Group& group : groups) {
    auto* errors_out = errors ? reinterpret_cast<QuantizationError*>(device_at(group.errors_at)) : nullptr;
    if (absl::Status s = LaunchStatus(
            LaunchEncodeChunks(group.layout, reinterpret_cast<const VectorChunk*>(device_at(group.chunks_at)),
                               static_cast<int>(group.sides.size()), static_cast<size_t>(group.vectors), errors_out,
                               stream_),
            "encode kernels");
        !s.ok()) {
      return s;
    }
  }
  cudaEventRecord(kernels_end_, stream_);
  const size_t down_at = Align(up.size());
  if (errors && down.size() > down_at) {
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(host_at(down_at), device_at(down_at), down.size() - down_at,
                                                    cudaMemcpyDeviceToHost, stream_),
                                    "copy the errors out");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = Wait("encode kernels"); !s.ok()) return s;
  if (!errors) return absl::OkStatus();
  // A vector's error is the sum of its blocks' (as the CPU encoders add them).
  for (const Group& group : groups) {
    const auto* blocks = reinterpret_cast<const QuantizationError*>(host_at(group.errors_at));
    for (const Side& side : group.sides) {
      const EncodeChunk& chunk = chunks[side.chunk];
      EncodeStats* stats = side.values ? chunk.value_errors : chunk.key_errors;
      const int64_t vectors = (chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads;
      for (int64_t v = 0; v < vectors; ++v, blocks += group.layout.blocks) {
        if (stats == nullptr) continue;
        QuantizationError error;
        for (int b = 0; b < group.layout.blocks; ++b) {
          error.error_sq += blocks[b].error_sq;
          error.norm_sq += blocks[b].norm_sq;
          error.fields += blocks[b].fields;
          error.saturated += blocks[b].saturated;
          error.underflowed += blocks[b].underflowed;
        }
        stats->AddVector(error);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaStream::Decode(const PagedKvCache& cache, int64_t first, int64_t n, float* keys, float* values) {
  if (n <= 0) return absl::OkStatus();
  const size_t floats = static_cast<size_t>(n) * cache.kv_heads * cache.key_layout.head_dim * sizeof(float);
  // The pages of the range only.
  const int64_t first_page = first / cache.page_tokens;
  const size_t pages = static_cast<size_t>((first + n - 1) / cache.page_tokens - first_page + 1);
  Regions up;
  const size_t table_at = up.Add(pages * sizeof(uint8_t*));
  const size_t chunks_at = up.Add(2 * sizeof(VectorChunk));
  Regions down(Align(up.size()));
  const size_t keys_at = down.Add(floats);
  const size_t values_at = down.Add(floats);
  if (absl::Status s = Reserve(down.size(), down.size()); !s.ok()) return s;
  std::memcpy(host_at(table_at), cache.pages + first_page, pages * sizeof(uint8_t*));
  auto* chunk = reinterpret_cast<VectorChunk*>(host_at(chunks_at));
  const auto* table = reinterpret_cast<const uint8_t* const*>(device_at(table_at));
  chunk[0] = MakeVectorChunk(cache, false, first, n, reinterpret_cast<float*>(device_at(keys_at)), 0, table, first_page);
  chunk[1] = MakeVectorChunk(cache, true, first, n, reinterpret_cast<float*>(device_at(values_at)), 0, table, first_page);
  const Drain drain(stream_);
  if (absl::Status s = CudaStatus(
          cudaMemcpyAsync(device_at(0), host_at(0), up.size(), cudaMemcpyHostToDevice, stream_), "copy the range in");
      !s.ok()) {
    return s;
  }
  const size_t vectors = static_cast<size_t>(n) * cache.kv_heads;
  const auto* device_chunks = reinterpret_cast<const VectorChunk*>(device_at(chunks_at));
  cudaEventRecord(kernels_start_, stream_);
  if (absl::Status s = LaunchStatus(LaunchDecodeChunks(cache.key_layout, device_chunks, 1, vectors, stream_), "decode kernels");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = LaunchStatus(LaunchDecodeChunks(cache.value_layout, device_chunks + 1, 1, vectors, stream_),
                                    "decode kernels");
      !s.ok()) {
    return s;
  }
  cudaEventRecord(kernels_end_, stream_);
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(host_at(keys_at), device_at(keys_at), down.size() - keys_at,
                                                  cudaMemcpyDeviceToHost, stream_),
                                  "copy the range out");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Wait("decode kernels"); !s.ok()) return s;
  std::memcpy(keys, host_at(keys_at), floats);
  std::memcpy(values, host_at(values_at), floats);
  return absl::OkStatus();
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

absl::Status CudaStream::Zero(void* device, size_t bytes) {
  if (absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaMemsetAsync(device, 0, bytes, stream_), "cudaMemsetAsync"); !s.ok()) return s;
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaMemsetAsync");
}

}  // namespace turbokv::cuda
