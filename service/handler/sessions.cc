// Session calls: create, get, list, delete, truncate, fork; and the
// daemon-wide Stats and Snapshot.
#include "service/handler/handler.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"
#include "service/handler/common.h"
#include "service/store/presets.h"
#include "service/status_macros.h"

namespace turbokv {

using google::protobuf::util::TimeUtil;

namespace {

// The codecs of config.layers layers from proto's preset, key_codec,
// value_codec and layer_codecs (see turbokv.proto), checked.
absl::Status ConfigCodecs(const v1::SessionConfig& proto, SessionConfig* config) {
  const bool codecs_given = proto.key_codec() != v1::CODEC_UNSPECIFIED || proto.value_codec() != v1::CODEC_UNSPECIFIED;
  if (!proto.preset().empty() || !codecs_given) {
    TURBOKV_RETURN_IF_ERROR(
        ApplyPreset(proto.preset().empty() ? kDefaultPreset : proto.preset(), "config.preset", config));
    // Codecs next to a preset must be its own (as a returned config has them).
    if ((proto.key_codec() != v1::CODEC_UNSPECIFIED && proto.key_codec() != ToProtoCodec(config->key_codec)) ||
        (proto.value_codec() != v1::CODEC_UNSPECIFIED && proto.value_codec() != ToProtoCodec(config->value_codec))) {
      return absl::InvalidArgumentError(absl::StrCat("config.preset = '", proto.preset(),
                                                     "' sets the codecs: give it without other config.key_codec and "
                                                     "config.value_codec (use config.layer_codecs for exceptions)"));
    }
  } else {
    TURBOKV_ASSIGN_OR_RETURN(config->key_codec, FromProtoCodec(proto.key_codec(), "config.key_codec"));
    TURBOKV_ASSIGN_OR_RETURN(config->value_codec, FromProtoCodec(proto.value_codec(), "config.value_codec"));
  }
  if (proto.layer_codecs_size() > 0) {
    config->layer_codecs.clear();
    for (int i = 0; i < proto.layer_codecs_size(); ++i) {
      const v1::LayerCodecs& given = proto.layer_codecs(i);
      const std::string field = absl::StrCat("config.layer_codecs[", i, "]");
      if (given.first_layer() < 0 || given.last_layer() < given.first_layer() || given.last_layer() >= config->layers) {
        return absl::InvalidArgumentError(absl::StrCat(field, " names layers ", given.first_layer(), " to ",
                                                       given.last_layer(), ": expected 0 <= first_layer <= "
                                                       "last_layer < layers = ", config->layers));
      }
      LayerCodecRange range{given.first_layer(), given.last_layer(), config->key_codec, config->value_codec};
      if (given.key_codec() != v1::CODEC_UNSPECIFIED) {
        TURBOKV_ASSIGN_OR_RETURN(range.key, FromProtoCodec(given.key_codec(), field + ".key_codec"));
      }
      if (given.value_codec() != v1::CODEC_UNSPECIFIED) {
        TURBOKV_ASSIGN_OR_RETURN(range.value, FromProtoCodec(given.value_codec(), field + ".value_codec"));
      }
      config->layer_codecs.push_back(range);
    }
    std::sort(config->layer_codecs.begin(), config->layer_codecs.end(),
              [](const LayerCodecRange& a, const LayerCodecRange& b) { return a.first < b.first; });
    for (size_t i = 1; i < config->layer_codecs.size(); ++i) {
      const LayerCodecRange& before = config->layer_codecs[i - 1];
      const LayerCodecRange& next = config->layer_codecs[i];
      if (next.first <= before.last) {
        return absl::InvalidArgumentError(absl::StrCat("config.layer_codecs: layers ", before.first, "-", before.last,
                                                       " and ", next.first, "-", next.last, " overlap"));
      }
    }
  }
  // Every codec of the session must take its head_dim.
  for (int l = 0; l < config->layers; ++l) {
    for (CodecKind kind : {config->KeyCodec(l), config->ValueCodec(l)}) {
      const absl::StatusOr<CodecLayout> layout = CheckCodecSpec(CodecSpec{kind, config->head_dim, 0});
      if (!layout.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("config.shape.head_dim (", CodecName(kind), ", layer ", l,
                                                       "): ", layout.status().message()));
      }
    }
  }
  return absl::OkStatus();
}

// The key transform, value centering and sink tokens from proto, checked.
absl::Status ConfigStorage(const v1::SessionConfig& proto, SessionConfig* config) {
  switch (proto.key_transform()) {
    case v1::KEY_TRANSFORM_UNSPECIFIED:
    case v1::KEY_TRANSFORM_CENTER_SCALE: config->key_transform = KeyTransformMode::kCenterScale; break;
    case v1::KEY_TRANSFORM_CENTER: config->key_transform = KeyTransformMode::kCenter; break;
    case v1::KEY_TRANSFORM_NONE: config->key_transform = KeyTransformMode::kNone; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("config.key_transform = ", proto.key_transform(),
                                                     " is not a KeyTransform (NONE, CENTER, CENTER_SCALE)"));
  }
  config->center_values = proto.center_values();
  config->sink_tokens = proto.has_sink_tokens() ? proto.sink_tokens() : kDefaultSinkTokens;
  if (config->sink_tokens < 0 || config->sink_tokens > kMaxSinkTokens) {
    return absl::InvalidArgumentError(absl::StrCat("config.sink_tokens = ", config->sink_tokens, " must be in [0, ",
                                                   kMaxSinkTokens, "] (unset: ", kDefaultSinkTokens, ")"));
  }
  switch (proto.sink_codec()) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_F16: config->sink_codec = CodecKind::kF16; break;
    case v1::CODEC_Q8_0: config->sink_codec = CodecKind::kQ8_0; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("config.sink_codec = ", proto.sink_codec(),
                                                     " is not CODEC_F16 or CODEC_Q8_0"));
  }
  return absl::OkStatus();
}

