// One layer of one session: its keys and values in pages of a PagePool, laid
// out as the attention kernels read them (PagedKvCache, docs/FORMAT.md). The
// page list, fork sharing and truncation are the same for every backend; the
// bytes are written and read through the pool's backend.
//
// What the pages do not hold lives here too, in host memory (LayerExtras):
// the layer's key transform, fitted from the first chunk stored past its
// sink tokens and fixed from then on (the pages hold the transformed
// vectors), and its sink tokens, kept in their own codec in one small page
// (the main pages hold zeros at their positions). A layer with a transform
// to fit holds its first tokens there too, exact, for as long as they fit
// in its first page (LayerStorage::hold_tokens): a short prompt, or tokens
// decoded one by one from an empty session, are never stored through the
// codec as given (keys with a large shared component lose their
// differences there); the chunk that takes the layer past them fits the
// transform on all of them and encodes them into the pages.
// Not thread-safe: the session that owns it serializes access.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/key_transform.h"
#include "kernels/paged_cache.h"
#include "service/records/record_io.h"
#include "service/store/page_pool.h"

namespace turbokv {

// How a layer stores what its pages do not.
struct LayerStorage {
  KeyTransformOptions transform;  // what its transform fits (nothing: none)
  int sink_tokens = 0;            // at most page_tokens
  // Tokens a layer keeps in its sink page, exact, until a chunk takes it
  // past them and fits its transform (HoldTokens); 0: none.
  int hold_tokens = 0;
  // Of the sink page's keys and values, when sink_tokens > 0 or hold_tokens > 0.
  std::shared_ptr<const Codec> sink_codec;
};

// The tokens a layer of `page_tokens`-token pages with `sink_tokens` sinks
// holds exact before its transform is fitted: those of its first page but
// the last (a sealed page never changes), at most kMaxFewTokens (the sink
// page is attended as a few tokens), and 0 when the transform would be
// fitted on fewer than kMinTransformTokens past the sinks or keys are not
// transformed (values alone centered need no holding: keys are stored as
// given, as asked).
int HoldTokens(const KeyTransformOptions& transform, int page_tokens, int sink_tokens);

// The charge of a layer's sink page widened from sink_tokens to
// hold_tokens slots (LayerCache::hold_charge).
size_t HoldChargeBytes(int kv_heads, int head_dim, int sink_tokens, int hold_tokens, CodecKind sink_codec);

class LayerCache {
 public:
  // key_codec and value_codec share head_dim; page_tokens > 0, kv_heads > 0.
  LayerCache(std::shared_ptr<const Codec> key_codec, std::shared_ptr<const Codec> value_codec,
             int kv_heads, int page_tokens, PagePool* pool, LayerStorage storage = {});

  int64_t tokens() const { return tokens_; }
  // Bytes of the pages this layer holds (pages shared with forks count here too).
  size_t bytes() const { return pages_.size() * page_bytes_; }
  size_t page_bytes() const { return page_bytes_; }
  // Where its pages' slots lie.
  SlotShape slots() const {
    return SlotShape{kv_heads_, page_tokens_, static_cast<int32_t>(key_codec_->layout().code_size()),
                     static_cast<int32_t>(value_codec_->layout().code_size())};
  }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return key_codec_->layout().head_dim; }
  // Its pages' codecs, shape and the order the backend keeps them in.
  PageFormat page_format() const {
    return PageFormat{key_codec_->layout(), value_codec_->layout(), kv_heads_, page_tokens_, order_};
  }

  // The pages a chunk needs, taken from the pool and not yet used: Commit
  // applies them, dropping them gives them back.
  struct PendingAppend {
    int64_t start = 0;
    int64_t end = 0;
    bool copy_last = false;  // the shared, partly filled last page is replaced by a copy
    std::vector<std::shared_ptr<Page>> pages;
    // Set by Chunk: the transform this chunk fixes (fixes_transform), the
    // sink page with this chunk's sink tokens (when it has some), and what
    // the pages get when it is not the input as given.
    bool fixes_transform = false;
    std::shared_ptr<const KeyTransform> transform;
    bool new_sinks = false;  // the layer's sink page becomes `sinks`
    std::string sinks;
    std::vector<float> keys, values;
    // Set by Prepare: the budget's charge of a sink page widened to hold
    // tokens past the sinks (null: none needed, or the layer's own goes on).
    std::shared_ptr<const void> hold_charge;
  };

  // Bytes a chunk of tokens [start, start + n) would take from the pool
  // (0 for repeated positions): its pages, a copy of the partly filled last
  // page, a widened sink page's charge, as Prepare takes them. Assumes
  // start <= tokens().
  size_t BytesToAppend(int64_t start, int64_t n) const;

