// Attention calls: Attend, Step (append one token and attend) and Decode (a
// step for a whole batch of sessions). All run the kernels through RunBatch:
// a single session's call is a batch of one.
#include "service/handler/handler.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kernels/attention.h"
#include "service/error_side.h"
#include "service/handler/common.h"
#include "service/status_macros.h"
#include "service/tensor.h"

namespace turbokv {
namespace {

// Queries per item of a Decode message (draft tokens verified at once).
constexpr int64_t kMaxQueriesPerItem = 256;

// The bytes of the attention result of the queries in a tensor of `shape`
// (its last dimension head_dim, the others query rows) that travel in the
// reply, unchecked: a bad shape counts what it says, within reason. With the
// results in the caller's shared memory (output_to) only the top-k lists do.
template <typename Request>
double QueryResultBytes(const Request& request) {
  const auto& shape = request.queries().shape();
  if (shape.empty()) return 0;
  double rows = 1;
  for (int i = 0; i + 1 < shape.size(); ++i) rows *= static_cast<double>(std::max<int64_t>(shape[i], 0));
  const int64_t head_dim = std::max<int64_t>(shape[shape.size() - 1], 0);
  const int32_t top_k = std::max(request.options().top_k(), 0);
  const double per_row = request.has_output_to() ? ResultBytes(1, head_dim, top_k) - ResultBytes(1, head_dim, 0)
                                                 : ResultBytes(1, head_dim, top_k);
  const double bytes = rows * per_row;
  return bytes < 1e15 ? bytes : 1e15;  // and NaN (an overflowed shape times 0) counts as much
}

}  // namespace

int64_t Handler::ReplyBytes(const v1::AttendRequest& request) {
  return static_cast<int64_t>(QueryResultBytes(request));
}

int64_t Handler::ReplyBytes(const v1::DecodeRequest& request) {
  // And each item's length and status (its message at most a line).
  const double items = static_cast<double>(request.session_ids_size()) * 160;
  return static_cast<int64_t>(QueryResultBytes(request) + items);
}

absl::Status Handler::RunBatch(const std::vector<AttentionProblem>& problems, const AttentionParams& params,
                               int64_t queries, absl::Span<const EncodeChunk> new_tokens) {
  if (problems.empty() && new_tokens.empty()) return absl::OkStatus();
  const absl::Time start = absl::Now();
  TURBOKV_RETURN_IF_ERROR(store_->backend().EncodeAndAttend(
      new_tokens, AttentionBatch{problems.data(), static_cast<int64_t>(problems.size())}, params));
  if (options_.metrics != nullptr) {
    options_.metrics->ObserveKernel(KernelOp::kAttend, absl::ToDoubleSeconds(absl::Now() - start));
    options_.metrics->AddAttendedQueries(queries);
  }
  return absl::OkStatus();
}

template <typename Request>
absl::StatusOr<ResultSink> Handler::OpenResultSink(const Request& request, const std::string& tenant, int64_t n,
                                                   int q_heads, int head_dim) const {
  const size_t rows = static_cast<size_t>(n) * q_heads;
  const size_t bytes[] = {SharedResultBytes(rows * head_dim, v1::DTYPE_F32), SharedResultBytes(rows, v1::DTYPE_F32)};
  return ResultSink::Open(options_.shared_memory, tenant, request.has_output_to() ? &request.output_to() : nullptr,
                          bytes);
}

absl::Status Handler::RunAttention(const LayerCache& layer, const AttentionParams& params, int64_t n,
                                   const std::vector<float>& queries, const std::vector<int64_t>& positions,
                                   ResultSink& sink, v1::AttentionResult* result) {
  const int dim = layer.head_dim();
  std::vector<float> out(static_cast<size_t>(n) * params.q_heads * dim);
  std::vector<float> lse(static_cast<size_t>(n) * params.q_heads);
  const size_t top = static_cast<size_t>(n) * params.q_heads * params.top_k;
  std::vector<int64_t> top_tokens(top);
  std::vector<float> top_logits(top);
  const AttentionOutput output{out.data(), lse.data(), top ? top_tokens.data() : nullptr,
                               top ? top_logits.data() : nullptr};
  TURBOKV_RETURN_IF_ERROR(
      RunBatch({layer.Attention({n, queries.data(), positions.data()}, output)}, params, n));
  sink.Put(out, {n, params.q_heads, dim}, v1::DTYPE_F32, result->mutable_output());
  sink.Put(lse, {n, params.q_heads}, v1::DTYPE_F32, result->mutable_lse());
  result->mutable_top_k_tokens()->Assign(top_tokens.begin(), top_tokens.end());
  result->mutable_top_k_logits()->Assign(top_logits.begin(), top_logits.end());
  return absl::OkStatus();
}

absl::StatusOr<v1::AttendResponse> Handler::Attend(const v1::AttendRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session,
                           FindLockedLayer(request.session_id(), tenant, request.layer(), &lock));
  const SessionConfig& config = session->config();
  TURBOKV_ASSIGN_OR_RETURN(AttentionParams params, CheckOptions(config.q_heads, request.options()));
  if (request.queries().shape_size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape has ", request.queries().shape_size(),
                                                   " dimensions, expected 3: [queries][q_heads][head_dim]"));
  }
  const int64_t n = request.queries().shape(0);
  if (n < 1 || n > kMaxQueriesPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape gives ", n, " queries, expected 1 to ", kMaxQueriesPerCall));
  }
  TURBOKV_RETURN_IF_ERROR(CheckResultSize(n, config.q_heads, config.head_dim, params, options_.max_message_bytes));
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> queries,
                           InputFloats(options_.shared_memory, tenant, request.queries(), {n, config.q_heads, config.head_dim}, "queries"));
  TURBOKV_RETURN_IF_ERROR(CheckScoresFinite(params, queries, config.head_dim, "queries"));
  TURBOKV_ASSIGN_OR_RETURN(ResultSink sink, OpenResultSink(request, tenant, n, config.q_heads, config.head_dim));
  const LayerCache& layer = session->layers()[request.layer()];
  if (layer.tokens() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", request.layer(), " holds no tokens yet"));
  }
  std::vector<int64_t> positions(request.positions().begin(), request.positions().end());
  if (positions.empty()) {
    positions.assign(n, layer.tokens() - 1);
  } else if (static_cast<int64_t>(positions.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("positions has ", positions.size(), " entries for ", n, " queries"));
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("positions[", i, "] = ", positions[i], " must be >= 0"));
    }
    if (positions[i] >= layer.tokens()) {
      return absl::FailedPreconditionError(absl::StrCat("positions[", i, "] = ", positions[i], " is past the ",
                                                        layer.tokens(), " tokens of layer ", request.layer()));
    }
  }
  v1::AttendResponse response;
  TURBOKV_RETURN_IF_ERROR(RunAttention(layer, params, n, queries, positions, sink, response.mutable_result()));
  session->Touch(absl::Now());
  return response;
}

