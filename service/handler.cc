#include "service/handler.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"
#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "service/tensor.h"

namespace turbokv {
namespace {

using google::protobuf::util::TimeUtil;

constexpr int kMaxTopK = 1024;
constexpr int64_t kMaxQueriesPerCall = 4096;

absl::StatusOr<CodecKind> FromProtoCodec(int codec, absl::string_view field) {
  switch (codec) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_TURBO3: return CodecKind::kTurbo3;
    case v1::CODEC_F16: return CodecKind::kF16;
    case v1::CODEC_Q8_0: return CodecKind::kQ8_0;
    case v1::CODEC_Q4_0: return CodecKind::kQ4_0;
    case v1::CODEC_TURBO2: return CodecKind::kTurbo2;
    case v1::CODEC_TURBO4: return CodecKind::kTurbo4;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " = ", codec,
          " is not a codec: use CODEC_F16, CODEC_Q8_0, CODEC_Q4_0, CODEC_TURBO2, CODEC_TURBO3 or "
          "CODEC_TURBO4"));
  }
}

v1::Codec ToProtoCodec(CodecKind kind) {
  switch (kind) {
    case CodecKind::kF16: return v1::CODEC_F16;
    case CodecKind::kQ8_0: return v1::CODEC_Q8_0;
    case CodecKind::kQ4_0: return v1::CODEC_Q4_0;
    case CodecKind::kTurbo2: return v1::CODEC_TURBO2;
    case CodecKind::kTurbo3: return v1::CODEC_TURBO3;
    case CodecKind::kTurbo4: return v1::CODEC_TURBO4;
  }
  return v1::CODEC_UNSPECIFIED;
}

void ConfigToProto(const SessionConfig& config, v1::SessionConfig* proto) {
  v1::ModelShape* shape = proto->mutable_shape();
  shape->set_layers(config.layers);
  shape->set_kv_heads(config.kv_heads);
  shape->set_q_heads(config.q_heads);
  shape->set_head_dim(config.head_dim);
  proto->set_key_codec(ToProtoCodec(config.key_codec));
  proto->set_value_codec(ToProtoCodec(config.value_codec));
  proto->set_rotation_seed(config.rotation_seed);
  proto->set_max_tokens(config.max_tokens);
  *proto->mutable_idle_ttl() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(config.idle_ttl));
}

absl::Status CheckLayer(const SessionConfig& config, int layer, absl::string_view field) {
  if (layer < 0 || layer >= config.layers) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = ", layer, " is out of range: the session has ",
                                                   config.layers, " layers"));
  }
  return absl::OkStatus();
}

// The attention parameters for a call on `layer` with `options`.
absl::StatusOr<AttentionParams> CheckLayerAndOptions(const SessionConfig& config, int layer,
                                                     const v1::AttentionOptions& options) {
  if (absl::Status status = CheckLayer(config, layer, "layer"); !status.ok()) return status;
  AttentionParams params;
  params.q_heads = config.q_heads;
  if (!std::isfinite(options.softmax_scale()) || options.softmax_scale() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("options.softmax_scale = ", options.softmax_scale(),
                                                   " must be finite and >= 0 (0: 1/sqrt(head_dim))"));
  }
  if (!std::isfinite(options.softcap()) || options.softcap() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("options.softcap = ", options.softcap(),
                                                   " must be finite and >= 0 (0: none)"));
  }
  if (options.window() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("options.window = ", options.window(), " must be >= 0 (0: none)"));
  }
  if (options.top_k() < 0 || options.top_k() > kMaxTopK) {
    return absl::InvalidArgumentError(absl::StrCat("options.top_k = ", options.top_k(), " must be in [0, ", kMaxTopK, "]"));
  }
  params.softmax_scale = options.softmax_scale();
  params.softcap = options.softcap();
  params.window = options.window();
  params.top_k = options.top_k();
  return params;
}

