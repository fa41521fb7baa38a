// One layer of one session: its keys and values in pages of a PagePool, laid
// out as the attention kernels read them (PagedKvCache, docs/FORMAT.md). The
// page list, fork sharing and truncation are the same for every backend; the
// bytes are written and read through the pool's backend.
// Not thread-safe: the session that owns it serializes access.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/paged_cache.h"
#include "service/store/page_pool.h"

namespace turbokv {

class LayerCache {
 public:
  // key_codec and value_codec share head_dim; page_tokens > 0, kv_heads > 0.
  LayerCache(std::shared_ptr<const Codec> key_codec, std::shared_ptr<const Codec> value_codec,
             int kv_heads, int page_tokens, PagePool* pool);

  int64_t tokens() const { return tokens_; }
  // Bytes of the pages this layer holds (pages shared with forks count here too).
  size_t bytes() const { return pages_.size() * page_bytes_; }
  size_t page_bytes() const { return page_bytes_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return key_codec_->layout().head_dim; }

  // The pages a chunk needs, taken from the pool and not yet used: Commit
  // applies them, dropping them gives them back.
  struct PendingAppend {
    int64_t start = 0;
    int64_t end = 0;
    bool copy_last = false;  // the shared, partly filled last page is replaced by a copy
    std::vector<std::shared_ptr<Page>> pages;
  };

  // Bytes a chunk of tokens [start, start + n) would take from the pool
  // (0 for repeated positions). Assumes start <= tokens().
  size_t BytesToAppend(int64_t start, int64_t n) const;

  // Checks a chunk of tokens [start, start + n) and takes the pages it needs.
  // A chunk that starts past the end is FAILED_PRECONDITION; RESOURCE_EXHAUSTED
  // when the budget is short. Changes nothing.
  absl::StatusOr<PendingAppend> Prepare(int64_t start, int64_t n) const;

  // Whether a prepared chunk has tokens to store (not all repeated positions).
  bool HasNew(const PendingAppend& pending) const { return pending.end > tokens_; }
  // The backend's job for a prepared chunk with new tokens (HasNew): keys
  // and values [n][kv_heads][head_dim] of positions [pending.start,
  // pending.end) on the host; only the positions past tokens() are encoded,
  // into the chunk's own pages. *table holds the page addresses the job
  // points to: keep it, and the layer unchanged, until the job is done.
  EncodeChunk Chunk(const PendingAppend& pending, const float* keys, const float* values,
                    std::vector<const uint8_t*>* table) const;
  // Installs a chunk whose job the backend has done: its pages and length.
  // Idempotent by position (a chunk of repeated positions changes nothing).
  // Returns the new token count.
  int64_t Apply(PendingAppend pending);

  // Prepare, encode on the pool's backend, Apply: the chunk is applied
  // whole or not at all.
  absl::StatusOr<int64_t> Append(int64_t start, int64_t n, const float* keys, const float* values);

  // Decodes tokens [start, start + n) (within tokens()) into host keys and
  // values [n][kv_heads][head_dim], on the pool's backend.
  absl::Status Read(int64_t start, int64_t n, float* keys, float* values) const;

  // The pages holding tokens() tokens, in order (what a snapshot stores:
  // each whole). A page's use_count() is its holders: this layer and forks.
  const std::vector<std::shared_ptr<Page>>& pages() const { return pages_; }
  // Fills an empty layer with `tokens` tokens: takes their pages from the
  // pool and has fill(data, page_bytes()) write each in order (what
  // pages() held), on the host (Backend::WritePage). RESOURCE_EXHAUSTED when they do not fit; fill's error
  // stops it. On error the layer stays empty.
  absl::Status LoadPages(int64_t tokens, const std::function<absl::Status(uint8_t*, size_t)>& fill);

  // Keeps the first n tokens (n <= tokens()) and releases the pages past them.
  void Truncate(int64_t n);

  // A new layer holding the first `prefix` tokens (prefix <= tokens()) by
  // sharing this layer's pages; a shared, partly filled last page is copied
  // by whichever side appends to it first.
  LayerCache Fork(int64_t prefix) const;

  // The descriptor the kernels read; valid until the next change.
  PagedKvCache Descriptor() const;

 private:
  std::shared_ptr<const Codec> key_codec_;
  std::shared_ptr<const Codec> value_codec_;
  int kv_heads_;
  int page_tokens_;
  PagePool* pool_;
  size_t page_bytes_;
  std::vector<std::shared_ptr<Page>> pages_;
  std::vector<const uint8_t*> page_pointers_;
  int64_t tokens_ = 0;
};

}  // namespace turbokv