  // Checks a chunk of tokens [start, start + n) and takes the pages it needs.
  // A chunk that starts past the end is FAILED_PRECONDITION; RESOURCE_EXHAUSTED
  // when the budget is short (for its pages, or a sink page widened to hold
  // its tokens). Changes nothing.
  absl::StatusOr<PendingAppend> Prepare(int64_t start, int64_t n) const;

  // Whether a prepared chunk has tokens to store (not all repeated positions).
  bool HasNew(const PendingAppend& pending) const { return pending.end > tokens_; }
  // The backend's job for a prepared chunk with new tokens (HasNew): keys
  // and values [n][kv_heads][head_dim] of positions [pending.start,
  // pending.end) on the host (and, when not null, their queries
  // [n][q_heads][head_dim], which a fitting transform may use); only the
  // positions past tokens() are encoded, into the chunk's own pages. Its
  // sink tokens (and tokens held exact) go into a copy of the sink page and
  // a transform is fitted when this chunk is the first past the sinks, or
  // the first past the tokens held (fitted on those too, which it encodes
  // into the pages from the first token past the sinks); both held in
  // *pending until Apply. *table holds the page addresses the job points to: keep
  // it, *pending and the layer unchanged, until the job is done.
  EncodeChunk Chunk(PendingAppend* pending, const float* keys, const float* values, const float* queries,
                    int q_heads, std::vector<const uint8_t*>* table) const;
  // What Apply replaced: Restore puts it back, exactly (a chunk applied and
  // then refused, because a tier would not hold it): the length, the last
  // page a copy replaced, the sink page with its charge and the transform.
  struct Undo {
    int64_t tokens = 0;
    std::shared_ptr<Page> last_page;  // when the chunk copied the partly filled last page
    std::shared_ptr<const std::string> sinks;
    std::shared_ptr<const void> hold_charge;
    std::shared_ptr<const KeyTransform> transform;
    bool transform_fixed = false;
    int64_t transform_end = 0;
  };
  // Installs a chunk whose job the backend has done: its pages and length,
  // its sink tokens and the transform it fixed. Idempotent by position (a
  // chunk of repeated positions changes nothing). Returns the new token
  // count; *undo, when not null, what to Restore to take it back.
  int64_t Apply(PendingAppend pending, Undo* undo = nullptr);
  // The layer as it was before the Apply that gave `undo`, with no other
  // change to the layer between the two.
  void Restore(Undo undo);

  // Prepare, encode on the pool's backend, Apply: the chunk is applied
  // whole or not at all.
  absl::StatusOr<int64_t> Append(int64_t start, int64_t n, const float* keys, const float* values,
                                 const float* queries = nullptr, int q_heads = 0);

  // Decodes tokens [start, start + n) (within tokens()) into host keys and
  // values [n][kv_heads][head_dim], on the pool's backend: the vectors as
  // they were given (transform undone, sink tokens from their page).
  absl::Status Read(int64_t start, int64_t n, float* keys, float* values) const;

  // The pages holding tokens() tokens, in order (what a snapshot stores:
  // each whole). A page's use_count() is its holders: this layer and forks.
  const std::vector<std::shared_ptr<Page>>& pages() const { return pages_; }
  // Fills an empty layer with `tokens` tokens: takes their pages from the
  // pool and has fill(data, page_bytes()) write each in order (what
  // pages() held), on the host (Backend::WritePage), and takes `extras`
  // (what Extras() gave). RESOURCE_EXHAUSTED when they do not fit; fill's
  // error stops it; DATA_LOSS when the extras do not fit the layer. On
  // error the layer stays empty.
  absl::Status LoadPages(int64_t tokens, const LayerExtras& extras,
                         const std::function<absl::Status(uint8_t*, size_t)>& fill);

  // The transform and sink tokens, as LoadPages takes them back.
  LayerExtras Extras() const;
  // The charge of its sink page widened to hold tokens (null: none), shared
  // with the forks that share the page, and its bytes.
  const std::shared_ptr<const void>& hold_charge() const { return hold_charge_; }
  size_t hold_charge_bytes() const {
    return HoldChargeBytes(kv_heads_, head_dim(), storage_.sink_tokens, storage_.hold_tokens,
                           storage_.sink_codec->spec().kind);
  }
  // Whether tokens past the sinks are stored through a fitted transform.
  bool transformed() const { return transform_ != nullptr; }
  // Tokens kept in the sink page: the sinks, or while the transform waits
  // for a chunk to fit it, every token held (LayerStorage::hold_tokens).
  int64_t exact_tokens() const;
  // The end of the chunk the transform was fitted on (0 while none is
  // fixed): the pages before it depend on every token up to it;
  // kNeverReused once cut back before it. Not kept by snapshots and tiers: a
  // layer loaded with a fixed transform says its length at load.
  int64_t transform_end() const { return transform_end_; }
  // Bumped whenever Extras() changes: a tier's manifest must hold the
  // current one before a page that depends on it.
  uint64_t extras_version() const { return extras_version_; }