// RESOURCE_EXHAUSTED when the result of n queries would not fit in a reply.
absl::Status CheckResultSize(int64_t n, const SessionConfig& config, const AttentionParams& params,
                             size_t max_bytes) {
  const double bytes = static_cast<double>(n) * config.q_heads * (4.0 * config.head_dim + 4 + 12.0 * params.top_k);
  if (bytes > static_cast<double>(max_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("the result of ", n, " queries x ", config.q_heads,
                                                     " heads (top_k ", params.top_k, ") would take ",
                                                     static_cast<int64_t>(bytes), " bytes, over the ", max_bytes,
                                                     "-byte message limit: send fewer queries a call"));
  }
  return absl::OkStatus();
}

// Attention of n queries at `positions` (checked) over one stored layer.
absl::Status RunAttention(const LayerCache& layer, const AttentionParams& params, int64_t n,
                          const std::vector<float>& queries, const std::vector<int64_t>& positions,
                          ThreadPool* pool, Metrics* metrics, v1::AttentionResult* result) {
  const int dim = layer.head_dim();
  std::vector<float> out(static_cast<size_t>(n) * params.q_heads * dim);
  std::vector<float> lse(static_cast<size_t>(n) * params.q_heads);
  const size_t top = static_cast<size_t>(n) * params.q_heads * params.top_k;
  std::vector<int64_t> top_tokens(top);
  std::vector<float> top_logits(top);
  AttentionOutput output{out.data(), lse.data(), top ? top_tokens.data() : nullptr,
                         top ? top_logits.data() : nullptr};
  AttentionOptions options;
  options.pool = pool;
  const absl::Time start = absl::Now();
  const absl::Status status =
      AttendCpu(layer.Descriptor(), params, AttentionQueries{n, queries.data(), positions.data()}, output, options);
  if (!status.ok()) return status;
  if (metrics != nullptr) {
    metrics->ObserveKernel(KernelOp::kAttend, absl::ToDoubleSeconds(absl::Now() - start));
    metrics->AddAttendedQueries(n);
  }
  FloatsToTensor(out, {n, params.q_heads, dim}, v1::DTYPE_F32, result->mutable_output());
  FloatsToTensor(lse, {n, params.q_heads}, v1::DTYPE_F32, result->mutable_lse());
  result->mutable_top_k_tokens()->Assign(top_tokens.begin(), top_tokens.end());
  result->mutable_top_k_logits()->Assign(top_logits.begin(), top_logits.end());
  return absl::OkStatus();
}

}  // namespace

Handler::Handler(SessionStore* store, const HandlerOptions& options)
    : store_(store), options_(options) {}

absl::StatusOr<std::shared_ptr<SessionCache>> Handler::FindLocked(const std::string& id, const std::string& tenant,
                                                                  std::unique_lock<std::mutex>* lock) {
  if (id.empty()) return absl::InvalidArgumentError("session_id is empty");
  absl::StatusOr<std::shared_ptr<SessionCache>> session = store_->Find(id, tenant, absl::Now());
  if (!session.ok()) return session.status();
  *lock = std::unique_lock<std::mutex>((*session)->mutex());
  if ((*session)->gone()) {
    // Deleted or evicted between the lookup and the lock: the store knows why.
    lock->unlock();
    absl::StatusOr<std::shared_ptr<SessionCache>> again = store_->Find(id, tenant, absl::Now());
    return again.ok() ? absl::NotFoundError(absl::StrCat("no session ", id)) : again.status();
  }
  return session;
}

v1::SessionInfo Handler::Info(const SessionCache& session) const {
  v1::SessionInfo info;
  info.set_session_id(session.id());
  ConfigToProto(session.config(), info.mutable_config());
  for (const LayerCache& layer : session.layers()) info.add_layer_tokens(layer.tokens());
  info.set_bytes_used(static_cast<int64_t>(session.bytes_used()));
  info.set_fp16_bytes(static_cast<int64_t>(session.fp16_bytes()));
  const absl::Time now = absl::Now();
  *info.mutable_age() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(now - session.created()));
  *info.mutable_idle() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(now - session.last_used()));
  return info;
}

