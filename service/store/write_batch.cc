#include "service/store/write_batch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "service/status_macros.h"

namespace turbokv {

WriteBatch::WriteBatch(SessionStore& store, absl::Span<const SessionCache* const> held)
    : store_(store), held_(held.begin(), held.end()) {}

absl::StatusOr<size_t> WriteBatch::Add(SessionCache& session, absl::Span<const int> layers, int64_t start, int64_t n,
                                       const float* keys, const float* values, const float* queries) {
  for (int l : layers) {
    const int64_t tokens = session.layers()[l].tokens();
    if (start > tokens) {
      return absl::FailedPreconditionError(absl::StrCat("start = ", start, " but layer ", l, " holds ", tokens,
                                                        " tokens: positions ", tokens, " to ", start - 1,
                                                        " are missing"));
    }
  }
  // Another session can take the room MakeRoom made before our pages are
  // taken; try a few times before giving up.
  std::vector<LayerCache::PendingAppend> pending;
  absl::Status status;
  for (int attempt = 0; attempt < 3; ++attempt) {
    pending.clear();  // a failed attempt's pages go back before room is made again
    status = absl::OkStatus();
    size_t bytes = 0;
    for (int l : layers) bytes += session.layers()[l].BytesToAppend(start, n);
    TURBOKV_RETURN_IF_ERROR(store_.MakeRoom(bytes, held_));
    for (int l : layers) {
      absl::StatusOr<LayerCache::PendingAppend> one = session.layers()[l].Prepare(start, n);
      if (!one.ok()) {
        status = one.status();
        break;
      }
      pending.push_back(*std::move(one));
    }
    if (!absl::IsResourceExhausted(status)) break;
  }
  TURBOKV_RETURN_IF_ERROR(status);
  const SessionConfig& config = session.config();
  const size_t layer_values = static_cast<size_t>(n) * config.kv_heads * config.head_dim;
  const size_t layer_queries = static_cast<size_t>(n) * config.q_heads * config.head_dim;
  const size_t first = writes_.size();
  adds_.push_back(first);
  for (size_t i = 0; i < layers.size(); ++i) {
    Write write;
    write.session = &session;
    write.layer = layers[i];
    write.pending = std::move(pending[i]);
    write.keys = keys + i * layer_values;
    write.values = values + i * layer_values;
    write.queries = queries != nullptr ? queries + i * layer_queries : nullptr;
    writes_.push_back(std::move(write));
  }
  return first;
}

absl::Span<const EncodeChunk> WriteBatch::Jobs() {
  if (prepared_) return chunks_;
  prepared_ = true;
  tables_.resize(writes_.size());
  sink_tables_.resize(writes_.size());
  chunk_of_.assign(writes_.size(), SIZE_MAX);
  for (size_t w = 0; w < writes_.size(); ++w) {
    Write& write = writes_[w];
    const LayerCache& layer = write.session->layers()[write.layer];
    if (!layer.HasNew(write.pending)) continue;
    EncodeChunk chunk = layer.Chunk(&write.pending, write.keys, write.values, write.queries,
                                    write.session->config().q_heads, &tables_[w]);
    chunk.key_errors = &write.key_errors;
    chunk.value_errors = &write.value_errors;
    chunk_of_[w] = chunks_.size();
    chunks_.push_back(chunk);
  }
  return chunks_;
}

AttentionProblem WriteBatch::Attention(size_t w, const AttentionQueries& queries, const AttentionOutput& output) {
  const Write& write = writes_[w];
  const LayerCache& layer = write.session->layers()[write.layer];
  if (chunk_of_[w] == SIZE_MAX) return layer.Attention(queries, output);
  return layer.PendingAttention(write.pending, chunks_[chunk_of_[w]], queries, output, &sink_tables_[w]);
}

void WriteBatch::Apply() {
  for (Write& write : writes_) {
    LayerCache& layer = write.session->layers()[write.layer];
    write.before = layer.tokens();
    write.after = layer.Apply(std::move(write.pending), &write.undo);
    SessionCache::LayerErrors& errors = write.session->errors()[write.layer];
    errors.keys.Add(write.key_errors);
    errors.values.Add(write.value_errors);
  }
}

void WriteBatch::Undo() {
  for (auto write = writes_.rbegin(); write != writes_.rend(); ++write) {
    write->session->layers()[write->layer].Restore(write->undo);
  }
}

std::vector<absl::Status> WriteBatch::Commit() {
  std::vector<std::vector<Residency::LayerGrowth>> growth(adds_.size());
  for (size_t a = 0; a < adds_.size(); ++a) {
    for (size_t w = adds_[a]; w < AddEnd(a); ++w) growth[a].push_back({writes_[w].layer, writes_[w].undo});
  }
  std::vector<absl::StatusOr<Residency::TierWrites>> queued;
  for (size_t a = 0; a < adds_.size(); ++a) {
    queued.push_back(store_.residency().QueueNewTokens(*writes_[adds_[a]].session, growth[a]));
  }
  std::vector<absl::Status> status(writes_.size());
  for (size_t a = 0; a < adds_.size(); ++a) {
    const absl::Status add = store_.residency().AwaitNewTokens(*writes_[adds_[a]].session, growth[a], queued[a]);
    for (size_t w = adds_[a]; w < AddEnd(a); ++w) status[w] = add;
  }
  return status;
}

}  // namespace turbokv
