// Conversions and checks that several of the handler's call families share:
// codecs and session configs to and from the proto, layer and option checks,
// reply sizes. Internal to service/handler/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "service/store/session_store.h"
#include "turbokv/v1/turbokv.pb.h"

namespace turbokv {

constexpr int kMaxTopK = 1024;
constexpr int64_t kMaxQueriesPerCall = 4096;

// A proto codec (UNSPECIFIED: turbo3); INVALID_ARGUMENT naming `field`.
absl::StatusOr<CodecKind> FromProtoCodec(int codec, absl::string_view field);
v1::Codec ToProtoCodec(CodecKind kind);
void ConfigToProto(const SessionConfig& config, v1::SessionConfig* proto);

// INVALID_ARGUMENT naming `field` unless 0 <= layer < config.layers.
absl::Status CheckLayer(const SessionConfig& config, int layer, absl::string_view field);

// The attention parameters of `options` for sessions with q_heads query
// heads; INVALID_ARGUMENT naming the option otherwise.
absl::StatusOr<AttentionParams> CheckOptions(int q_heads, const v1::AttentionOptions& options);

// RESOURCE_EXHAUSTED when the result of n queries (q_heads x head_dim each)
// would not fit in a reply of max_bytes.
absl::Status CheckResultSize(int64_t n, int q_heads, int head_dim, const AttentionParams& params, size_t max_bytes);

}  // namespace turbokv