absl::StatusOr<v1::CreateSessionResponse> Handler::CreateSession(const v1::CreateSessionRequest& request,
    const std::string& tenant) {
  const v1::SessionConfig& proto = request.config();
  if (!proto.has_shape()) return absl::InvalidArgumentError("config.shape is not set");
  const v1::ModelShape& shape = proto.shape();
  SessionConfig config;
  if (shape.layers() < 1 || shape.layers() > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("config.shape.layers = ", shape.layers(), " must be in [1, ", kMaxLayers, "]"));
  }
  if (shape.kv_heads() < 1 || shape.kv_heads() > kMaxHeads) {
    return absl::InvalidArgumentError(absl::StrCat("config.shape.kv_heads = ", shape.kv_heads(), " must be in [1, ", kMaxHeads, "]"));
  }
  if (shape.q_heads() < shape.kv_heads() || shape.q_heads() % shape.kv_heads() != 0 ||
      shape.q_heads() > kMaxHeads) {
    return absl::InvalidArgumentError(absl::StrCat("config.shape.q_heads = ", shape.q_heads(),
                                                   " must be a multiple of kv_heads = ", shape.kv_heads(),
                                                   " and at most ", kMaxHeads));
  }
  config.layers = shape.layers();
  config.kv_heads = shape.kv_heads();
  config.q_heads = shape.q_heads();
  config.head_dim = shape.head_dim();
  absl::StatusOr<CodecKind> key_codec = FromProtoCodec(proto.key_codec(), "config.key_codec");
  if (!key_codec.ok()) return key_codec.status();
  absl::StatusOr<CodecKind> value_codec = FromProtoCodec(proto.value_codec(), "config.value_codec");
  if (!value_codec.ok()) return value_codec.status();
  config.key_codec = *key_codec;
  config.value_codec = *value_codec;
  const absl::StatusOr<CodecLayout> layout = CheckCodecSpec(CodecSpec{config.key_codec, config.head_dim, 0});
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.shape.head_dim: ", layout.status().message()));
  }
  config.rotation_seed =
      proto.has_rotation_seed() ? proto.rotation_seed() : (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  if (proto.max_tokens() < 0 || proto.max_tokens() > options_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("config.max_tokens = ", proto.max_tokens(), " must be in [0, ",
                                                   options_.max_tokens, "] (0: the daemon's limit, ",
                                                   options_.max_tokens, ")"));
  }
  config.max_tokens = proto.max_tokens() == 0 ? options_.max_tokens : proto.max_tokens();
  const absl::Duration ttl = absl::Seconds(proto.idle_ttl().seconds()) + absl::Nanoseconds(proto.idle_ttl().nanos());
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("config.idle_ttl = ", absl::FormatDuration(ttl), " must not be negative"));
  }
  config.idle_ttl = ttl == absl::ZeroDuration() ? options_.session_ttl : ttl;

  absl::StatusOr<std::shared_ptr<SessionCache>> session = store_->Create(config, tenant, absl::Now());
  if (!session.ok()) return session.status();
  v1::CreateSessionResponse response;
  response.set_session_id((*session)->id());
  ConfigToProto(config, response.mutable_config());
  return response;
}

absl::StatusOr<v1::SessionInfo> Handler::GetSession(const v1::GetSessionRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> session = FindLocked(request.session_id(), tenant, &lock);
  if (!session.ok()) return session.status();
  return Info(**session);
}

absl::StatusOr<v1::ListSessionsResponse> Handler::ListSessions(const v1::ListSessionsRequest&,
    const std::string& tenant) {
  v1::ListSessionsResponse response;
  for (const std::shared_ptr<SessionCache>& session : store_->List()) {
    if (session->tenant() != tenant) continue;
    std::lock_guard<std::mutex> lock(session->mutex());
    if (!session->gone()) *response.add_sessions() = Info(*session);
  }
  return response;
}

absl::StatusOr<v1::DeleteSessionResponse> Handler::DeleteSession(const v1::DeleteSessionRequest& request,
    const std::string& tenant) {
  if (request.session_id().empty()) return absl::InvalidArgumentError("session_id is empty");
  absl::Status status = store_->Delete(request.session_id(), tenant);
  if (!status.ok()) return status;
  return v1::DeleteSessionResponse();
}

