#include "service/store/layer_cache.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "service/backend/backend.h"

namespace turbokv {

size_t HoldChargeBytes(int kv_heads, int head_dim, int sink_tokens, int hold_tokens, CodecKind sink_codec) {
  return static_cast<size_t>(hold_tokens - sink_tokens) * kv_heads * 2 * MakeCodecLayout(sink_codec, head_dim).code_size();
}

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
                  (key_codec_->code_size() + value_codec_->code_size())),
      order_(pool_ != nullptr ? pool_->backend().NativeOrder(key_codec_->layout(), value_codec_->layout(), page_tokens)
                              : PageOrder::kCanonical) {
  if (storage_.sink_codec != nullptr) sinks_ = std::make_shared<const std::string>(SinkPageBytes(SinkSlots(0)), '\0');
}

int HoldTokens(const KeyTransformOptions& transform, int page_tokens, int sink_tokens) {
  const int hold = static_cast<int>(std::min<int64_t>(page_tokens - 1, kMaxFewTokens));
  return transform.center_keys && hold - sink_tokens >= kMinTransformTokens ? hold : 0;
}

int64_t LayerCache::exact_tokens() const {
  return Holds(tokens_) ? tokens_ : std::min<int64_t>(tokens_, storage_.sink_tokens);
}

bool LayerCache::Holds(int64_t end) const {
  return !transform_fixed_ && storage_.hold_tokens > 0 && end <= storage_.hold_tokens;
}

bool LayerCache::Refits(int64_t end) const {
  return !transform_fixed_ && storage_.hold_tokens > 0 && end > storage_.hold_tokens &&
         tokens_ > storage_.sink_tokens;
}

int LayerCache::SinkSlots(int64_t tokens) const {
  return tokens > storage_.sink_tokens ? storage_.hold_tokens : storage_.sink_tokens;
}

size_t LayerCache::SinkPageBytes(int slots) const {
  return static_cast<size_t>(kv_heads_) * slots * 2 * storage_.sink_codec->code_size();
}

std::string LayerCache::SinkPageCopy(const std::string& page, int64_t tokens, int slots) const {
  const size_t slot = storage_.sink_codec->code_size();
  const size_t from_slots = page.size() / (static_cast<size_t>(kv_heads_) * 2 * slot);
  std::string copy(SinkPageBytes(slots), '\0');
  for (size_t region = 0; region < static_cast<size_t>(kv_heads_) * 2; ++region) {
    std::copy_n(page.begin() + region * from_slots * slot, tokens * slot, copy.begin() + region * slots * slot);
  }
  return copy;
}

PagedKvCache LayerCache::SinkDescriptor(const std::string& page, int64_t tokens, const uint8_t** table) const {
  PagedKvCache d;
  d.key_layout = storage_.sink_codec->layout();
  d.value_layout = d.key_layout;
  d.kv_heads = kv_heads_;
  d.page_tokens = static_cast<int>(page.size() / (static_cast<size_t>(kv_heads_) * 2 * storage_.sink_codec->code_size()));
  d.tokens = tokens;
  *table = reinterpret_cast<const uint8_t*>(page.data());
  d.pages = table;
  return d;
}

bool LayerCache::CopiesLast(int64_t end) const {
  // A refit rewrites the first page's held positions: in a copy, so that a
  // failed chunk leaves the page as it was.
  return tokens_ % page_tokens_ != 0 && (pages_.back().use_count() > 1 || Refits(end));
}

bool LayerCache::ChargesHold(int64_t end) const {
  // A new wide sink page, while the old one stays with a fork (or was narrow).
  return Holds(end) && end > storage_.sink_tokens && !(hold_charge_ != nullptr && sinks_.use_count() == 1);
}