// Block hashes as a request gives them: 1 to 64 bytes each.
absl::StatusOr<std::vector<std::string>> BlockHashes(const google::protobuf::RepeatedPtrField<std::string>& field,
                                                     absl::string_view name) {
  if (field.size() > kMaxNamedBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", field.size(), " hashes, more than the ",
                                                   kMaxNamedBlocks, " allowed in one message"));
  }
  std::vector<std::string> hashes;
  hashes.reserve(static_cast<size_t>(field.size()));
  for (int i = 0; i < field.size(); ++i) {
    if (field[i].empty() || field[i].size() > kMaxBlockHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] is ", field[i].size(),
                                                     " bytes: a block hash is 1 to ", kMaxBlockHashBytes, " bytes"));
    }
    hashes.push_back(field[i]);
  }
  return hashes;
}

}  // namespace

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
  TURBOKV_RETURN_IF_ERROR(ConfigCodecs(proto, &config));
  // What the device cannot attend is refused now, not at the first Attend.
  TURBOKV_RETURN_IF_ERROR(store_->backend().CheckHeadDim(config.head_dim));
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
  config.pinned = proto.pinned();
  TURBOKV_RETURN_IF_ERROR(ConfigStorage(proto, &config));

  TURBOKV_ASSIGN_OR_RETURN(std::vector<std::string> prefix, BlockHashes(request.prefix_blocks(), "prefix_blocks"));
  v1::CreateSessionResponse response;
  if (prefix.empty()) {
    TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, store_->Create(config, tenant, absl::Now()));
    response.set_session_id(session->id());
  } else {
    TURBOKV_ASSIGN_OR_RETURN(SessionStore::Attached attached,
                             store_->Attach(config, proto.has_rotation_seed(), tenant, prefix, absl::Now()));
    response.set_session_id(attached.session->id());
    response.set_prefix_tokens(attached.tokens);
    if (options_.metrics != nullptr) options_.metrics->CountPrefixLookup(attached.tokens);
    config.rotation_seed = attached.session->config().rotation_seed;
  }
  ConfigToProto(config, response.mutable_config());
  response.set_block_tokens(store_->options().page_tokens);
  return response;
}

absl::StatusOr<v1::NameBlocksResponse> Handler::NameBlocks(const v1::NameBlocksRequest& request,
    const std::string& tenant) {
  TURBOKV_ASSIGN_OR_RETURN(std::vector<std::string> hashes, BlockHashes(request.block_hashes(), "block_hashes"));
  if (hashes.empty()) return absl::InvalidArgumentError("block_hashes is empty");
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, FindLocked(request.session_id(), tenant, &lock));
  TURBOKV_ASSIGN_OR_RETURN(PrefixIndex::Holding holding, store_->NameBlocks(*session, request.first_block(), hashes));
  const int page_tokens = store_->options().page_tokens;
  v1::NameBlocksResponse response;
  response.set_named_blocks(static_cast<int64_t>(holding.hashes.size()));
  response.set_reusable_from_blocks(holding.reuse_from_tokens == kNeverReused
                                        ? -1
                                        : std::max<int64_t>(1, (holding.reuse_from_tokens + page_tokens - 1) / page_tokens));
  response.set_block_tokens(page_tokens);
  return response;
}