absl::StatusOr<v1::SessionInfo> Handler::TruncateSession(const v1::TruncateSessionRequest& request,
    const std::string& tenant) {
  if (request.tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tokens = ", request.tokens(), " must be >= 0"));
  }
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> session = FindLocked(request.session_id(), tenant, &lock);
  if (!session.ok()) return session.status();
  for (LayerCache& layer : (*session)->layers()) layer.Truncate(request.tokens());
  return Info(**session);
}

absl::StatusOr<v1::ForkSessionResponse> Handler::ForkSession(const v1::ForkSessionRequest& request,
    const std::string& tenant) {
  if (request.prefix_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix_tokens = ", request.prefix_tokens(), " must be >= 0"));
  }
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> source = FindLocked(request.source_session_id(), tenant, &lock);
  if (!source.ok()) return source.status();
  for (size_t l = 0; l < (*source)->layers().size(); ++l) {
    const int64_t tokens = (*source)->layers()[l].tokens();
    if (request.prefix_tokens() > tokens) {
      return absl::FailedPreconditionError(absl::StrCat("prefix_tokens = ", request.prefix_tokens(),
                                                        " is past the ", tokens, " tokens of layer ", l));
    }
  }
  absl::StatusOr<std::shared_ptr<SessionCache>> fork = store_->Fork(**source, request.prefix_tokens(), absl::Now());
  if (!fork.ok()) return fork.status();
  lock.unlock();
  v1::ForkSessionResponse response;
  response.set_session_id((*fork)->id());
  std::lock_guard<std::mutex> fork_lock((*fork)->mutex());
  *response.mutable_session() = Info(**fork);
  return response;
}

