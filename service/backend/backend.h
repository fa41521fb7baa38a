// Where pages live and kernels run (docs/ARCHITECTURE.md, "Backends"): the one part of the
// daemon that knows whether a page's bytes are host or device memory. The
// store keeps page lists, the budget and reference counts the same for every
// backend and asks its backend to allocate, fill, read, encode and decode
// pages; the handler runs attention through it. CpuBackend (cpu_backend.h)
// keeps pages in host memory and runs kernels/cpu; CudaBackend
// (cuda_backend.h) carves them from one device arena and runs kernels/cuda on
// its streams. Every backend writes the same bytes (docs/FORMAT.md), so
// snapshots and tier records move between them unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/paged_cache.h"

namespace turbokv {

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // For logs and Stats, e.g. "cpu (simd:AVX2, 2 threads)" or
  // "cuda:0 (NVIDIA H200, 139.8 GiB, compute 9.0)".
  const std::string& name() const { return name_; }
  // The device label of the metrics: "cpu", "cuda:0".
  const std::string& label() const { return label_; }
  // The most bytes of pages it can hold (a device arena's size); 0 when only
  // the budget bounds it (host memory).
  virtual size_t capacity_bytes() const = 0;

  // OK while the device can serve; once it cannot (a GPU whose context a
  // fault poisoned: every later call on it fails), why. The server's health
  // then turns NOT_SERVING.
  virtual absl::Status Health() { return absl::OkStatus(); }

  // OK when sessions of this head dimension can run here; UNIMPLEMENTED
  // naming the limit otherwise (CreateSession refuses such sessions rather
  // than fail their attention later).
  virtual absl::Status CheckHeadDim(int head_dim) const = 0;

  // --- Pages ---
  // A page of `bytes`: zeroed on the host; on a device its bytes are
  // undefined until written, whole (WritePage, a copy on write) or by
  // Encode, which zeroes a chunk's new pages first (EncodeChunk).
  // RESOURCE_EXHAUSTED when the backend's memory cannot give one.
  // Thread-safe.
  virtual absl::StatusOr<uint8_t*> AllocatePage(size_t bytes) = 0;
  // Gives back a page of AllocatePage (same size). Thread-safe.
  virtual void FreePage(uint8_t* page, size_t bytes) = 0;
  // Called by the daemon's background pass (every --expiry-interval): what
  // the backend keeps of freed pages for reuse goes back to the system
  // once it has sat through a whole pass.
  virtual void Trim() {}
  // The order it keeps pages of a layer of these codecs and page size in
  // (kernels/page_layout.h): the native order its kernels read fastest, or
  // the canonical one. LayerCache asks once and describes its pages so.
  virtual PageOrder NativeOrder(const CodecLayout& key_layout, const CodecLayout& value_layout,
                                int page_tokens) const {
    (void)key_layout;
    (void)value_layout;
    (void)page_tokens;
    return PageOrder::kCanonical;
  }
  // Calls use() with the page's format.page_bytes() bytes readable on the
  // host in the canonical order (docs/FORMAT.md): the page itself on the
  // CPU, a copy of it on a device, translated from the page's order. use's
  // error, or the copy's.
  virtual absl::Status ReadPage(const PageFormat& format, const uint8_t* page,
                                const std::function<absl::Status(absl::string_view)>& use) = 0;
  // Has fill(data, bytes) write the page's canonical bytes on the host (into
  // the page itself on the CPU, into a buffer that is then translated to the
  // page's order and copied to the device). fill's error, or the copy's; the
  // page is then undefined.
  virtual absl::Status WritePage(const PageFormat& format, uint8_t* page,
                                 const std::function<absl::Status(uint8_t*, size_t)>& fill) = 0;

  // --- Kernels ---
  // Encodes every chunk (kernels/paged_cache.h; a prepared append of the
  // store, LayerCache::Chunk) into its pages. An error leaves every layer as
  // it was (the caller drops the chunks' pages).
  virtual absl::Status Encode(absl::Span<const EncodeChunk> chunks) = 0;
  // Decodes tokens [first, first + n) of a layer (cache as in EncodeChunk)
  // into host keys and values [n][kv_heads][head_dim].
  virtual absl::Status Decode(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache,
                              int64_t first, int64_t n, float* keys, float* values) = 0;
  // Attention over a batch (kernels/attention.h). Caches as in EncodeChunk;
  // queries, positions and outputs are host memory. The caller checked the
  // batch (shapes, positions); UNIMPLEMENTED naming what this backend cannot
  // compute, never a detour to other hardware.
  virtual absl::Status Attend(const AttentionBatch& batch, const AttentionParams& params) = 0;
  // Encode, then Attend: a Decode step's new tokens and the attention that
  // reads them (its problems describe the layers as the chunks leave them).
  // The CPU runs both in one parallel job; by default, one call after the
  // other. An error leaves every layer as it was.
  virtual absl::Status EncodeAndAttend(absl::Span<const EncodeChunk> chunks, const AttentionBatch& batch,
                                       const AttentionParams& params);

 protected:
  Backend(std::string name, std::string label) : name_(std::move(name)), label_(std::move(label)) {}

 private:
  const std::string name_;
  const std::string label_;
};

}  // namespace turbokv
