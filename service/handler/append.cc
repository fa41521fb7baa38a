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

void Handler::CountApplied(const WriteBatch& batch) {
  if (options_.metrics == nullptr) return;
  int64_t new_token_layers = 0;
  for (const WriteBatch::Write& write : batch.writes()) {
    new_token_layers += write.after - write.before;
    const SessionConfig& config = write.session->config();
    options_.metrics->ObserveQuantization(config.KeyCodec(write.layer), KvKind::kKey, write.key_errors);
    options_.metrics->ObserveQuantization(config.ValueCodec(write.layer), KvKind::kValue, write.value_errors);
  }
  options_.metrics->AddAppendedTokens(new_token_layers);
}

absl::Status Handler::EncodeAndApply(WriteBatch& batch) {
  // Every chunk with new tokens is one job of a single encode on the
  // backend; the layers change only once all of them are encoded.
  const absl::Span<const EncodeChunk> jobs = batch.Jobs();
  const absl::Time encode_start = absl::Now();
  TURBOKV_RETURN_IF_ERROR(store_->backend().Encode(jobs));
  if (options_.metrics != nullptr) {
    options_.metrics->ObserveKernel(KernelOp::kEncode, absl::ToDoubleSeconds(absl::Now() - encode_start));
  }
  batch.Apply();
  CountApplied(batch);
  return absl::OkStatus();
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

  TURBOKV_RETURN_IF_ERROR(
      CheckKvStorable(config, keys.data(), values.data(), layers, request.start(), n, "keys", "values"));
  const SessionCache* held[] = {&session};
  WriteBatch batch(*store_, held);
  TURBOKV_RETURN_IF_ERROR(batch.Add(session, layers, request.start(), n, keys.data(), values.data(),
                                    queries.empty() ? nullptr : queries.data())
                              .status());
  TURBOKV_RETURN_IF_ERROR(EncodeAndApply(batch));
  TURBOKV_RETURN_IF_ERROR(batch.Commit()[0]);
  v1::AppendResponse response;
  response.set_start(request.start());
  int64_t tokens = INT64_MAX;
  int64_t stored = 0;
  for (const WriteBatch::Write& write : batch.writes()) {
    tokens = std::min(tokens, write.after);
    stored = std::max(stored, write.after - write.before);
  }
  response.set_tokens(tokens);
  response.set_stored(stored);
  session.Touch(absl::Now());
  return response;
}

}  // namespace turbokv
