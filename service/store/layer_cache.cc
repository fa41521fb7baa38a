#include "service/store/layer_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/thread_pool.h"

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

absl::StatusOr<int64_t> LayerCache::Append(int64_t start, int64_t n, const float* keys,
                                           const float* values) {
  absl::StatusOr<PendingAppend> pending = Prepare(start, n);
  if (!pending.ok()) return pending.status();
  return Commit(*std::move(pending), keys, values);
}

int64_t LayerCache::Commit(PendingAppend pending, const float* keys, const float* values, ThreadPool* pool,
                           EncodeStats* key_errors, EncodeStats* value_errors) {
  const int64_t start = pending.start;
  const int64_t end = pending.end;
  if (end <= tokens_) return tokens_;
  std::vector<std::shared_ptr<Page>>& fresh = pending.pages;
  size_t next = 0;
  if (pending.copy_last) {
    std::memcpy(fresh[0]->data, pages_.back()->data, page_bytes_);
    pages_.back() = fresh[next++];
    page_pointers_.back() = pages_.back()->data;
  }
  for (; next < fresh.size(); ++next) {
    pages_.push_back(fresh[next]);
    page_pointers_.push_back(pages_.back()->data);
  }

  // Encode the new tokens: one work item per run of consecutive slots in a
  // page and kv head; items write disjoint bytes, so they run in parallel.
  struct Run {
    int64_t first;  // token
    int64_t page, slot, length;
    int head;
  };
  std::vector<Run> runs;
  for (int64_t t = tokens_; t < end;) {
    const int64_t slot = t % page_tokens_;
    const int64_t length = std::min<int64_t>(end - t, page_tokens_ - slot);
    for (int h = 0; h < kv_heads_; ++h) runs.push_back(Run{t, t / page_tokens_, slot, length, h});
    t += length;
  }
  const PagedKvCache d = Descriptor();
  const size_t dim = static_cast<size_t>(key_codec_->layout().head_dim);
  // Each run's errors apart (runs encode in parallel), summed after.
  const bool errors = key_errors != nullptr || value_errors != nullptr;
  std::vector<EncodeStats> run_errors(errors ? 2 * runs.size() : 0);
  auto encode = [&](int64_t i) {
    const Run& r = runs[static_cast<size_t>(i)];
    std::vector<float> k_run(static_cast<size_t>(r.length) * dim), v_run(k_run.size());
    for (int64_t j = 0; j < r.length; ++j) {
      const size_t src = (static_cast<size_t>(r.first - start + j) * kv_heads_ + r.head) * dim;
      std::memcpy(&k_run[j * dim], keys + src, dim * sizeof(float));
      std::memcpy(&v_run[j * dim], values + src, dim * sizeof(float));
    }
    uint8_t* base = pages_[r.page]->data;
    key_codec_->Encode(r.length, k_run.data(), base + d.key_offset(r.head, r.slot),
                       errors ? &run_errors[2 * i] : nullptr);
    value_codec_->Encode(r.length, v_run.data(), base + d.value_offset(r.head, r.slot),
                         errors ? &run_errors[2 * i + 1] : nullptr);
  };
  if (pool != nullptr && runs.size() > 1) {
    pool->ParallelFor(static_cast<int64_t>(runs.size()), encode);
  } else {
    for (size_t i = 0; i < runs.size(); ++i) encode(static_cast<int64_t>(i));
  }
  for (size_t i = 0; i < run_errors.size(); i += 2) {
    if (key_errors != nullptr) key_errors->Add(run_errors[i]);
    if (value_errors != nullptr) value_errors->Add(run_errors[i + 1]);
  }
  tokens_ = end;
  return tokens_;
}

void LayerCache::Read(int64_t start, int64_t n, float* keys, float* values) const {
  const PagedKvCache d = Descriptor();
  const size_t dim = static_cast<size_t>(head_dim());
  for (int64_t t = start; t < start + n;) {
    const int64_t page = t / page_tokens_;
    const int64_t slot = t % page_tokens_;
    const int64_t run = std::min<int64_t>(start + n - t, page_tokens_ - slot);
    std::vector<float> k_run(static_cast<size_t>(run) * dim), v_run(k_run.size());
    for (int h = 0; h < kv_heads_; ++h) {
      const uint8_t* base = pages_[page]->data;
      key_codec_->Decode(run, base + d.key_offset(h, slot), k_run.data());
      value_codec_->Decode(run, base + d.value_offset(h, slot), v_run.data());
      for (int64_t i = 0; i < run; ++i) {
        const size_t dst = (static_cast<size_t>(t - start + i) * kv_heads_ + h) * dim;
        std::memcpy(keys + dst, &k_run[i * dim], dim * sizeof(float));
        std::memcpy(values + dst, &v_run[i * dim], dim * sizeof(float));
      }
    }
    t += run;
  }
}

absl::Status LayerCache::LoadPages(int64_t tokens, const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  if (tokens < 0 || !pages_.empty()) return absl::InvalidArgumentError("LoadPages needs an empty layer and tokens >= 0");
  const size_t count = static_cast<size_t>(tokens / page_tokens_ + (tokens % page_tokens_ != 0));
  std::vector<std::shared_ptr<Page>> loaded;
  loaded.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<std::shared_ptr<Page>> page = pool_->Allocate(page_bytes_);
    if (!page.ok()) return page.status();
    if (absl::Status filled = fill((*page)->data, page_bytes_); !filled.ok()) return filled;
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