absl::StatusOr<v1::StepResponse> Handler::Step(const v1::StepRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session,
                           FindLockedLayer(request.session_id(), tenant, request.layer(), &lock));
  const SessionConfig& config = session->config();
  TURBOKV_ASSIGN_OR_RETURN(AttentionParams params, CheckOptions(config.q_heads, request.options()));
  if (request.position() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("position = ", request.position(), " must be >= 0"));
  }
  if (request.position() >= config.max_tokens) {
    return CallerLimit(absl::ResourceExhaustedError(
        absl::StrCat("position = ", request.position(), " is past the session's max_tokens = ", config.max_tokens)));
  }
  TURBOKV_RETURN_IF_ERROR(CheckResultSize(1, config.q_heads, config.head_dim, params, options_.max_message_bytes));
  const std::vector<int64_t> kv_shape = {1, config.kv_heads, config.head_dim};
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> key, InputFloats(options_.shared_memory, tenant, request.key(), kv_shape, "key"));
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> value, InputFloats(options_.shared_memory, tenant, request.value(), kv_shape, "value"));
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> query,
                           InputFloats(options_.shared_memory, tenant, request.query(), {1, config.q_heads, config.head_dim}, "query"));
  TURBOKV_RETURN_IF_ERROR(CheckScoresFinite(params, query, config.head_dim, "query"));
  TURBOKV_ASSIGN_OR_RETURN(ResultSink sink, OpenResultSink(request, tenant, 1, config.q_heads, config.head_dim));

  TURBOKV_RETURN_IF_ERROR(
      CheckKvStorable(config, key.data(), value.data(), {request.layer()}, request.position(), 1, "keys", "values"));
  const SessionCache* held[] = {session.get()};
  WriteBatch batch(*store_, held);
  TURBOKV_RETURN_IF_ERROR(
      batch.Add(*session, {request.layer()}, request.position(), 1, key.data(), value.data(), query.data()).status());
  TURBOKV_RETURN_IF_ERROR(EncodeAndApply(batch));
  v1::StepResponse response;
  response.set_tokens(batch.writes()[0].after);
  const absl::Status status = RunAttention(session->layers()[request.layer()], params, 1, query,
                                           {request.position()}, sink, response.mutable_result());
  if (!status.ok()) {
    batch.Undo();  // a failed call changes nothing
    return status;
  }
  TURBOKV_RETURN_IF_ERROR(batch.Commit()[0]);
  session->Touch(absl::Now());
  return response;
}

