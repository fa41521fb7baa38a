// One layer in host memory for the tests of chunked encodes and decodes: its
// codecs (the scalar reference) and its pages, laid out as PagedKvCache
// describes, filled with stale bytes (p * 37 + 1 in page p), as a reused
// page holds. Not copyable: the table points into the pages.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/page_layout.h"
#include "kernels/paged_cache.h"

namespace turbokv::testing {

// A page order as a test parameter's name: "canonical" or "token_groups".
inline std::string PageOrderParamName(PageOrder order) {
  std::string name = PageOrderName(order);
  std::replace(name.begin(), name.end(), ' ', '_');
  return name;
}

struct HostLayer {
  std::unique_ptr<Codec> keys, values;
  PagedKvCache cache;
  std::vector<std::vector<uint8_t>> pages;
  std::vector<const uint8_t*> table;

  // Keys rotated with `seed`, values with seed + 1; `tokens` tokens.
  HostLayer(CodecKind k, CodecKind v, int d, int kv_heads, int page_tokens, int64_t tokens, uint64_t seed) {
    keys = *MakeCpuCodec({k, d, seed}, CpuPath::kScalar);
    values = *MakeCpuCodec({v, d, seed + 1}, CpuPath::kScalar);
    cache.key_layout = keys->layout();
    cache.value_layout = values->layout();
    cache.key_seed = seed;
    cache.value_seed = seed + 1;
    cache.kv_heads = kv_heads;
    cache.page_tokens = page_tokens;
    cache.tokens = tokens;
    for (int64_t p = 0; p * page_tokens < tokens; ++p) {
      pages.emplace_back(cache.page_bytes(), static_cast<uint8_t>(p * 37 + 1));
    }
    for (std::vector<uint8_t>& page : pages) table.push_back(page.data());
    cache.pages = table.data();
  }
  HostLayer(const HostLayer&) = delete;
  HostLayer& operator=(const HostLayer&) = delete;

  // Zeroes pages [range.first, range.end): a chunk's new pages as the CPU
  // backend gives them, or as a GPU encode's launch leaves them.
  void Zero(PageRange range) {
    for (int64_t p = range.first; p < range.end; ++p) std::fill(pages[p].begin(), pages[p].end(), 0);
  }
};

}  // namespace turbokv::testing