absl::StatusOr<v1::SessionInfo> Handler::GetSession(const v1::GetSessionRequest& request,
    const std::string& tenant) {
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session,
                           FindLocked(request.session_id(), tenant, &lock, /*promote=*/false));
  return Info(*session);
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
  TURBOKV_RETURN_IF_ERROR(store_->Delete(request.session_id(), tenant));
  return v1::DeleteSessionResponse();
}

absl::StatusOr<v1::SessionInfo> Handler::TruncateSession(const v1::TruncateSessionRequest& request,
    const std::string& tenant) {
  if (request.tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tokens = ", request.tokens(), " must be >= 0"));
  }
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, FindLocked(request.session_id(), tenant, &lock));
  TURBOKV_RETURN_IF_ERROR(store_->Truncate(*session, request.tokens()));
  return Info(*session);
}

absl::StatusOr<v1::ForkSessionResponse> Handler::ForkSession(const v1::ForkSessionRequest& request,
    const std::string& tenant) {
  if (request.prefix_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix_tokens = ", request.prefix_tokens(), " must be >= 0"));
  }
  std::unique_lock<std::mutex> lock;
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> source, FindLocked(request.source_session_id(), tenant, &lock));
  for (size_t l = 0; l < source->layers().size(); ++l) {
    const int64_t tokens = source->layers()[l].tokens();
    if (request.prefix_tokens() > tokens) {
      return absl::FailedPreconditionError(absl::StrCat("prefix_tokens = ", request.prefix_tokens(),
                                                        " is past the ", tokens, " tokens of layer ", l));
    }
  }
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> fork, store_->Fork(*source, request.prefix_tokens(), absl::Now()));
  lock.unlock();
  v1::ForkSessionResponse response;
  response.set_session_id(fork->id());
  std::lock_guard<std::mutex> fork_lock(fork->mutex());
  *response.mutable_session() = Info(*fork);
  return response;
}

absl::StatusOr<v1::SnapshotResponse> Handler::Snapshot(const v1::SnapshotRequest&, const std::string& tenant) {
  if (options_.snapshot_tenant.has_value() && (options_.snapshot_tenant->empty() || tenant != *options_.snapshot_tenant)) {
    return absl::PermissionDeniedError(
        options_.snapshot_tenant->empty()
            ? "Snapshot writes every tenant's sessions: an operator action, allowed only to the admin tenant, and "
              "this turbokvd has none (--admin-tenant)"
            : "Snapshot writes every tenant's sessions: an operator action, allowed only to the admin tenant "
              "(--admin-tenant)");
  }
  const absl::Time start = absl::Now();
  TURBOKV_ASSIGN_OR_RETURN(SnapshotReport report, store_->SaveSnapshots());
  if (!report.failed.empty()) {
    const auto& [id, status] = report.failed.front();
    return absl::Status(status.code(), absl::StrCat(report.failed.size(), " session(s) not written; session ", id,
                                                    ": ", status.message()));
  }
  v1::SnapshotResponse response;
  response.set_sessions(report.sessions);
  response.set_bytes(report.bytes);
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
  response.set_compression_ratio(snapshot.compression_ratio());
  response.set_device(options_.device);
  response.set_evictions(snapshot.lru_evictions + snapshot.ttl_expiries + snapshot.disk_drops);
  response.set_resident_sessions(snapshot.resident_sessions);
  response.set_demoted_sessions(snapshot.demoted_sessions);
  response.set_demotions(snapshot.demotions);
  response.set_promotions(snapshot.promotions);
  response.set_spill_bytes(snapshot.tier.live_bytes);
  response.set_spill_budget_bytes(snapshot.tier.budget_bytes);
  response.set_block_tokens(store_->options().page_tokens);
  response.set_named_blocks(snapshot.named_blocks);
  return response;
}

absl::StatusOr<v1::PrefetchResponse> Handler::Prefetch(const v1::PrefetchRequest& request, const std::string& tenant) {
  LockedBatch locked = FindLockedBatch(request.session_ids(), tenant);
  v1::PrefetchResponse response;
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < locked.status.size(); ++i) {
    v1::ItemStatus* item = response.add_status();
    item->set_code(static_cast<int>(locked.status[i].code()));
    item->set_message(std::string(locked.status[i].message()));
    if (locked.sessions[i] != nullptr) locked.sessions[i]->Touch(now);
  }
  return response;
}

}  // namespace turbokv
