// ReadKv: a session's keys and values decoded, streamed in messages.
#include "service/handler/handler.h"

#include <algorithm>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/handler/common.h"
#include "service/status_macros.h"
#include "service/tensor.h"

namespace turbokv {

absl::StatusOr<ReadKvCursor> Handler::StartReadKv(const v1::ReadKvRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> found, FindLocked(request.session_id(), tenant, &lock));
  const SessionConfig& config = found->config();
  ReadKvCursor cursor;
  cursor.session = found;
  cursor.in_call = std::make_unique<SessionInCall>(found);
  for (int i = 0; i < request.layers_size(); ++i) {
    TURBOKV_RETURN_IF_ERROR(CheckLayer(config, request.layers(i), absl::StrCat("layers[", i, "]")));
    if (std::find(cursor.layers.begin(), cursor.layers.end(), request.layers(i)) != cursor.layers.end()) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "] = ", request.layers(i), " is listed twice"));
    }
    cursor.layers.push_back(request.layers(i));
  }
  if (cursor.layers.empty()) {
    for (int l = 0; l < config.layers; ++l) cursor.layers.push_back(l);
  }
  if (request.start() < 0) return absl::InvalidArgumentError(absl::StrCat("start = ", request.start(), " must be >= 0"));
  if (request.end() < 0 || (request.end() > 0 && request.end() < request.start())) {
    return absl::InvalidArgumentError(absl::StrCat("end = ", request.end(), " must be 0 (to the end) or >= start = ", request.start()));
  }
  for (int l : cursor.layers) {
    const int64_t tokens = found->layers()[l].tokens();
    const int64_t end = request.end() == 0 ? tokens : request.end();
    if (end > tokens || request.start() > end) {
      return absl::FailedPreconditionError(absl::StrCat("range [", request.start(), ", ", end, ") is past the ", tokens,
                                                        " tokens of layer ", l));
    }
    cursor.ends.push_back(end);
  }
  switch (request.dtype()) {
    case v1::DTYPE_UNSPECIFIED: cursor.dtype = v1::DTYPE_F32; break;
    case v1::DTYPE_F32:
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16: cursor.dtype = request.dtype(); break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype = ", request.dtype(), " must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16"));
  }
  if (request.max_tokens_per_message() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens_per_message = ", request.max_tokens_per_message(), " must be >= 0"));
  }
  const size_t token_bytes = 2 * static_cast<size_t>(config.kv_heads) * config.head_dim * DTypeSize(cursor.dtype);
  const size_t message_bytes = std::min(options_.max_message_bytes, size_t{1} << 20);
  if (token_bytes > options_.max_message_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "one token of this session is ", token_bytes, " bytes of keys and values in ", v1::DType_Name(cursor.dtype),
        ", more than a reply may carry (half of --max-message-bytes: ", options_.max_message_bytes,
        "); ask for a smaller dtype or raise --max-message-bytes"));
  }
  const int64_t fit = std::max<int64_t>(1, static_cast<int64_t>(message_bytes / token_bytes));
  cursor.tokens_per_message = request.max_tokens_per_message() == 0 ? fit : std::min(request.max_tokens_per_message(), fit);
  cursor.start = request.start();
  cursor.position = request.start();
  return cursor;
}

absl::StatusOr<bool> Handler::NextReadKv(ReadKvCursor& cursor, v1::ReadKvResponse* response) {
  while (cursor.layer_index < cursor.layers.size() && cursor.position >= cursor.ends[cursor.layer_index]) {
    ++cursor.layer_index;
    cursor.position = cursor.start;
  }
  if (cursor.layer_index >= cursor.layers.size()) return false;
  SessionCache& session = *cursor.session;
  std::lock_guard<std::mutex> lock(session.mutex());
  const int l = cursor.layers[cursor.layer_index];
  if (session.gone()) {
    const absl::Status gone = GoneStatus(session.id(), session.tenant());
    return absl::Status(gone.code(), absl::StrCat(gone.message(), " (while being read)"));
  }
  const LayerCache& layer = session.layers()[l];
  const int64_t n = std::min(cursor.tokens_per_message, cursor.ends[cursor.layer_index] - cursor.position);
  if (cursor.position + n > layer.tokens()) {
    return absl::AbortedError(absl::StrCat("layer ", l, " was truncated to ", layer.tokens(), " tokens while being read"));
  }
  const SessionConfig& config = session.config();
  std::vector<float> keys(static_cast<size_t>(n) * config.kv_heads * config.head_dim), values(keys.size());
  const absl::Time decode_start = absl::Now();
  TURBOKV_RETURN_IF_ERROR(layer.Read(cursor.position, n, keys.data(), values.data()));
  if (options_.metrics != nullptr) {
    options_.metrics->ObserveKernel(KernelOp::kDecode, absl::ToDoubleSeconds(absl::Now() - decode_start));
  }
  response->set_layer(l);
  response->set_start(cursor.position);
  FloatsToTensor(keys, {n, config.kv_heads, config.head_dim}, cursor.dtype, response->mutable_keys());
  FloatsToTensor(values, {n, config.kv_heads, config.head_dim}, cursor.dtype, response->mutable_values());
  cursor.position += n;
  session.Touch(absl::Now());
  return true;
}

}  // namespace turbokv
