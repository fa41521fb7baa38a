// Pages in host memory, kernels on the CPU (kernels/cpu): the embedded
// default, and the backend of every machine without a usable GPU.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "service/backend/backend.h"

namespace turbokv {

class CpuBackend : public Backend {
 public:
  // Kernels spread their work over `pool`; nullptr runs them on the calling
  // thread.
  explicit CpuBackend(ThreadPool* pool = nullptr);
  ~CpuBackend() override;

  size_t capacity_bytes() const override { return 0; }
  absl::Status CheckHeadDim(int head_dim) const override;
  absl::StatusOr<uint8_t*> AllocatePage(size_t bytes) override;
  void FreePage(uint8_t* page, size_t bytes) override;
  void Trim() override;
  // Pages are canonical here: read and written in place.
  absl::Status ReadPage(const PageFormat& format, const uint8_t* page,
                        const std::function<absl::Status(absl::string_view)>& use) override;
  absl::Status WritePage(const PageFormat& format, uint8_t* page,
                         const std::function<absl::Status(uint8_t*, size_t)>& fill) override;
  absl::Status Encode(absl::Span<const EncodeChunk> chunks) override;
  absl::Status Decode(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache, int64_t first,
                      int64_t n, float* keys, float* values) override;
  absl::Status Attend(const AttentionBatch& batch, const AttentionParams& params) override;
  absl::Status EncodeAndAttend(absl::Span<const EncodeChunk> chunks, const AttentionBatch& batch,
                               const AttentionParams& params) override;

  // Pages of at least this many bytes are mapped from the kernel directly
  // (and go back to it when freed); smaller ones come from the heap.
  static constexpr size_t kMapThreshold = size_t{32} << 10;
  // Mapped pages freed are kept, up to this many bytes, for pages of the
  // same size allocated before the next Trim but one: a promotion reuses
  // the memory that the demotions making room for it freed (zeroed again)
  // instead of faulting in new pages, which costs it most of its time.
  static constexpr size_t kKeptBytes = size_t{256} << 20;

 private:
  ThreadPool* pool_;
  std::mutex kept_mutex_;
  // Freed mapped pages by size, each with the Trim generation it was freed in.
  std::unordered_map<size_t, std::vector<std::pair<uint8_t*, uint64_t>>> kept_;
  size_t kept_bytes_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace turbokv