namespace {

// A Decode message's tensors, checked against each other: B items of k
// queries each.
struct DecodeShape {
  int64_t batch = 0;
  int64_t k = 1;
  int rank = 3;  // of the queries (and keys): 3 without a k dimension, 4 with it
  int q_heads = 0;
  int kv_heads = 0;  // 0 without keys
  int head_dim = 0;
};

std::string ShapeText(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), "]["), "]");
}

absl::StatusOr<DecodeShape> CheckDecodeShape(const v1::DecodeRequest& request) {
  DecodeShape shape;
  shape.batch = request.session_ids_size();
  if (shape.batch < 1) return absl::InvalidArgumentError("session_ids is empty: a message carries at least one session");
  if (request.layer() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("layer = ", request.layer(), " must be >= 0"));
  }
  const v1::Tensor& queries = request.queries();
  shape.rank = queries.shape_size();
  if (shape.rank != 3 && shape.rank != 4) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape has ", shape.rank,
                                                   " dimensions, expected 3: [batch][q_heads][head_dim] or 4: "
                                                   "[batch][k][q_heads][head_dim]"));
  }
  if (queries.shape(0) != shape.batch) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape ", ShapeText(queries), " is for ", queries.shape(0),
                                                   " items, but session_ids has ", shape.batch));
  }
  shape.k = shape.rank == 4 ? queries.shape(1) : 1;
  if (shape.k < 1 || shape.k > kMaxQueriesPerItem) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape ", ShapeText(queries), " gives ", shape.k,
                                                   " queries per item, expected 1 to ", kMaxQueriesPerItem));
  }
  if (shape.batch * shape.k > kMaxQueriesPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("the message carries ", shape.batch * shape.k,
                                                   " queries, at most ", kMaxQueriesPerCall));
  }
  const int64_t q_heads = queries.shape(shape.rank - 2);
  const int64_t head_dim = queries.shape(shape.rank - 1);
  if (q_heads < 1 || q_heads > kMaxHeads || head_dim < 1 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape ", ShapeText(queries), ": q_heads must be in [1, ",
                                                   kMaxHeads, "] and head_dim in [1, ", kMaxHeadDim, "]"));
  }
  shape.q_heads = static_cast<int>(q_heads);
  shape.head_dim = static_cast<int>(head_dim);
  if (request.positions_size() != shape.batch * shape.k) {
    return absl::InvalidArgumentError(absl::StrCat("positions has ", request.positions_size(), " entries, expected ",
                                                   shape.batch * shape.k, " (", shape.batch, " items x ", shape.k,
                                                   " queries)"));
  }
  if (request.has_keys() != request.has_values()) {
    return absl::InvalidArgumentError(request.has_keys() ? "keys are set without values: send both or neither"
                                                         : "values are set without keys: send both or neither");
  }
  if (request.has_keys()) {
    const v1::Tensor& keys = request.keys();
    const bool leading_match = keys.shape_size() == shape.rank && keys.shape(0) == shape.batch &&
                               (shape.rank == 3 || keys.shape(1) == shape.k);
    if (!leading_match || keys.shape(shape.rank - 1) != shape.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "keys.shape ", ShapeText(keys), " does not match queries.shape ", ShapeText(queries), ": expected ",
          shape.rank == 3 ? absl::StrCat("[", shape.batch, "][kv_heads][", shape.head_dim, "]")
                          : absl::StrCat("[", shape.batch, "][", shape.k, "][kv_heads][", shape.head_dim, "]")));
    }
    const int64_t kv_heads = keys.shape(shape.rank - 2);
    if (kv_heads < 1 || shape.q_heads % kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("keys.shape ", ShapeText(keys), " gives ", kv_heads,
                                                     " kv heads, which must divide the ", shape.q_heads, " q heads"));
    }
    shape.kv_heads = static_cast<int>(kv_heads);
  }
  return shape;
}

