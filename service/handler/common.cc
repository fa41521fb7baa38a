#include "service/handler/common.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/time_util.h"
#include "kernels/half.h"
#include "kernels/key_transform.h"
#include "service/error_side.h"
#include "service/status_macros.h"

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
  proto->set_pinned(config.pinned);
  for (const LayerCodecRange& range : config.layer_codecs) {
    v1::LayerCodecs* layers = proto->add_layer_codecs();
    layers->set_first_layer(range.first);
    layers->set_last_layer(range.last);
    layers->set_key_codec(ToProtoCodec(range.key));
    layers->set_value_codec(ToProtoCodec(range.value));
  }
  proto->set_preset(config.preset);
  proto->set_key_transform(static_cast<v1::KeyTransform>(config.key_transform));
  proto->set_center_values(config.center_values);
  proto->set_sink_tokens(config.sink_tokens);
  proto->set_sink_codec(ToProtoCodec(config.sink_codec));
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

absl::Status CheckScoresFinite(const AttentionParams& params, absl::Span<const float> queries, int head_dim,
                               absl::string_view what) {
  const double scale = params.softmax_scale > 0 ? params.softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  const double key_norm = kMaxStoredValue * std::sqrt(static_cast<double>(head_dim));
  double largest = 0.0;
  size_t largest_row = 0;
  for (size_t row = 0; row * head_dim < queries.size(); ++row) {
    const float* q = queries.data() + row * head_dim;
    const double sum = DotDouble(q, q, head_dim);
    if (sum > largest) {
      largest = sum;
      largest_row = row;
    }
  }
  const double bound = scale * std::sqrt(largest) * key_norm;
  if (bound <= kMaxScore) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "options.softmax_scale = ", params.softmax_scale, " with ", what, " row ", largest_row, " (norm ",
      std::sqrt(largest), ") can give scores of ", bound, " against keys the cache may hold, past ", kMaxScore,
      ": the attention would not be finite"));
}

double ResultBytes(double rows, int64_t head_dim, int64_t top_k) {
  return rows * (4.0 * static_cast<double>(head_dim) + 4 + 12.0 * static_cast<double>(top_k));
}

absl::Status CheckResultSize(int64_t n, int q_heads, int head_dim, const AttentionParams& params, size_t max_bytes) {
  const double bytes = ResultBytes(static_cast<double>(n) * q_heads, head_dim, params.top_k);
  if (bytes > static_cast<double>(max_bytes)) {
    return CallerLimit(absl::ResourceExhaustedError(absl::StrCat(
        "the result of ", n, " queries x ", q_heads, " heads (top_k ", params.top_k, ") would take ",
        static_cast<int64_t>(bytes), " bytes, over the ", max_bytes, "-byte message limit: send fewer queries a call")));
  }
  return absl::OkStatus();
}

namespace {

// Whether a layer's rows [rows][d] are surely storable: the largest value
// and block norm over all of them (SIMD), a block norm within a 2^-10
// margin of its bound left to the row-by-row check, which decides alone.
bool SurelyStorable(CodecKind codec, const float* x, size_t rows, int d) {
  const CodecLayout layout = MakeCodecLayout(codec, d);
  if (layout.block_values <= 0) return false;
  float largest = 0.0f, block_square = 0.0f;
  const bool turbo = TurboBits(codec) != 0;
  LargestMagnitudes(x, rows * d, static_cast<size_t>(layout.block_values), &largest, turbo ? &block_square : nullptr);
  constexpr float kMargin = 1.0f - 1.0f / 1024;
  return largest <= kMaxStoredValue && (!turbo || block_square <= kMaxTurboBlockNorm * kMaxTurboBlockNorm * kMargin);
}

}  // namespace

absl::Status CheckStorable(const SessionConfig& config, KvPart part, const float* data,
                           const std::vector<int>& layers, int64_t start, int64_t n, absl::string_view what) {
  const int d = config.head_dim;
  const size_t layer_rows = static_cast<size_t>(n) * config.kv_heads;
  const size_t rows = layers.size() * layer_rows;
  CodecKind codec = CodecKind::kF16;
  CodecLayout layout;
  bool turbo = false;
  for (size_t row = 0; row < rows; ++row) {
    if (row % layer_rows == 0) {  // a new layer: its codec
      const int l = layers[row / layer_rows];
      codec = part == KvPart::kKeys ? config.KeyCodec(l) : config.ValueCodec(l);
      // Most layers are checked at once; the rest row by row, below.
      if (SurelyStorable(codec, data + row * d, layer_rows, d)) {
        row += layer_rows - 1;
        continue;
      }
      layout = MakeCodecLayout(codec, d);
      turbo = TurboBits(codec) != 0;
    }
    const float* x = data + row * d;
    float largest = 0.0f, block_norm = 0.0f;
    for (int b = 0; b < d; b += layout.block_values) {
      // Eight partial sums and maxima (blocks are multiples of 8 values):
      // with one chain of float adds the loop waited on each add, and took
      // about 12% of the daemon's CPU during Appends; now about 8%.
      float sums[8] = {}, maxima[8] = {};
      for (int i = b; i < b + layout.block_values; i += 8) {
        for (int k = 0; k < 8; ++k) {
          sums[k] += x[i + k] * x[i + k];
          maxima[k] = std::max(maxima[k], std::fabs(x[i + k]));
        }
      }
      float sum = 0.0f;
      for (int k = 0; k < 8; ++k) {
        sum += sums[k];
        largest = std::max(largest, maxima[k]);
      }
      block_norm = std::max(block_norm, std::sqrt(sum));
    }
    if (largest <= kMaxStoredValue && (!turbo || block_norm <= kMaxTurboBlockNorm)) continue;
    const size_t token = row / config.kv_heads;
    const std::string where =
        absl::StrCat(what, " of layer ", layers[token / static_cast<size_t>(n)], ", position ",
                     start + static_cast<int64_t>(token % static_cast<size_t>(n)), ", kv head ", row % config.kv_heads);
    if (largest > kMaxStoredValue) {
      return absl::InvalidArgumentError(absl::StrCat(where, " holds ", largest, ", past +-", kMaxStoredValue,
                                                     ", the largest value a cache stores (fp16's range)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(where, ": a block of ", layout.block_values, " values has norm ",
                                                   block_norm, ", past ", kMaxTurboBlockNorm,
                                                   ", the most a turbo codec's fp16 block scale holds; scale the "
                                                   "vectors down or use q8_0"));
  }
  return absl::OkStatus();
}

absl::Status CheckKvStorable(const SessionConfig& config, const float* keys, const float* values,
                             const std::vector<int>& layers, int64_t start, int64_t n, absl::string_view keys_what,
                             absl::string_view values_what) {
  TURBOKV_RETURN_IF_ERROR(CheckStorable(config, KvPart::kKeys, keys, layers, start, n, keys_what));
  return CheckStorable(config, KvPart::kValues, values, layers, start, n, values_what);
}

}  // namespace turbokv