absl::StatusOr<std::vector<LayerCache::PendingAppend>> Handler::PrepareAppend(
    SessionCache& session, const std::vector<int>& layers, int64_t start, int64_t n) {
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
    status = store_->MakeRoom(bytes, &session);
    if (!status.ok()) return status;
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

absl::StatusOr<Handler::StoredChunk> Handler::StoreChunk(SessionCache& session, const std::vector<int>& layers,
                                                        int64_t start, int64_t n, const float* keys,
                                                        const float* values) {
  absl::StatusOr<std::vector<LayerCache::PendingAppend>> pending = PrepareAppend(session, layers, start, n);
  if (!pending.ok()) return pending.status();
  const SessionConfig& config = session.config();
  const size_t layer_values = static_cast<size_t>(n) * config.kv_heads * config.head_dim;
  // Layers encode independently: spread them over the kernel threads (one
  // layer spreads its heads and pages instead).
  const bool by_layer = layers.size() > 1;
  StoredChunk chunk;
  chunk.before.resize(layers.size());
  chunk.after.resize(layers.size());
  auto commit = [&](int64_t i) {
    LayerCache& layer = session.layers()[layers[i]];
    const size_t offset = i * layer_values;
    chunk.before[i] = layer.tokens();
    chunk.after[i] = layer.Commit(std::move((*pending)[i]), keys + offset, values + offset,
                                  by_layer ? nullptr : options_.kernel_pool);
  };
  const absl::Time encode_start = absl::Now();
  if (options_.kernel_pool != nullptr && by_layer) {
    options_.kernel_pool->ParallelFor(static_cast<int64_t>(layers.size()), commit);
  } else {
    for (size_t i = 0; i < layers.size(); ++i) commit(static_cast<int64_t>(i));
  }
  if (options_.metrics != nullptr) {
    int64_t new_token_layers = 0;
    for (size_t i = 0; i < layers.size(); ++i) new_token_layers += chunk.after[i] - chunk.before[i];
    options_.metrics->ObserveKernel(KernelOp::kEncode, absl::ToDoubleSeconds(absl::Now() - encode_start));
    options_.metrics->AddAppendedTokens(new_token_layers);
  }
  return chunk;
}

absl::StatusOr<v1::AppendResponse> Handler::Append(const v1::AppendRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> found = FindLocked(request.session_id(), tenant, &lock);
  if (!found.ok()) return found.status();
  SessionCache& session = **found;
  const SessionConfig& config = session.config();
  std::vector<int> layers;
  int rank = 3;
  switch (request.target_case()) {
    case v1::AppendRequest::kLayer: {
      absl::Status status = CheckLayer(config, request.layer(), "layer");
      if (!status.ok()) return status;
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
    return absl::ResourceExhaustedError(absl::StrCat("chunk [", request.start(), ", ", request.start() + n,
                                                     ") is past the session's max_tokens = ", config.max_tokens));
  }
  std::vector<int64_t> shape = {n, config.kv_heads, config.head_dim};
  if (rank == 4) shape.insert(shape.begin(), config.layers);
  absl::StatusOr<std::vector<float>> keys = TensorToFloats(request.keys(), shape, "keys");
  if (!keys.ok()) return keys.status();
  absl::StatusOr<std::vector<float>> values = TensorToFloats(request.values(), shape, "values");
  if (!values.ok()) return values.status();

  absl::StatusOr<StoredChunk> chunk =
      StoreChunk(session, layers, request.start(), n, keys->data(), values->data());
  if (!chunk.ok()) return chunk.status();
  v1::AppendResponse response;
  response.set_start(request.start());
  int64_t tokens = INT64_MAX;
  int64_t stored = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    tokens = std::min(tokens, chunk->after[i]);
    stored = std::max(stored, chunk->after[i] - chunk->before[i]);
  }
  response.set_tokens(tokens);
  response.set_stored(stored);
  session.Touch(absl::Now());
  return response;
}

absl::StatusOr<v1::AttendResponse> Handler::Attend(const v1::AttendRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> found = FindLocked(request.session_id(), tenant, &lock);
  if (!found.ok()) return found.status();
  SessionCache& session = **found;
  const SessionConfig& config = session.config();
  absl::StatusOr<AttentionParams> params = CheckLayerAndOptions(config, request.layer(), request.options());
  if (!params.ok()) return params.status();
  if (request.queries().shape_size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape has ", request.queries().shape_size(),
                                                   " dimensions, expected 3: [queries][q_heads][head_dim]"));
  }
  const int64_t n = request.queries().shape(0);
  if (n < 1 || n > kMaxQueriesPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape gives ", n, " queries, expected 1 to ", kMaxQueriesPerCall));
  }
  if (absl::Status size = CheckResultSize(n, config, *params, options_.max_message_bytes); !size.ok()) return size;
  absl::StatusOr<std::vector<float>> queries =
      TensorToFloats(request.queries(), {n, config.q_heads, config.head_dim}, "queries");
  if (!queries.ok()) return queries.status();
  const LayerCache& layer = session.layers()[request.layer()];
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
  const absl::Status status =
      RunAttention(layer, *params, n, *queries, positions, options_.kernel_pool, options_.metrics, response.mutable_result());
  if (!status.ok()) return status;
  session.Touch(absl::Now());
  return response;
}

absl::StatusOr<v1::StepResponse> Handler::Step(const v1::StepRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> found = FindLocked(request.session_id(), tenant, &lock);
  if (!found.ok()) return found.status();
  SessionCache& session = **found;
  const SessionConfig& config = session.config();
  absl::StatusOr<AttentionParams> params = CheckLayerAndOptions(config, request.layer(), request.options());
  if (!params.ok()) return params.status();
  if (request.position() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("position = ", request.position(), " must be >= 0"));
  }
  if (request.position() >= config.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("position = ", request.position(),
                                                     " is past the session's max_tokens = ", config.max_tokens));
  }
  if (absl::Status size = CheckResultSize(1, config, *params, options_.max_message_bytes); !size.ok()) return size;
  absl::StatusOr<std::vector<float>> key = TensorToFloats(request.key(), {1, config.kv_heads, config.head_dim}, "key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::vector<float>> value = TensorToFloats(request.value(), {1, config.kv_heads, config.head_dim}, "value");
  if (!value.ok()) return value.status();
  absl::StatusOr<std::vector<float>> query = TensorToFloats(request.query(), {1, config.q_heads, config.head_dim}, "query");
  if (!query.ok()) return query.status();

  absl::StatusOr<StoredChunk> chunk =
      StoreChunk(session, {request.layer()}, request.position(), 1, key->data(), value->data());
  if (!chunk.ok()) return chunk.status();
  LayerCache& layer = session.layers()[request.layer()];
  const int64_t before = chunk->before[0];
  v1::StepResponse response;
  response.set_tokens(chunk->after[0]);
  const absl::Status status = RunAttention(layer, *params, 1, *query, {request.position()}, options_.kernel_pool,
                                           options_.metrics, response.mutable_result());
  if (!status.ok()) {
    layer.Truncate(before);  // a failed call changes nothing
    return status;
  }
  session.Touch(absl::Now());
  return response;
}

