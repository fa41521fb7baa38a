// An owning, growable paged cache of one layer in the layout PagedKvCache
// describes: encodes appended tokens with CPU codecs straight into pages.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/attention.h"
#include "kernels/codec.h"

namespace turbokv {

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