std::vector<int64_t> Dims(const v1::Tensor& tensor) { return {tensor.shape().begin(), tensor.shape().end()}; }

// Item i's own checks, under its session's lock: its session has the
// message's shape and the layer; its positions are valid (and, with keys,
// consecutive from at most the layer's length, within max_tokens).
absl::Status CheckDecodeItem(const SessionCache& session, const v1::DecodeRequest& request, const DecodeShape& shape,
                             size_t i) {
  const SessionConfig& config = session.config();
  if (config.q_heads != shape.q_heads || config.head_dim != shape.head_dim ||
      (shape.kv_heads != 0 && config.kv_heads != shape.kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", session.id(), " has ", config.kv_heads, " kv heads, ", config.q_heads, " q heads, head_dim ",
        config.head_dim, "; this message is for ", shape.kv_heads != 0 ? absl::StrCat(shape.kv_heads, " kv heads, ") : "",
        shape.q_heads, " q heads, head_dim ", shape.head_dim, ": sessions of one message share their shape"));
  }
  TURBOKV_RETURN_IF_ERROR(CheckLayer(config, request.layer(), "layer"));
  const int64_t tokens = session.layers()[request.layer()].tokens();
  const size_t first = i * static_cast<size_t>(shape.k);
  const int64_t start = request.positions(static_cast<int>(first));
  for (int64_t j = 0; j < shape.k; ++j) {
    const int index = static_cast<int>(first + j);
    const int64_t p = request.positions(index);
    if (p < 0) return absl::InvalidArgumentError(absl::StrCat("positions[", index, "] = ", p, " must be >= 0"));
    if (shape.kv_heads != 0 && p - j != start) {
      return absl::InvalidArgumentError(absl::StrCat("positions[", index, "] = ", p, " does not follow positions[",
                                                     index - 1, "]: with keys, an item's positions are consecutive"));
    }
    if (shape.kv_heads == 0 && p >= tokens) {
      return absl::FailedPreconditionError(absl::StrCat("positions[", index, "] = ", p, " is past the ", tokens,
                                                        " tokens of layer ", request.layer(), " of session ",
                                                        session.id()));
    }
  }
  if (shape.kv_heads != 0) {
    if (start > tokens) {
      return absl::FailedPreconditionError(absl::StrCat("positions[", first, "] = ", start, " but layer ",
                                                        request.layer(), " of session ", session.id(), " holds ",
                                                        tokens, " tokens: positions ", tokens, " to ", start - 1,
                                                        " are missing"));
    }
    if (start > config.max_tokens - shape.k) {
      return CallerLimit(absl::ResourceExhaustedError(absl::StrCat(
          shape.k, " tokens at position ", start, " go past the max_tokens = ", config.max_tokens, " of session ",
          session.id())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::DecodeResponse> Handler::Decode(const v1::DecodeRequest& request, const std::string& tenant) {
  TURBOKV_ASSIGN_OR_RETURN(DecodeShape shape, CheckDecodeShape(request));
  TURBOKV_ASSIGN_OR_RETURN(AttentionParams params, CheckOptions(shape.q_heads, request.options()));
  const int64_t queries_total = shape.batch * shape.k;
  TURBOKV_RETURN_IF_ERROR(
      CheckResultSize(queries_total, shape.q_heads, shape.head_dim, params, options_.max_message_bytes));
  // Non-finite values fail their own item (below), not the message.
  TURBOKV_ASSIGN_OR_RETURN(std::vector<float> queries,
                           InputFloats(options_.shared_memory, tenant, request.queries(), Dims(request.queries()), "queries", false));
  TURBOKV_ASSIGN_OR_RETURN(ResultSink sink, OpenResultSink(request, tenant, queries_total, shape.q_heads,
                                                            shape.head_dim));
  std::vector<float> keys, values;
  if (shape.kv_heads != 0) {
    TURBOKV_ASSIGN_OR_RETURN(keys, InputFloats(options_.shared_memory, tenant, request.keys(), Dims(request.keys()), "keys", false));
    TURBOKV_ASSIGN_OR_RETURN(values, InputFloats(options_.shared_memory, tenant, request.values(), Dims(request.keys()), "values", false));
  }
  const size_t batch = static_cast<size_t>(shape.batch);
  const size_t item_queries = static_cast<size_t>(shape.k) * shape.q_heads * shape.head_dim;
  const size_t item_values = static_cast<size_t>(shape.k) * shape.kv_heads * shape.head_dim;
  auto check_item_values = [&](size_t i) -> absl::Status {
    const absl::Span<const float> item = absl::MakeConstSpan(queries).subspan(i * item_queries, item_queries);
    TURBOKV_RETURN_IF_ERROR(CheckFinite(item, absl::StrCat("queries[", i, "]")));
    TURBOKV_RETURN_IF_ERROR(CheckScoresFinite(params, item, shape.head_dim, absl::StrCat("queries[", i, "]")));
    if (shape.kv_heads == 0) return absl::OkStatus();
    TURBOKV_RETURN_IF_ERROR(
        CheckFinite(absl::MakeConstSpan(keys).subspan(i * item_values, item_values), absl::StrCat("keys[", i, "]")));
    return CheckFinite(absl::MakeConstSpan(values).subspan(i * item_values, item_values),
                       absl::StrCat("values[", i, "]"));
  };

  LockedBatch locked = FindLockedBatch(request.session_ids(), tenant);
  std::vector<absl::Status>& status = locked.status;
  for (size_t i = 0; i < batch; ++i) {
    if (status[i].ok()) status[i] = CheckDecodeItem(*locked.sessions[i], request, shape, i);
    if (status[i].ok()) status[i] = check_item_values(i);
  }

  // Appends: each item's pages taken first (an item the budget cannot hold
  // fails alone); every item's tokens are encoded by the attention's call.
  WriteBatch writes(*store_, locked.held);
  std::vector<size_t> write_of(batch, SIZE_MAX);  // each item's, if it has one
  if (shape.kv_heads != 0) {
    for (size_t i = 0; i < batch; ++i) {
      if (!status[i].ok()) continue;
      SessionCache& session = *locked.sessions[i];
      const int64_t start = request.positions(static_cast<int>(i * shape.k));
      status[i] = CheckKvStorable(session.config(), keys.data() + i * item_values, values.data() + i * item_values,
                                  {request.layer()}, start, shape.k, absl::StrCat("keys[", i, "]"),
                                  absl::StrCat("values[", i, "]"));
      if (!status[i].ok()) continue;
      absl::StatusOr<size_t> write =
          writes.Add(session, {request.layer()}, start, shape.k, keys.data() + i * item_values,
                     values.data() + i * item_values, queries.data() + i * item_queries);
      if (write.ok()) {
        write_of[i] = *write;
      } else {
        status[i] = write.status();
      }
    }
  }
  const absl::Span<const EncodeChunk> jobs = writes.Jobs();

  // Attention: every item that is still OK, as one batch, over its layer as
  // its new tokens leave it; the backend stores them first, in the same
  // call, and the layers change only once it has done both.
  const size_t row = static_cast<size_t>(shape.k) * shape.q_heads;  // output rows per item
  const size_t top = static_cast<size_t>(params.top_k);
  // Not zeroed as a whole (512 KiB a Decode step of 32 sessions): attention
  // writes every row of the items it runs, the others' rows get zeros here.
  const size_t item_out = row * shape.head_dim;
  const std::unique_ptr<float[]> out(new float[batch * item_out]);
  for (size_t i = 0; i < batch; ++i) {
    if (!status[i].ok()) std::fill_n(out.get() + i * item_out, item_out, 0.0f);
  }
  std::vector<float> lse(batch * row, -INFINITY);
  std::vector<int64_t> top_tokens(batch * row * top, -1);
  std::vector<float> top_logits(batch * row * top, -INFINITY);
  std::vector<AttentionProblem> problems;
  for (size_t i = 0; i < batch; ++i) {
    if (!status[i].ok()) continue;
    const LayerCache& layer = locked.sessions[i]->layers()[request.layer()];
    const AttentionQueries item_queries{shape.k, queries.data() + i * row * shape.head_dim,
                                        request.positions().data() + i * shape.k};
    const AttentionOutput item_output{out.get() + i * item_out, lse.data() + i * row,
                                      top ? top_tokens.data() + i * row * top : nullptr,
                                      top ? top_logits.data() + i * row * top : nullptr};
    problems.push_back(write_of[i] != SIZE_MAX ? writes.Attention(write_of[i], item_queries, item_output)
                                               : layer.Attention(item_queries, item_output));
  }
  // A failed message changes nothing: the writes' pages go back unused.
  TURBOKV_RETURN_IF_ERROR(RunBatch(problems, params, static_cast<int64_t>(problems.size()) * shape.k, jobs));
  writes.Apply();
  CountApplied(writes);
  // New tokens are acknowledged as the tier holds them: an item whose
  // tokens it did not take fails alone.
  const std::vector<absl::Status> committed = writes.Commit();
  for (size_t i = 0; i < batch; ++i) {
    if (write_of[i] != SIZE_MAX) status[i] = committed[write_of[i]];
  }

  v1::DecodeResponse response;
  sink.Put(absl::MakeConstSpan(out.get(), batch * item_out), {shape.batch, shape.k, shape.q_heads, shape.head_dim},
           v1::DTYPE_F32, response.mutable_output());
  sink.Put(lse, {shape.batch, shape.k, shape.q_heads}, v1::DTYPE_F32, response.mutable_lse());
  response.mutable_top_k_tokens()->Assign(top_tokens.begin(), top_tokens.end());
  response.mutable_top_k_logits()->Assign(top_logits.begin(), top_logits.end());
  const absl::Time now = absl::Now();
  int failed = 0;
  for (size_t i = 0; i < batch; ++i) {
    v1::ItemStatus* item = response.add_status();
    item->set_code(static_cast<int>(status[i].code()));
    item->set_message(std::string(status[i].message()));
    const SessionCache* session = locked.sessions[i].get();
    response.add_tokens(session != nullptr && request.layer() < session->config().layers
                            ? session->layers()[request.layer()].tokens()
                            : 0);
    if (status[i].ok()) {
      locked.sessions[i]->Touch(now);
    } else {
      ++failed;
      if (options_.metrics != nullptr) options_.metrics->AddDecodeItemFailure(status[i].code());
    }
  }
  response.set_failed(failed);
  if (options_.metrics != nullptr) options_.metrics->ObserveDecodeBatch(shape.batch);
  return response;
}

}  // namespace turbokv