size_t LayerCache::BytesToAppend(int64_t start, int64_t n) const {
  const int64_t end = start + n;
  if (end <= tokens_) return 0;
  const size_t pages_needed = static_cast<size_t>((end + page_tokens_ - 1) / page_tokens_);
  return (pages_needed - pages_.size() + (CopiesLast(end) ? 1 : 0)) * page_bytes_ +
         (ChargesHold(end) ? hold_charge_bytes() : 0);
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
  pending.copy_last = CopiesLast(pending.end);
  if (ChargesHold(pending.end)) {
    absl::StatusOr<std::shared_ptr<const void>> charge = pool_->Charge(hold_charge_bytes());
    if (!charge.ok()) return charge.status();
    pending.hold_charge = *std::move(charge);
  }
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
  const size_t q_row = static_cast<size_t>(q_heads) * head_dim();
  const size_t skipped = static_cast<size_t>(tokens_ - pending.start);
  const float* new_keys = keys + skipped * row;
  const float* new_values = values + skipped * row;
  const int64_t sinks = storage_.sink_tokens;
  // Tokens kept in the sink page once the chunk is stored, and the first
  // one the pages hold through the codecs: past the sinks, and for a refit
  // from the first token past them (held exact until now).
  const bool refits = Refits(pending.end);
  const int64_t exact_end = Holds(pending.end) ? pending.end : std::min(pending.end, sinks);
  const int64_t main_begin = refits ? sinks : std::max(tokens_, exact_end);
  if (tokens_ < exact_end || exact_end < exact_tokens()) {
    // The chunk's exact tokens, into a copy of the sink page (narrowed to
    // the sinks once it holds only them).
    pending.new_sinks = true;
    pending.sinks = SinkPageCopy(*sinks_, std::min(exact_tokens(), exact_end), SinkSlots(exact_end));
    if (tokens_ < exact_end) {
      EncodeChunk exact;
      exact.key_codec = storage_.sink_codec.get();
      exact.value_codec = storage_.sink_codec.get();
      const uint8_t* sink_table = nullptr;
      exact.cache = SinkDescriptor(pending.sinks, exact_end, &sink_table);
      exact.first = tokens_;
      exact.keys = new_keys;
      exact.values = new_values;
      EncodeChunkCpu(exact, nullptr);
    }
  }
  // What the pages get from main_begin on: the tokens held before, read
  // back from the sink page, then the chunk's.
  const int64_t fresh = pending.end - main_begin;
  const size_t held = static_cast<size_t>(std::max<int64_t>(tokens_ - main_begin, 0));
  const size_t chunk_offset = static_cast<size_t>(std::max<int64_t>(main_begin - tokens_, 0));
  pending.transform = transform_;
  if (!transform_fixed_ && main_begin < pending.end) {
    // Without refit the chunk's own rows; with one, its rows after the held ones.
    std::vector<float> fit_keys, fit_values;
    const float* fit_k = new_keys + chunk_offset * row;
    const float* fit_v = new_values + chunk_offset * row;
    if (held > 0) {
      fit_keys.resize(static_cast<size_t>(fresh) * row);
      fit_values.resize(fit_keys.size());
      const uint8_t* sink_table = nullptr;
      DecodeCpu(*storage_.sink_codec, *storage_.sink_codec, SinkDescriptor(*sinks_, tokens_, &sink_table), main_begin,
                static_cast<int64_t>(held), fit_keys.data(), fit_values.data());
      std::copy_n(new_keys, (pending.end - tokens_) * row, fit_keys.begin() + held * row);
      std::copy_n(new_values, (pending.end - tokens_) * row, fit_values.begin() + held * row);
      fit_k = fit_keys.data();
      fit_v = fit_values.data();
    }
    // Queries come with the chunk's tokens only: those of a chunk of fewer
    // than kMinTransformTokens (a decoding step's one) would weigh the
    // channels by too few samples, and the keys' spread alone is used.
    const int64_t with_queries = fresh - static_cast<int64_t>(held);
    KeyTransform fitted = FitKeyTransform(
        storage_.transform, fresh, kv_heads_, head_dim(), fit_k, fit_v, q_heads,
        queries != nullptr && with_queries >= kMinTransformTokens ? queries + (skipped + chunk_offset) * q_row : nullptr,
        with_queries);
    pending.transform = fitted.empty() ? nullptr : std::make_shared<const KeyTransform>(std::move(fitted));
    pending.fixes_transform = true;
    if (held > 0) {
      pending.keys = std::move(fit_keys);
      pending.values = std::move(fit_values);
    }
  }
  if (held == 0 && (tokens_ < exact_end || pending.transform != nullptr)) {
    // The pages get zeros at exact positions, the rest transformed.
    pending.keys.assign(new_keys, new_keys + (pending.end - tokens_) * row);
    pending.values.assign(new_values, new_values + (pending.end - tokens_) * row);
    std::fill(pending.keys.begin(), pending.keys.begin() + chunk_offset * row, 0.0f);
    std::fill(pending.values.begin(), pending.values.begin() + chunk_offset * row, 0.0f);
  }
  const int64_t first = std::min(tokens_, main_begin);
  if (!pending.keys.empty()) {
    if (pending.transform != nullptr && main_begin < pending.end) {
      const size_t offset = static_cast<size_t>(main_begin - first);
      pending.transform->Apply(fresh, pending.keys.data() + offset * row, pending.values.data() + offset * row);
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
  chunk.cache.first_token = exact_end;
  chunk.first = first;
  chunk.keys = new_keys;
  chunk.values = new_values;
  return chunk;
}

int64_t LayerCache::Apply(PendingAppend pending, Undo* undo) {
  if (undo != nullptr) {
    *undo = Undo{tokens_, nullptr, sinks_, hold_charge_, transform_, transform_fixed_, transform_end_};
  }
  if (pending.end <= tokens_) return tokens_;
  size_t next = 0;
  if (pending.copy_last) {
    if (undo != nullptr) undo->last_page = pages_.back();
    pages_.back() = pending.pages[next++];
    page_pointers_.back() = pages_.back()->data;
  }
  for (; next < pending.pages.size(); ++next) {
    pages_.push_back(pending.pages[next]);
    page_pointers_.push_back(pages_.back()->data);
  }
  if (pending.new_sinks) {
    sinks_ = std::make_shared<const std::string>(std::move(pending.sinks));
    if (pending.hold_charge != nullptr) hold_charge_ = std::move(pending.hold_charge);
    if (sinks_->size() == SinkPageBytes(storage_.sink_tokens)) hold_charge_ = nullptr;
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

void LayerCache::Restore(Undo undo) {
  tokens_ = undo.tokens;
  const size_t keep = static_cast<size_t>((tokens_ + page_tokens_ - 1) / page_tokens_);
  pages_.resize(keep);
  page_pointers_.resize(keep);
  if (undo.last_page != nullptr) {
    pages_.back() = std::move(undo.last_page);
    page_pointers_.back() = pages_.back()->data;
  }
  if (sinks_ != undo.sinks || transform_fixed_ != undo.transform_fixed) ++extras_version_;
  sinks_ = std::move(undo.sinks);
  hold_charge_ = std::move(undo.hold_charge);
  transform_ = std::move(undo.transform);
  transform_fixed_ = undo.transform_fixed;
  transform_end_ = undo.transform_end;
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
  const int64_t sinks = exact_tokens();
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
  extras.sink_tokens = exact_tokens();
  // Slots past the tokens may hold a truncated layer's old ones: zeros.
  if (extras.sink_tokens > 0) extras.sinks = SinkPageCopy(*sinks_, extras.sink_tokens, SinkSlots(extras.sink_tokens));
  return extras;
}

absl::Status LayerCache::LoadPages(int64_t tokens, const LayerExtras& extras,
                                   const std::function<absl::Status(uint8_t*, size_t)>& fill) {
  if (tokens < 0 || !pages_.empty()) return absl::InvalidArgumentError("LoadPages needs an empty layer and tokens >= 0");
  // Held exact: every token of a layer whose transform is not fixed, up to hold_tokens.
  const bool holds = !extras.transform_fixed && storage_.hold_tokens > 0 && tokens <= storage_.hold_tokens;
  const int64_t exact = holds ? tokens : std::min<int64_t>(tokens, storage_.sink_tokens);
  if (extras.sink_tokens != exact ||
      (extras.sink_tokens > 0 && extras.sinks.size() != SinkPageBytes(SinkSlots(exact)))) {
    return absl::DataLossError(absl::StrCat("the layer's sink tokens (", extras.sink_tokens, " in ",
                                            extras.sinks.size(), " bytes) do not match its ", tokens,
                                            " tokens, ", storage_.sink_tokens, " sink slots and ",
                                            storage_.hold_tokens, " held until its transform is fitted"));
  }
  if (absl::Status checked = extras.transform.Check(kv_heads_, head_dim()); !checked.ok()) {
    return absl::DataLossError(absl::StrCat("the layer's ", checked.message()));
  }
  if (!extras.transform.empty() && !extras.transform_fixed) {
    return absl::DataLossError("the layer's key transform is not marked fixed");
  }
  if (tokens > storage_.sink_tokens && !extras.transform_fixed && storage_.transform.any() && !holds) {
    return absl::DataLossError("the layer's key transform is missing: its pages cannot be read back");
  }
  std::shared_ptr<const void> hold_charge;
  if (exact > storage_.sink_tokens) {
    absl::StatusOr<std::shared_ptr<const void>> charge =
        pool_->Charge(hold_charge_bytes());
    if (!charge.ok()) return charge.status();
    hold_charge = *std::move(charge);
  }
  const size_t count = static_cast<size_t>(tokens / page_tokens_ + (tokens % page_tokens_ != 0));
  std::vector<std::shared_ptr<Page>> loaded;
  loaded.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<std::shared_ptr<Page>> page = pool_->Allocate(page_bytes_);
    if (!page.ok()) return page.status();
    if (absl::Status filled = pool_->backend().WritePage(page_format(), (*page)->data, fill); !filled.ok()) {
      return filled;
    }
    loaded.push_back(*std::move(page));
  }
  pages_ = std::move(loaded);
  for (const std::shared_ptr<Page>& page : pages_) page_pointers_.push_back(page->data);
  tokens_ = tokens;
  if (extras.sink_tokens > 0) sinks_ = std::make_shared<const std::string>(extras.sinks);
  hold_charge_ = std::move(hold_charge);
  transform_fixed_ = extras.transform_fixed;
  transform_end_ = transform_fixed_ ? tokens : 0;
  if (!extras.transform.empty()) transform_ = std::make_shared<const KeyTransform>(extras.transform);
  ++extras_version_;
  return absl::OkStatus();
}

void LayerCache::Truncate(int64_t n) {
  const int64_t exact_before = exact_tokens();
  tokens_ = std::min(tokens_, std::max<int64_t>(n, 0));
  const size_t keep = static_cast<size_t>((tokens_ + page_tokens_ - 1) / page_tokens_);
  pages_.resize(keep);
  page_pointers_.resize(keep);
  bool changed = false;
  if (transform_fixed_ && tokens_ < transform_end_) transform_end_ = kNeverReused;
  if (tokens_ <= storage_.sink_tokens && transform_fixed_) {
    // With no token past the sinks left, the next chunk fits a new transform.
    transform_fixed_ = false;
    transform_ = nullptr;
    transform_end_ = 0;
    changed = true;
  }
  // Cut back to its sinks, the sink page holds zeros past the tokens again,
  // as in a fresh layer (a copy: forks may share the page). Cut back within
  // tokens held past them, it stays as it is: the slots past the tokens are
  // never read, and a chunk or Extras() copies only the tokens.
  const int64_t exact = exact_tokens();
  if (exact < exact_before && exact <= storage_.sink_tokens) {
    sinks_ = std::make_shared<const std::string>(SinkPageCopy(*sinks_, exact, storage_.sink_tokens));
    hold_charge_ = nullptr;
    changed = true;
  } else if (exact < exact_before) {
    changed = true;
  }
  if (changed) ++extras_version_;
}

LayerCache LayerCache::Fork(int64_t prefix) const {
  LayerCache fork(key_codec_, value_codec_, kv_heads_, page_tokens_, pool_, storage_);
  fork.tokens_ = tokens_;
  fork.pages_ = pages_;
  fork.page_pointers_ = page_pointers_;
  fork.sinks_ = sinks_;
  fork.hold_charge_ = hold_charge_;
  fork.transform_fixed_ = transform_fixed_;
  fork.transform_ = transform_;
  fork.transform_end_ = transform_end_;
  fork.Truncate(prefix);  // pages, sink slots and transform as a layer of that length holds them
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
  d.first_token = exact_tokens();
  d.pages = page_pointers_.data();
  d.order = order_;
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
  return Problem(chunk.cache, pending.transform.get(), pending.new_sinks ? &pending.sinks : sinks_.get(), queries,
                 output, sink_table);
}

}  // namespace turbokv
