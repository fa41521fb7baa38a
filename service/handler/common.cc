#include "service/handler/common.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/time_util.h"

namespace turbokv {

using google::protobuf::util::TimeUtil;

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

absl::StatusOr<AttentionParams> CheckOptions(int q_heads, const v1::AttentionOptions& options) {
  AttentionParams params;
  params.q_heads = q_heads;
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

absl::Status CheckResultSize(int64_t n, int q_heads, int head_dim, const AttentionParams& params, size_t max_bytes) {
  const double bytes = static_cast<double>(n) * q_heads * (4.0 * head_dim + 4 + 12.0 * params.top_k);
  if (bytes > static_cast<double>(max_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("the result of ", n, " queries x ", q_heads,
                                                     " heads (top_k ", params.top_k, ") would take ",
                                                     static_cast<int64_t>(bytes), " bytes, over the ", max_bytes,
                                                     "-byte message limit: send fewer queries a call"));
  }
  return absl::OkStatus();
}

}  // namespace turbokv
