#include "service/backend/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cpu/thread_pool.h"

namespace turbokv {
namespace {

std::string CpuName(ThreadPool* pool) {
  const int threads = pool != nullptr ? pool->size() : 1;
  return absl::StrCat("cpu (simd:", ChosenSimdTarget(), ", ", threads, threads == 1 ? " thread)" : " threads)");
}

}  // namespace

CpuBackend::CpuBackend(ThreadPool* pool) : Backend(CpuName(pool), "cpu"), pool_(pool) {}

CpuBackend::~CpuBackend() {
  for (auto& [bytes, pages] : kept_) {
    for (auto& [page, generation] : pages) munmap(page, bytes);
  }
}

absl::Status CpuBackend::CheckHeadDim(int) const { return absl::OkStatus(); }

absl::StatusOr<uint8_t*> CpuBackend::AllocatePage(size_t bytes) {
  // Large pages come straight from the kernel (zeroed) and go back to it
  // when freed, so the process's memory follows the pool's; small ones
  // would waste most of a 4 KiB mapping and come from the heap.
  uint8_t* data = nullptr;
  if (bytes >= kMapThreshold) {
    {
      std::lock_guard<std::mutex> lock(kept_mutex_);
      auto it = kept_.find(bytes);
      if (it != kept_.end() && !it->second.empty()) {
        data = it->second.back().first;
        it->second.pop_back();
        kept_bytes_ -= bytes;
      }
    }
    if (data != nullptr) {
      std::memset(data, 0, bytes);
      return data;
    }
    // Populated at once: one call instead of a fault per 4 KiB.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p != MAP_FAILED) data = static_cast<uint8_t*>(p);
  } else {
    data = new (std::nothrow) uint8_t[bytes]();
  }
  if (data == nullptr) return absl::ResourceExhaustedError(absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  return data;
}

void CpuBackend::FreePage(uint8_t* page, size_t bytes) {
  if (bytes >= kMapThreshold) {
    {
      std::lock_guard<std::mutex> lock(kept_mutex_);
      if (kept_bytes_ + bytes <= kKeptBytes) {
        kept_[bytes].emplace_back(page, generation_);
        kept_bytes_ += bytes;
        return;
      }
    }
    munmap(page, bytes);
  } else {
    delete[] page;
  }
}

void CpuBackend::Trim() {
  std::vector<std::pair<uint8_t*, size_t>> unmap;
  {
    std::lock_guard<std::mutex> lock(kept_mutex_);
    for (auto& [bytes, pages] : kept_) {
      auto fresh = std::partition(pages.begin(), pages.end(),
                                  [&](const auto& page) { return page.second == generation_; });
      for (auto it = fresh; it != pages.end(); ++it) unmap.emplace_back(it->first, bytes);
      kept_bytes_ -= bytes * static_cast<size_t>(pages.end() - fresh);
      pages.erase(fresh, pages.end());
    }
    ++generation_;
  }
  for (auto& [page, bytes] : unmap) munmap(page, bytes);
}

absl::Status CpuBackend::ReadPage(const PageFormat& format, const uint8_t* page,
                                  const std::function<absl::Status(absl::string_view)>& use) {
  return use(absl::string_view(reinterpret_cast<const char*>(page), format.page_bytes()));
}

absl::Status CpuBackend::WritePage(const PageFormat& format, uint8_t* page,
                                   const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  return fill(page, format.page_bytes());
}

namespace {

// Token x kv heads of new tokens from which an encode is a large call: about
// 0.15 ms of turbo3 on one core.
constexpr int64_t kLargeEncode = 256;

int64_t NewTokenHeads(absl::Span<const EncodeChunk> chunks) {
  int64_t token_heads = 0;
  for (const EncodeChunk& chunk : chunks) {
    token_heads += std::max<int64_t>(chunk.cache.tokens - chunk.first, 0) * chunk.cache.kv_heads;
  }
  return token_heads;
}

}  // namespace

absl::Status CpuBackend::Encode(absl::Span<const EncodeChunk> chunks) {
  // Chunks encode independently: spread them over the threads (a single
  // chunk spreads its heads and pages instead). Small chunks that add up to
  // a large encode (a Decode message's new tokens) are a large call, as a
  // kernel call of many indices is: a daemon's pool runs it on its
  // background workers, where it used to take its caller's thread alone.
  if (pool_ != nullptr && chunks.size() > 1) {
    pool_->ParallelFor(
        static_cast<int64_t>(chunks.size()),
        [&](int64_t i) { EncodeChunkCpu(chunks[static_cast<size_t>(i)], nullptr); },
        NewTokenHeads(chunks) >= kLargeEncode);
  } else {
    for (const EncodeChunk& chunk : chunks) EncodeChunkCpu(chunk, pool_);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Decode(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache,
                                int64_t first, int64_t n, float* keys, float* values) {
  DecodeCpu(key_codec, value_codec, cache, first, n, keys, values);
  return absl::OkStatus();
}

absl::Status CpuBackend::Attend(const AttentionBatch& batch, const AttentionParams& params) {
  return EncodeAndAttend({}, batch, params);
}

absl::Status CpuBackend::EncodeAndAttend(absl::Span<const EncodeChunk> chunks, const AttentionBatch& batch,
                                         const AttentionParams& params) {
  AttentionOptions options;
  options.pool = pool_;
  if (chunks.size() > 1) {
    // Chunk by chunk in the attention's job, as Encode spreads them.
    options.encode_first = chunks;
    options.large_encode = NewTokenHeads(chunks) >= kLargeEncode;
  } else if (absl::Status encoded = Encode(chunks); !encoded.ok()) {  // a lone chunk spreads its heads and pages
    return encoded;
  }
  return AttendCpu(batch, params, options);
}

}  // namespace turbokv
