#include "kernels/paged_cache.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace turbokv {

absl::StatusOr<std::unique_ptr<PagedCacheBuffer>> PagedCacheBuffer::Create(
    const CodecSpec& key_spec, const CodecSpec& value_spec, int kv_heads, int page_tokens) {
  if (key_spec.head_dim != value_spec.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("key head_dim ", key_spec.head_dim,
                                                   " differs from value head_dim ",
                                                   value_spec.head_dim));
  }
  if (kv_heads <= 0) return absl::InvalidArgumentError("kv_heads must be positive");
  if (page_tokens <= 0) return absl::InvalidArgumentError("page_tokens must be positive");
  auto keys = MakeCpuCodec(key_spec);
  if (!keys.ok()) return keys.status();
  auto values = MakeCpuCodec(value_spec);
  if (!values.ok()) return values.status();
  std::unique_ptr<PagedCacheBuffer> buffer(new PagedCacheBuffer());
  buffer->key_codec_ = *std::move(keys);
  buffer->value_codec_ = *std::move(values);
  PagedKvCache& d = buffer->descriptor_;
  d.key_layout = buffer->key_codec_->layout();
  d.value_layout = buffer->value_codec_->layout();
  d.key_seed = key_spec.seed;
  d.value_seed = value_spec.seed;
  d.kv_heads = kv_heads;
  d.page_tokens = page_tokens;
  return buffer;
}

void PagedCacheBuffer::Append(int64_t n, const float* keys, const float* values) {
  const int dim = descriptor_.key_layout.head_dim;
  const int heads = descriptor_.kv_heads;
  for (int64_t i = 0; i < n; ++i, ++tokens_) {
    if (tokens_ == static_cast<int64_t>(pages_.size()) * descriptor_.page_tokens) {
      pages_.emplace_back(new uint8_t[descriptor_.page_bytes()]());
      page_pointers_.push_back(pages_.back().get());
      descriptor_.pages = page_pointers_.data();
    }
    descriptor_.tokens = tokens_ + 1;
    for (int h = 0; h < heads; ++h) {
      const size_t offset = (static_cast<size_t>(i) * heads + h) * dim;
      uint8_t* page = pages_.back().get();
      const int64_t slot = tokens_ % descriptor_.page_tokens;
      key_codec_->Encode(1, keys + offset, page + descriptor_.key_offset(h, slot));
      value_codec_->Encode(1, values + offset, page + descriptor_.value_offset(h, slot));
    }
  }
}

}  // namespace turbokv
