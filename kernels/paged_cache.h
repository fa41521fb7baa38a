// Tokens encoded into, and decoded from, a paged cache of one layer
// (PagedKvCache): the descriptor of a chunk to encode, the CPU's encode and
// decode of such ranges, and an owning, growable paged cache for tests and
// tools that encodes with them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/attention.h"
#include "kernels/codec.h"

namespace turbokv {

class ThreadPool;

// One layer's new tokens to encode into its pages.
struct EncodeChunk {
  // The layer's codecs: their spec and layout, and the CPU implementation.
  const Codec* key_codec = nullptr;
  const Codec* value_codec = nullptr;
  // The layer as it will be once the chunk is stored: cache.pages is a host
  // array of the pages' addresses (host or device memory), cache.tokens the
  // new length. The pages the chunk writes are the caller's alone (new
  // pages, or the copy of a shared one), so a failed encode leaves the
  // layer's tokens as they were. The slots of new pages (NewPages) that the
  // chunk does not write must read as zeros (in snapshots and tiers), never
  // as stale bytes: host pages come zeroed (CpuBackend), a GPU's encode
  // zeroes its new pages first (its arena's pages are reused as they are).
  PagedKvCache cache;
  int64_t first = 0;  // the chunk writes tokens [first, cache.tokens)
  // When not null: before encoding, the page holding token `first` gets the
  // bytes of this page (copy on write of a partly filled page shared with a
  // fork), in the same memory as the others.
  const uint8_t* copy_from = nullptr;
  // Host memory, [cache.tokens - first][kv_heads][head_dim] f32.
  const float* keys = nullptr;
  const float* values = nullptr;
  // When not null, they gain the chunk's quantization error (EncodeStats).
  EncodeStats* key_errors = nullptr;
  EncodeStats* value_errors = nullptr;
};

// The chunk's new pages: cache.pages[first, end) of those its tokens are in,
// every one past the page holding token `first`, and that one too when the
// chunk starts it.
struct PageRange {
  int64_t first = 0;
  int64_t end = 0;
};
inline PageRange NewPages(const EncodeChunk& chunk) {
  const int64_t page_tokens = chunk.cache.page_tokens;
  return {(chunk.first + page_tokens - 1) / page_tokens, (chunk.cache.tokens + page_tokens - 1) / page_tokens};
}

// Encodes a chunk whose pages are host memory, new ones zeroed, with its CPU
// codecs; its runs of slots (one page, one kv head) spread over `pool` when
// given.
void EncodeChunkCpu(const EncodeChunk& chunk, ThreadPool* pool);

// Decodes tokens [first, first + n) of a cache in host memory with its CPU
// codecs into keys and values [n][kv_heads][head_dim].
void DecodeCpu(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache, int64_t first, int64_t n,
               float* keys, float* values);

class PagedCacheBuffer {
 public:
  // key_spec and value_spec must share head_dim.
  static absl::StatusOr<std::unique_ptr<PagedCacheBuffer>> Create(const CodecSpec& key_spec,
                                                                  const CodecSpec& value_spec,
                                                                  int kv_heads, int page_tokens);

  // Appends n tokens: keys and values [n][kv_heads][head_dim] f32.
  void Append(int64_t n, const float* keys, const float* values);

  int64_t tokens() const { return tokens_; }
  // Bytes of all pages allocated so far.
  size_t bytes() const { return pages_.size() * descriptor_.page_bytes(); }
  // Valid until the next Append.
  const PagedKvCache& descriptor() const { return descriptor_; }

 private:
  PagedCacheBuffer() = default;

  std::unique_ptr<Codec> key_codec_;
  std::unique_ptr<Codec> value_codec_;
  std::vector<std::unique_ptr<uint8_t[]>> pages_;
  std::vector<const uint8_t*> page_pointers_;
  PagedKvCache descriptor_;
  int64_t tokens_ = 0;
};

}  // namespace turbokv
