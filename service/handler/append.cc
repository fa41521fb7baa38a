// Append: chunks of tokens stored whole or not at all, and the chunk
// storage that Step and Decode share.
#include "service/handler/handler.h"

#include <algorithm>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/error_side.h"
#include "service/handler/common.h"
#include "service/status_macros.h"
#include "service/tensor.h"

namespace turbokv {

absl::StatusOr<std::vector<LayerCache::PendingAppend>> Handler::PrepareAppend(
    SessionCache& session, const std::vector<int>& layers, int64_t start, int64_t n,
    absl::Span<const SessionCache* const> held) {
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
  absl::Status status;
  for (int attempt = 0; attempt < 3; ++attempt) {
    size_t bytes = 0;
    for (int l : layers) bytes += session.layers()[l].BytesToAppend(start, n);
    TURBOKV_RETURN_IF_ERROR(store_->MakeRoom(bytes, held));
    std::vector<LayerCache::PendingAppend> pending;
    for (int l : layers) {
      absl::StatusOr<LayerCache::PendingAppend> one = session.layers()[l].Prepare(start, n);
      if (!one.ok()) {
        status = one.status();
        break;
      }
      pending.push_back(*std::move(one));
    }
    if (status.ok()) return pending;
    if (!absl::IsResourceExhausted(status)) return status;
  }
  return status;
}

Handler::ChunkWrite Handler::WriteOf(SessionCache& session, int l, LayerCache::PendingAppend pending,
                                     const float* keys, const float* values, const float* queries) {
  ChunkWrite write;
  write.layer = &session.layers()[l];
  write.pending = std::move(pending);
  write.keys = keys;
  write.values = values;
  write.queries = queries;
  write.q_heads = session.config().q_heads;
  write.key_codec = session.config().KeyCodec(l);
  write.value_codec = session.config().ValueCodec(l);
  write.errors = &session.errors()[l];
  return write;
}

Handler::EncodeJobs Handler::PrepareChunks(std::vector<ChunkWrite>& writes) {
  EncodeJobs jobs;
  jobs.errors.resize(writes.size());
  jobs.tables.resize(writes.size());
  jobs.chunk_of.assign(writes.size(), SIZE_MAX);
  for (size_t i = 0; i < writes.size(); ++i) {
    ChunkWrite& write = writes[i];
    if (!write.layer->HasNew(write.pending)) continue;
    EncodeChunk chunk =
        write.layer->Chunk(&write.pending, write.keys, write.values, write.queries, write.q_heads, &jobs.tables[i]);
    chunk.key_errors = &jobs.errors[i].keys;
    chunk.value_errors = &jobs.errors[i].values;
    jobs.chunk_of[i] = jobs.chunks.size();
    jobs.chunks.push_back(chunk);
  }
  return jobs;
}

void Handler::ApplyChunks(std::vector<ChunkWrite>& writes, const EncodeJobs& jobs) {
  int64_t new_token_layers = 0;
  for (size_t i = 0; i < writes.size(); ++i) {
    ChunkWrite& write = writes[i];
    write.before = write.layer->tokens();
    write.after = write.layer->Apply(std::move(write.pending), &write.undo);
    new_token_layers += write.after - write.before;
    write.errors->keys.Add(jobs.errors[i].keys);
    write.errors->values.Add(jobs.errors[i].values);
  }
  if (options_.metrics != nullptr) {
    options_.metrics->AddAppendedTokens(new_token_layers);
    for (size_t i = 0; i < writes.size(); ++i) {
      options_.metrics->ObserveQuantization(writes[i].key_codec, KvKind::kKey, jobs.errors[i].keys);
      options_.metrics->ObserveQuantization(writes[i].value_codec, KvKind::kValue, jobs.errors[i].values);
    }
  }
}

absl::Status Handler::CommitChunks(std::vector<ChunkWrite>& writes) {
  // Every chunk with new tokens is one job of a single encode on the
  // backend; the layers change only once all of them are encoded.
  const EncodeJobs jobs = PrepareChunks(writes);
  const absl::Time encode_start = absl::Now();
  TURBOKV_RETURN_IF_ERROR(store_->backend().Encode(jobs.chunks));
  if (options_.metrics != nullptr) {
    options_.metrics->ObserveKernel(KernelOp::kEncode, absl::ToDoubleSeconds(absl::Now() - encode_start));
  }
  ApplyChunks(writes, jobs);
  return absl::OkStatus();
}

absl::StatusOr<Handler::StoredChunk> Handler::StoreChunk(SessionCache& session, const std::vector<int>& layers,
                                                        int64_t start, int64_t n, const float* keys,
                                                        const float* values, const float* queries) {
  const SessionConfig& config = session.config();
  TURBOKV_RETURN_IF_ERROR(CheckStorable(config, KvPart::kKeys, keys, layers, start, n, "keys"));
  TURBOKV_RETURN_IF_ERROR(CheckStorable(config, KvPart::kValues, values, layers, start, n, "values"));
  const SessionCache* held[] = {&session};
  TURBOKV_ASSIGN_OR_RETURN(std::vector<LayerCache::PendingAppend> pending,
                           PrepareAppend(session, layers, start, n, held));
  const size_t layer_values = static_cast<size_t>(n) * config.kv_heads * config.head_dim;
  const size_t layer_queries = static_cast<size_t>(n) * config.q_heads * config.head_dim;
  std::vector<ChunkWrite> writes(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    writes[i] = WriteOf(session, layers[i], std::move(pending[i]), keys + i * layer_values, values + i * layer_values,
                        queries != nullptr ? queries + i * layer_queries : nullptr);
  }
  TURBOKV_RETURN_IF_ERROR(CommitChunks(writes));
  StoredChunk chunk;
  for (const ChunkWrite& write : writes) {
    chunk.before.push_back(write.before);
    chunk.after.push_back(write.after);
    chunk.undo.push_back(write.undo);
  }
  return chunk;
}

absl::Status Handler::Persist(SessionCache& session, const std::vector<int>& layers, const StoredChunk& chunk) {
  std::vector<SessionStore::LayerGrowth> growth;
  for (size_t i = 0; i < layers.size(); ++i) growth.push_back({layers[i], chunk.undo[i]});
  return store_->AwaitNewTokens(session, growth, store_->QueueNewTokens(session, growth));
}

int64_t Handler::ReplyBytes(const v1::AppendRequest& /*request*/) {
  return 0;  // two integers: nothing to count
}

absl::StatusOr<v1::AppendResponse> Handler::Append(const v1::AppendRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> found, FindLocked(request.session_id(), tenant, &lock));
  SessionCache& session = *found;
  const SessionConfig& config = session.config();
  std::vector<int> layers;
  int rank = 3;
  switch (request.target_case()) {
    case v1::AppendRequest::kLayer: {
      TURBOKV_RETURN_IF_ERROR(CheckLayer(config, request.layer(), "layer"));
      layers.push_back(request.layer());
      break;
    }
    case v1::AppendRequest::kAllLayers:
      if (!request.all_layers()) return absl::InvalidArgumentError("all_layers is set to false: set layer or all_layers = true");
      for (int l = 0; l < config.layers; ++l) layers.push_back(l);
      rank = 4;
      break;
    default: return absl::InvalidArgumentError("neither layer nor all_layers is set");
  }
  if (request.start() < 0) return absl::InvalidArgumentError(absl::StrCat("start = ", request.start(), " must be >= 0"));
  if (request.keys().shape_size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("keys.shape has ", request.keys().shape_size(), " dimensions, expected ", rank,
                                                   rank == 3 ? ": [tokens][kv_heads][head_dim]"
                                                             : ": [layers][tokens][kv_heads][head_dim]"));
  }
  const int64_t n = request.keys().shape(rank - 3);
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("keys.shape gives ", n, " tokens, expected at least 1"));
  if (n > config.max_tokens || request.start() > config.max_tokens - n) {
    return CallerLimit(absl::ResourceExhaustedError(absl::StrCat("a chunk of ", n, " tokens at start = ", request.start(),
                                                                 " goes past the session's max_tokens = ",
                                                                 config.max_tokens)));
  }
  std::vector<int64_t> shape = {n, config.kv_heads, config.head_dim};
  if (rank == 4) shape.insert(shape.begin(), config.layers);
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> keys, InputFloats(options_.shared_memory, tenant, request.keys(), shape, "keys"));
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> values, InputFloats(options_.shared_memory, tenant, request.values(), shape, "values"));
  std::vector<float> queries;
  if (request.has_queries()) {
    std::vector<int64_t> query_shape = shape;
    query_shape[rank - 2] = config.q_heads;
    TURBOKV_ASSIGN_OR_RETURN(queries, InputFloats(options_.shared_memory, tenant, request.queries(), query_shape, "queries"));
  }

  TURBOKV_ASSIGN_OR_RETURN(StoredChunk chunk, StoreChunk(session, layers, request.start(), n, keys.data(),
                                                         values.data(), queries.empty() ? nullptr : queries.data()));
  TURBOKV_RETURN_IF_ERROR(Persist(session, layers, chunk));
  v1::AppendResponse response;
  response.set_start(request.start());
  int64_t tokens = INT64_MAX;
  int64_t stored = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    tokens = std::min(tokens, chunk.after[i]);
    stored = std::max(stored, chunk.after[i] - chunk.before[i]);
  }
  response.set_tokens(tokens);
  response.set_stored(stored);
  session.Touch(absl::Now());
  return response;
}

}  // namespace turbokv
