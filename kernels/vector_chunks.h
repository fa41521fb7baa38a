// Where the vectors of a batched encode or decode are: chunks of tokens of
// several layers (of several sessions), each between a plain f32 array and
// the layer's pages. The CUDA codecs write and read pages through these
// functions, which the CPU tests check against the store's own layout
// (PagedKvCache), so that a launch over a whole Decode message addresses the
// same bytes as the CPU codecs do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/hd.h"

namespace turbokv {

// One chunk: `count` tokens of one layer from token `first`, every kv head,
// as the keys or the values of the layer.
struct VectorChunk {
  // The layer's page table from page first_page on (the pages the chunk's
  // tokens are in, and maybe more).
  const uint8_t* const* pages = nullptr;
  int64_t first_page = 0;
  float* x = nullptr;                     // [count][kv_heads][head_dim] f32
  int64_t first = 0;
  int64_t count = 0;
  // The launch's index of this chunk's first vector; chunks of a launch are
  // in ascending order of it, each taking count * kv_heads vectors.
  int64_t first_vector = 0;
  uint64_t seed = 0;         // rotation seed of the keys or values (turbo)
  size_t head_bytes = 0;     // a kv head's region of a page: page_tokens * (K + V)
  size_t part_offset = 0;    // in the region: 0 for keys, page_tokens * K for values
  size_t record_bytes = 0;   // K or V
  int kv_heads = 0;
  int page_tokens = 0;
  PageOrder order = PageOrder::kCanonical;
};

// A page a launch zeroes (a chunk's new page: NewPages in paged_cache.h).
struct ZeroedPage {
  uint8_t* page = nullptr;  // 16-byte aligned
  size_t bytes = 0;
};

// The keys (values: false) or values (true) of tokens [first, first + count)
// of `cache`, between x and its pages: cache.pages by default, or a device
// copy of its page table from page first_page on.
inline VectorChunk MakeVectorChunk(const PagedKvCache& cache, bool values, int64_t first, int64_t count, float* x,
                                   int64_t first_vector, const uint8_t* const* pages = nullptr,
                                   int64_t first_page = 0) {
  VectorChunk c;
  c.pages = pages != nullptr ? pages : cache.pages;
  c.first_page = pages != nullptr ? first_page : 0;
  c.x = x;
  c.first = first;
  c.count = count;
  c.first_vector = first_vector;
  c.seed = values ? cache.value_seed : cache.key_seed;
  const size_t k = cache.key_layout.code_size(), v = cache.value_layout.code_size();
  c.head_bytes = static_cast<size_t>(cache.page_tokens) * (k + v);
  c.part_offset = values ? static_cast<size_t>(cache.page_tokens) * k : 0;
  c.record_bytes = values ? v : k;
  c.kv_heads = cache.kv_heads;
  c.page_tokens = cache.page_tokens;
  c.order = cache.order;
  return c;
}

// Vector v of a launch over chunks[0, count): its floats, where its record
// is, and the seed of its rotation.
struct ChunkVector {
  float* x;
  // The record (canonical order), or its token group (the token groups
  // order, kernels/page_layout.h), whose token `slot` it is.
  uint8_t* record;
  uint64_t seed;
  int slot = -1;  // -1: canonical

  // Where the record's field at canonical offset `offset` (of `bytes`
  // bytes) starts.
  TURBOKV_HD uint8_t* Field(int offset, int bytes) const {
    return slot < 0 ? record + offset : record + kTokenGroup * offset + slot * bytes;
  }
};

TURBOKV_HD ChunkVector LocateChunkVector(const VectorChunk* chunks, int count, int64_t v, int head_dim) {
  const VectorChunk& c = chunks[LastAtOrBelow(chunks, count, &VectorChunk::first_vector, v)];
  const int64_t local = v - c.first_vector;
  const int64_t token = c.first + local / c.kv_heads;
  const int64_t head = local % c.kv_heads;
  // The pages a chunk addresses are the caller's to write (an encode) or
  // only read (a decode).
  uint8_t* page = const_cast<uint8_t*>(c.pages[token / c.page_tokens - c.first_page]);
  const int64_t slot = token % c.page_tokens;
  uint8_t* region = page + static_cast<size_t>(head) * c.head_bytes + c.part_offset;
  if (c.order == PageOrder::kTokenGroups) {
    return ChunkVector{c.x + local * head_dim, region + static_cast<size_t>(slot / kTokenGroup) * kTokenGroup * c.record_bytes,
                       c.seed, static_cast<int>(slot % kTokenGroup)};
  }
  return ChunkVector{c.x + local * head_dim, region + static_cast<size_t>(slot) * c.record_bytes, c.seed};
}

}  // namespace turbokv
