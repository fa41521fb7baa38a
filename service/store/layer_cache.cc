#include "service/store/layer_cache.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "service/backend/backend.h"

namespace turbokv {

size_t LayerExtrasBytes(int kv_heads, int head_dim, int sink_tokens, CodecKind sink_codec) {
  const size_t sink = static_cast<size_t>(sink_tokens) * kv_heads * 2 * MakeCodecLayout(sink_codec, head_dim).code_size();
  return sink + 3 * sizeof(float) * static_cast<size_t>(kv_heads) * head_dim;
}

LayerCache::LayerCache(std::shared_ptr<const Codec> key_codec, std::shared_ptr<const Codec> value_codec,
                       int kv_heads, int page_tokens, PagePool* pool, LayerStorage storage)
    : key_codec_(std::move(key_codec)),
      value_codec_(std::move(value_codec)),
      kv_heads_(kv_heads),
      page_tokens_(page_tokens),
      pool_(pool),
      storage_(std::move(storage)),
      page_bytes_(static_cast<size_t>(kv_heads) * page_tokens *
                  (key_codec_->code_size() + value_codec_->code_size())) {
  if (storage_.sink_tokens > 0) {
    sinks_ = std::make_shared<const std::string>(
        static_cast<size_t>(kv_heads) * storage_.sink_tokens * 2 * storage_.sink_codec->code_size(), '\0');
  }
}

PagedKvCache LayerCache::SinkDescriptor(const std::string& page, int64_t tokens, const uint8_t** table) const {
  PagedKvCache d;
  d.key_layout = storage_.sink_codec->layout();
  d.value_layout = d.key_layout;
  d.kv_heads = kv_heads_;
  d.page_tokens = storage_.sink_tokens;
  d.tokens = tokens;
  *table = reinterpret_cast<const uint8_t*>(page.data());
  d.pages = table;
  return d;
}

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

EncodeChunk LayerCache::Chunk(PendingAppend* pending_out, const float* keys, const float* values,
                              const float* queries, int q_heads, std::vector<const uint8_t*>* table) const {
  PendingAppend& pending = *pending_out;
  const size_t row = static_cast<size_t>(kv_heads_) * head_dim();
  const size_t skipped = static_cast<size_t>(tokens_ - pending.start);
  const float* new_keys = keys + skipped * row;
  const float* new_values = values + skipped * row;
  const int64_t fresh = pending.end - tokens_;  // tokens the chunk adds
  const int64_t sink_end = std::min<int64_t>(pending.end, storage_.sink_tokens);
  const int64_t main_begin = std::max<int64_t>(tokens_, storage_.sink_tokens);
  if (tokens_ < sink_end) {
    // The chunk's sink tokens, into a copy of the sink page.
    pending.sinks = *sinks_;
    EncodeChunk sinks;
    sinks.key_codec = storage_.sink_codec.get();
    sinks.value_codec = storage_.sink_codec.get();
    const uint8_t* sink_table = nullptr;
    sinks.cache = SinkDescriptor(pending.sinks, sink_end, &sink_table);
    sinks.first = tokens_;
    sinks.keys = new_keys;
    sinks.values = new_values;
    EncodeChunkCpu(sinks, nullptr);
  }
  pending.transform = transform_;
  if (!transform_fixed_ && main_begin < pending.end) {
    const size_t offset = static_cast<size_t>(main_begin - tokens_);
    KeyTransform fitted = FitKeyTransform(
        storage_.transform, pending.end - main_begin, kv_heads_, head_dim(), new_keys + offset * row,
        new_values + offset * row, q_heads,
        queries != nullptr ? queries + (skipped + offset) * static_cast<size_t>(q_heads) * head_dim() : nullptr);
    pending.transform = fitted.empty() ? nullptr : std::make_shared<const KeyTransform>(std::move(fitted));
    pending.fixes_transform = true;
  }
  if (tokens_ < sink_end || pending.transform != nullptr) {
    // The pages get zeros at sink positions, the rest transformed.
    pending.keys.assign(new_keys, new_keys + fresh * row);
    pending.values.assign(new_values, new_values + fresh * row);
    const size_t sinks_here = static_cast<size_t>(std::max<int64_t>(sink_end - tokens_, 0));
    std::fill(pending.keys.begin(), pending.keys.begin() + sinks_here * row, 0.0f);
    std::fill(pending.values.begin(), pending.values.begin() + sinks_here * row, 0.0f);
    if (pending.transform != nullptr && main_begin < pending.end) {
      const size_t offset = static_cast<size_t>(main_begin - tokens_);
      pending.transform->Apply(pending.end - main_begin, pending.keys.data() + offset * row,
                               pending.values.data() + offset * row);
    }
    new_keys = pending.keys.data();
    new_values = pending.values.data();
  }
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
  chunk.cache.first_token = std::min<int64_t>(pending.end, storage_.sink_tokens);
  chunk.first = tokens_;
  chunk.keys = new_keys;
  chunk.values = new_values;
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
  if (!pending.sinks.empty()) {
    sinks_ = std::make_shared<const std::string>(std::move(pending.sinks));
    ++extras_version_;
  }
  if (pending.fixes_transform) {
    transform_ = std::move(pending.transform);
    transform_fixed_ = true;
    transform_end_ = pending.end;
    ++extras_version_;
  }
  tokens_ = pending.end;
  return tokens_;
}

absl::StatusOr<int64_t> LayerCache::Append(int64_t start, int64_t n, const float* keys, const float* values,
                                           const float* queries, int q_heads) {
  absl::StatusOr<PendingAppend> pending = Prepare(start, n);
  if (!pending.ok()) return pending.status();
  if (HasNew(*pending)) {
    std::vector<const uint8_t*> table;
    const EncodeChunk chunk = Chunk(&*pending, keys, values, queries, q_heads, &table);
    if (absl::Status encoded = pool_->backend().Encode({chunk}); !encoded.ok()) return encoded;
  }
  return Apply(*std::move(pending));
}

absl::Status LayerCache::Read(int64_t start, int64_t n, float* keys, float* values) const {
  if (absl::Status decoded = pool_->backend().Decode(*key_codec_, *value_codec_, Descriptor(), start, n, keys, values);
      !decoded.ok()) {
    return decoded;
  }
  const size_t row = static_cast<size_t>(kv_heads_) * head_dim();
  const int64_t sinks = sinks_held();
  const int64_t main_begin = std::max(start, sinks);
  if (transform_ != nullptr && main_begin < start + n) {
    transform_->Invert(start + n - main_begin, keys + (main_begin - start) * row, values + (main_begin - start) * row);
  }
  if (start < sinks) {
    const uint8_t* table = nullptr;
    DecodeCpu(*storage_.sink_codec, *storage_.sink_codec, SinkDescriptor(*sinks_, sinks, &table), start,
              std::min(start + n, sinks) - start, keys, values);
  }
  return absl::OkStatus();
}

LayerExtras LayerCache::Extras() const {
  LayerExtras extras;
  extras.transform_fixed = transform_fixed_;
  if (transform_ != nullptr) extras.transform = *transform_;
  extras.sink_tokens = sinks_held();
  if (extras.sink_tokens > 0) extras.sinks = *sinks_;
  return extras;
}

absl::Status LayerCache::LoadPages(int64_t tokens, const LayerExtras& extras,
                                   const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  if (tokens < 0 || !pages_.empty()) return absl::InvalidArgumentError("LoadPages needs an empty layer and tokens >= 0");
  if (extras.sink_tokens != std::min<int64_t>(tokens, storage_.sink_tokens) ||
      (extras.sink_tokens > 0 && extras.sinks.size() != sinks_->size())) {
    return absl::DataLossError(absl::StrCat("the layer's sink tokens (", extras.sink_tokens, " in ",
                                            extras.sinks.size(), " bytes) do not match its ", tokens,
                                            " tokens and ", storage_.sink_tokens, " sink slots"));
  }
  if (absl::Status checked = extras.transform.Check(kv_heads_, head_dim()); !checked.ok()) {
    return absl::DataLossError(absl::StrCat("the layer's ", checked.message()));
  }
  if (!extras.transform.empty() && !extras.transform_fixed) {
    return absl::DataLossError("the layer's key transform is not marked fixed");
  }
  if (tokens > storage_.sink_tokens && !extras.transform_fixed && storage_.transform.any()) {
    return absl::DataLossError("the layer's key transform is missing: its pages cannot be read back");
  }
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
  if (extras.sink_tokens > 0) sinks_ = std::make_shared<const std::string>(extras.sinks);
  transform_fixed_ = extras.transform_fixed;
  transform_end_ = transform_fixed_ ? tokens : 0;
  if (!extras.transform.empty()) transform_ = std::make_shared<const KeyTransform>(extras.transform);
  ++extras_version_;
  return absl::OkStatus();
}

void LayerCache::Truncate(int64_t n) {
  tokens_ = std::min(tokens_, std::max<int64_t>(n, 0));
  const size_t keep = static_cast<size_t>((tokens_ + page_tokens_ - 1) / page_tokens_);
  pages_.resize(keep);
  page_pointers_.resize(keep);
  // Sink slots past the tokens read as zeros again, as in a fresh layer;
  // with no token past the sinks left, the next chunk fits a new transform.
  if (tokens_ < storage_.sink_tokens) {
    // A copy: forks may share the page.
    std::string sinks = *sinks_;
    const size_t slot = storage_.sink_codec->code_size();
    for (int h = 0; h < kv_heads_; ++h) {
      for (size_t side = 0; side < 2; ++side) {
        const size_t region = (static_cast<size_t>(h) * 2 + side) * storage_.sink_tokens * slot;
        std::fill(sinks.begin() + region + tokens_ * slot, sinks.begin() + region + storage_.sink_tokens * slot, '\0');
      }
    }
    sinks_ = std::make_shared<const std::string>(std::move(sinks));
  }
  bool changed = tokens_ < storage_.sink_tokens;
  if (transform_fixed_ && tokens_ < transform_end_) transform_end_ = kNeverReused;
  if (tokens_ <= storage_.sink_tokens && transform_fixed_) {
    transform_fixed_ = false;
    transform_ = nullptr;
    transform_end_ = 0;
    changed = true;
  }
  if (changed) ++extras_version_;
}

LayerCache LayerCache::Fork(int64_t prefix) const {
  LayerCache fork(key_codec_, value_codec_, kv_heads_, page_tokens_, pool_, storage_);
  fork.tokens_ = std::min(std::max<int64_t>(prefix, 0), tokens_);
  const size_t keep = static_cast<size_t>((fork.tokens_ + page_tokens_ - 1) / page_tokens_);
  fork.pages_.assign(pages_.begin(), pages_.begin() + keep);
  fork.page_pointers_.assign(page_pointers_.begin(), page_pointers_.begin() + keep);
  fork.sinks_ = sinks_;
  fork.transform_fixed_ = transform_fixed_;
  fork.transform_ = transform_;
  fork.transform_end_ = transform_end_;
  fork.Truncate(fork.tokens_);  // sink slots and transform as a layer of that length holds them
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
  d.first_token = sinks_held();
  d.pages = page_pointers_.data();
  return d;
}

AttentionProblem LayerCache::Problem(PagedKvCache cache, const KeyTransform* transform, const std::string* sink_page,
                                     const AttentionQueries& queries, const AttentionOutput& output,
                                     const uint8_t** sink_table) const {
  const int64_t sinks = cache.first_token;
  AttentionProblem problem;
  problem.cache = cache;
  problem.queries = queries;
  problem.output = output;
  problem.transform = transform;
  if (sinks > 0) problem.sinks = SinkDescriptor(*sink_page, sinks, sink_table);
  return problem;
}

AttentionProblem LayerCache::Attention(const AttentionQueries& queries, const AttentionOutput& output) const {
  return Problem(Descriptor(), transform_.get(), sinks_.get(), queries, output, &sink_pointer_);
}

AttentionProblem LayerCache::PendingAttention(const PendingAppend& pending, const EncodeChunk& chunk,
                                              const AttentionQueries& queries, const AttentionOutput& output,
                                              const uint8_t** sink_table) const {
  return Problem(chunk.cache, pending.transform.get(), pending.sinks.empty() ? sinks_.get() : &pending.sinks, queries,
                 output, sink_table);
}

}  // namespace turbokv