absl::StatusOr<ReadKvCursor> Handler::StartReadKv(const v1::ReadKvRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  absl::StatusOr<std::shared_ptr<SessionCache>> found = FindLocked(request.session_id(), tenant, &lock);
  if (!found.ok()) return found.status();
  const SessionConfig& config = (*found)->config();
  ReadKvCursor cursor;
  cursor.session = *found;
  for (int i = 0; i < request.layers_size(); ++i) {
    absl::Status status = CheckLayer(config, request.layers(i), absl::StrCat("layers[", i, "]"));
    if (!status.ok()) return status;
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
    const int64_t tokens = (*found)->layers()[l].tokens();
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
  const int64_t fit = std::max<int64_t>(1, static_cast<int64_t>(std::min(options_.max_message_bytes, size_t{1} << 20) / token_bytes));
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
  if (session.gone()) return absl::NotFoundError(absl::StrCat("session ", session.id(), " was deleted while being read"));
  const LayerCache& layer = session.layers()[l];
  const int64_t n = std::min(cursor.tokens_per_message, cursor.ends[cursor.layer_index] - cursor.position);
  if (cursor.position + n > layer.tokens()) {
    return absl::AbortedError(absl::StrCat("layer ", l, " was truncated to ", layer.tokens(), " tokens while being read"));
  }
  const SessionConfig& config = session.config();
  std::vector<float> keys(static_cast<size_t>(n) * config.kv_heads * config.head_dim), values(keys.size());
  layer.Read(cursor.position, n, keys.data(), values.data());
  response->set_layer(l);
  response->set_start(cursor.position);
  FloatsToTensor(keys, {n, config.kv_heads, config.head_dim}, cursor.dtype, response->mutable_keys());
  FloatsToTensor(values, {n, config.kv_heads, config.head_dim}, cursor.dtype, response->mutable_values());
  cursor.position += n;
  session.Touch(absl::Now());
  return true;
}

absl::StatusOr<v1::SnapshotResponse> Handler::Snapshot(const v1::SnapshotRequest&, const std::string&) {
  const absl::Time start = absl::Now();
  absl::StatusOr<SnapshotReport> report = store_->SaveSnapshots();
  if (!report.ok()) return report.status();
  if (!report->failed.empty()) {
    const auto& [id, status] = report->failed.front();
    return absl::Status(status.code(), absl::StrCat(report->failed.size(), " session(s) not written; session ", id,
                                                    ": ", status.message()));
  }
  v1::SnapshotResponse response;
  response.set_sessions(report->sessions);
  response.set_bytes(report->bytes);
  *response.mutable_duration() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(absl::Now() - start));
  return response;
}

absl::StatusOr<v1::StatsResponse> Handler::Stats(const v1::StatsRequest&, const std::string&) {
  const StoreSnapshot snapshot = store_->Snapshot();
  v1::StatsResponse response;
  response.set_sessions(snapshot.sessions);
  response.set_tokens(snapshot.tokens);
  response.set_bytes_used(snapshot.bytes_used);
  response.set_budget_bytes(snapshot.budget_bytes);
  response.set_fp16_bytes(snapshot.fp16_bytes);
  response.set_compression_ratio(snapshot.bytes_used > 0 ? static_cast<double>(snapshot.fp16_bytes) / snapshot.bytes_used
                                                         : 0.0);
  response.set_device(options_.device);
  response.set_evictions(snapshot.lru_evictions + snapshot.ttl_expiries);
  return response;
}

}  // namespace turbokv
