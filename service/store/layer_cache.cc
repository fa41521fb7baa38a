#include "service/store/layer_cache.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "service/backend/backend.h"

namespace turbokv {

LayerCache::LayerCache(std::shared_ptr<const Codec> key_codec, std::shared_ptr<const Codec> value_codec,
                       int kv_heads, int page_tokens, PagePool* pool)
    : key_codec_(std::move(key_codec)),
      value_codec_(std::move(value_codec)),
      kv_heads_(kv_heads),
      page_tokens_(page_tokens),
      pool_(pool),
      page_bytes_(static_cast<size_t>(kv_heads) * page_tokens *
                  (key_codec_->code_size() + value_codec_->code_size())) {}

size_t LayerCache::BytesToAppend(int64_t start, int64_t n) const {
  const int64_t end = start + n;
  if (end <= tokens_) return 0;
  const bool copy_last = tokens_ % page_tokens_ != 0 && pages_.back().use_count() > 1;
  const size_t pages_needed = static_cast<size_t>((end + page_tokens_ - 1) / page_tokens_);
  return (pages_needed - pages_.size() + (copy_last ? 1 : 0)) * page_bytes_;
}

absl::StatusOr<LayerCache::PendingAppend> LayerCache::Prepare(int64_t start, int64_t n) const {
  if (start > tokens_) {
    return absl::FailedPreconditionError(absl::StrCat("chunk starts at position ", start,
                                                      " but the layer holds ", tokens_,
                                                      " tokens: positions ", tokens_, " to ",
                                                      start - 1, " are missing"));
  }
  PendingAppend pending;
  pending.start = start;
  pending.end = start + n;
  if (pending.end <= tokens_) return pending;  // already stored
  pending.copy_last = tokens_ % page_tokens_ != 0 && pages_.back().use_count() > 1;
  const size_t pages_needed = static_cast<size_t>((pending.end + page_tokens_ - 1) / page_tokens_);
  for (size_t i = pages_.size() - (pending.copy_last ? 1 : 0); i < pages_needed; ++i) {
    absl::StatusOr<std::shared_ptr<Page>> page = pool_->Allocate(page_bytes_);
    if (!page.ok()) return page.status();
    pending.pages.push_back(*std::move(page));
  }
  return pending;
}

EncodeChunk LayerCache::Chunk(const PendingAppend& pending, const float* keys, const float* values,
                              std::vector<const uint8_t*>* table) const {
  *table = page_pointers_;
  EncodeChunk chunk;
  size_t next = 0;
  if (pending.copy_last) {
    chunk.copy_from = table->back();
    table->back() = pending.pages[next++]->data;
  }
  for (; next < pending.pages.size(); ++next) table->push_back(pending.pages[next]->data);
  chunk.key_codec = key_codec_.get();
  chunk.value_codec = value_codec_.get();
  chunk.cache = Descriptor();
  chunk.cache.pages = table->data();
  chunk.cache.tokens = pending.end;
  chunk.first = tokens_;
  const size_t skipped = static_cast<size_t>(tokens_ - pending.start) * kv_heads_ * head_dim();
  chunk.keys = keys + skipped;
  chunk.values = values + skipped;
  return chunk;
}

int64_t LayerCache::Apply(PendingAppend pending) {
  if (pending.end <= tokens_) return tokens_;
  size_t next = 0;
  if (pending.copy_last) {
    pages_.back() = pending.pages[next++];
    page_pointers_.back() = pages_.back()->data;
  }
  for (; next < pending.pages.size(); ++next) {
    pages_.push_back(pending.pages[next]);
    page_pointers_.push_back(pages_.back()->data);
  }
  tokens_ = pending.end;
  return tokens_;
}

absl::StatusOr<int64_t> LayerCache::Append(int64_t start, int64_t n, const float* keys, const float* values) {
  absl::StatusOr<PendingAppend> pending = Prepare(start, n);
  if (!pending.ok()) return pending.status();
  if (HasNew(*pending)) {
    std::vector<const uint8_t*> table;
    const EncodeChunk chunk = Chunk(*pending, keys, values, &table);
    if (absl::Status encoded = pool_->backend().Encode({chunk}); !encoded.ok()) return encoded;
  }
  return Apply(*std::move(pending));
}

absl::Status LayerCache::Read(int64_t start, int64_t n, float* keys, float* values) const {
  return pool_->backend().Decode(*key_codec_, *value_codec_, Descriptor(), start, n, keys, values);
}

absl::Status LayerCache::LoadPages(int64_t tokens, const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  if (tokens < 0 || !pages_.empty()) return absl::InvalidArgumentError("LoadPages needs an empty layer and tokens >= 0");
  const size_t count = static_cast<size_t>(tokens / page_tokens_ + (tokens % page_tokens_ != 0));
  std::vector<std::shared_ptr<Page>> loaded;
  loaded.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<std::shared_ptr<Page>> page = pool_->Allocate(page_bytes_);
    if (!page.ok()) return page.status();
    if (absl::Status filled = pool_->backend().WritePage((*page)->data, page_bytes_, fill); !filled.ok()) {
      return filled;
    }
    loaded.push_back(*std::move(page));
  }
  pages_ = std::move(loaded);
  for (const std::shared_ptr<Page>& page : pages_) page_pointers_.push_back(page->data);
  tokens_ = tokens;
  return absl::OkStatus();
}

void LayerCache::Truncate(int64_t n) {
  tokens_ = std::min(tokens_, std::max<int64_t>(n, 0));
  const size_t keep = static_cast<size_t>((tokens_ + page_tokens_ - 1) / page_tokens_);
  pages_.resize(keep);
  page_pointers_.resize(keep);
}

LayerCache LayerCache::Fork(int64_t prefix) const {
  LayerCache fork(key_codec_, value_codec_, kv_heads_, page_tokens_, pool_);
  fork.tokens_ = std::min(std::max<int64_t>(prefix, 0), tokens_);
  const size_t keep = static_cast<size_t>((fork.tokens_ + page_tokens_ - 1) / page_tokens_);
  fork.pages_.assign(pages_.begin(), pages_.begin() + keep);
  fork.page_pointers_.assign(page_pointers_.begin(), page_pointers_.begin() + keep);
  return fork;
}

PagedKvCache LayerCache::Descriptor() const {
  PagedKvCache d;
  d.key_layout = key_codec_->layout();
  d.value_layout = value_codec_->layout();
  d.key_seed = key_codec_->spec().seed;
  d.value_seed = value_codec_->spec().seed;
  d.kv_heads = kv_heads_;
  d.page_tokens = page_tokens_;
  d.tokens = tokens_;
  d.pages = page_pointers_.data();
  return d;
}

}  // namespace turbokv