  // Keeps the first n tokens (n <= tokens()) and releases the pages past them.
  void Truncate(int64_t n);

  // A new layer holding the first `prefix` tokens (prefix <= tokens()) by
  // sharing this layer's pages; a shared, partly filled last page is copied
  // by whichever side appends to it first.
  LayerCache Fork(int64_t prefix) const;

  // The pages as the kernels read them (sink positions zeros, first_token
  // past them); valid until the next change.
  PagedKvCache Descriptor() const;
  // A problem of attention over the whole layer (pages, transform and
  // sinks); valid until the next change.
  AttentionProblem Attention(const AttentionQueries& queries, const AttentionOutput& output) const;
  // The same over the layer as a prepared chunk leaves it, before Apply:
  // `chunk` is what Chunk gave for `pending` (its pages, length, sinks and
  // transform), for a backend that stores the chunk and then attends
  // (Backend::EncodeAndAttend). *sink_table points to the sink page: keep it,
  // the chunk's table and *pending until the problem is done.
  AttentionProblem PendingAttention(const PendingAppend& pending, const EncodeChunk& chunk,
                                    const AttentionQueries& queries, const AttentionOutput& output,
                                    const uint8_t** sink_table) const;

 private:
  // A sink page as the kernels read it, holding `tokens` tokens; *table
  // becomes its page table. Its slots: SinkSlots of what it was made for.
  PagedKvCache SinkDescriptor(const std::string& page, int64_t tokens, const uint8_t** table) const;
  // Slots of the sink page that holds `tokens` tokens: the sinks' (up to
  // them), else hold_tokens.
  int SinkSlots(int64_t tokens) const;
  size_t SinkPageBytes(int slots) const;
  // A sink page of `slots` slots with the first `tokens` tokens of `page`
  // and zeros after them.
  std::string SinkPageCopy(const std::string& page, int64_t tokens, int slots) const;
  // Whether the layer keeps all its tokens exact once it holds `end` tokens
  // (no transform fixed, and they fit in hold_tokens).
  bool Holds(int64_t end) const;
  // Whether a chunk ending at `end` fits the transform over tokens the
  // layer held exact before it: it encodes them into the pages too.
  bool Refits(int64_t end) const;
  // Whether a chunk ending at `end` replaces the partly filled last page by
  // a copy (shared with a fork, or rewritten by a refit), and whether it
  // needs a charge for a widened sink page of its own.
  bool CopiesLast(int64_t end) const;
  bool ChargesHold(int64_t end) const;
  // A problem over a layer: its pages (cache, whose first_token tokens are
  // sinks), stored through `transform`, and its sink tokens in *sink_page,
  // which *sink_table points to.
  AttentionProblem Problem(PagedKvCache cache, const KeyTransform* transform, const std::string* sink_page,
                           const AttentionQueries& queries, const AttentionOutput& output,
                           const uint8_t** sink_table) const;

  std::shared_ptr<const Codec> key_codec_;
  std::shared_ptr<const Codec> value_codec_;
  int kv_heads_;
  int page_tokens_;
  PagePool* pool_;
  LayerStorage storage_;
  size_t page_bytes_;
  PageOrder order_;  // the backend's for these codecs (Backend::NativeOrder)
  std::vector<std::shared_ptr<Page>> pages_;
  std::vector<const uint8_t*> page_pointers_;
  int64_t tokens_ = 0;
  bool transform_fixed_ = false;
  int64_t transform_end_ = 0;
  std::shared_ptr<const KeyTransform> transform_;  // shared with forks; null: as given
  // The sink page (storage_.sink_tokens slots), shared with forks: replaced,
  // never changed in place. Null without sink tokens or tokens to hold.
  // Tokens held past the sinks widen it to hold_tokens slots, which
  // hold_charge_ counts against the budget (shared with the forks that
  // share the page).
  std::shared_ptr<const std::string> sinks_;
  std::shared_ptr<const void> hold_charge_;
  // The sink page's table (one entry: sinks_'s bytes), set by each
  // descriptor that points to it.
  mutable const uint8_t* sink_pointer_ = nullptr;
  uint64_t extras_version_ = 0;
};

// Bytes of a layer's sink page and transform at most (what a session's
// metadata charge counts for each layer).
size_t LayerExtrasBytes(int kv_heads, int head_dim, int sink_tokens, CodecKind sink_codec);

}  // namespace turbokv
