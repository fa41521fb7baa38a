// Conversions and checks that several of the handler's call families share:
// codecs and session configs to and from the proto, layer and option checks,
// reply sizes. Internal to service/handler/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
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
// The largest value any codec stores (fp16's largest finite value), and the
// largest norm of a turbo rotation block: its scale, about the block's norm,
// is stored in fp16, with room for the scale's fit.
constexpr float kMaxStoredValue = 65504.0f;
constexpr float kMaxTurboBlockNorm = 32768.0f;

enum class KvPart { kKeys, kValues };

// Keys or values (`part`, named `what`) of `n` tokens at `start` in each of
// `layers`, [layers.size()][n][kv_heads][head_dim], that each layer's codec
// can store without saturating: every value within +-kMaxStoredValue and,
// for the turbo codecs, every rotation block's norm at most
// kMaxTurboBlockNorm. INVALID_ARGUMENT naming the tensor, layer, position
// and kv head.
absl::Status CheckStorable(const SessionConfig& config, KvPart part, const float* data,
                           const std::vector<int>& layers, int64_t start, int64_t n, absl::string_view what);
// Both: the keys (named keys_what), then the values.
absl::Status CheckKvStorable(const SessionConfig& config, const float* keys, const float* values,
                             const std::vector<int>& layers, int64_t start, int64_t n, absl::string_view keys_what,
                             absl::string_view values_what);

// Queries ([rows][head_dim] flattened) whose scores stay finite against any
// key a cache can hold: softmax scale x query norm x the largest key norm
// (kMaxStoredValue x sqrt(head_dim)) at most kMaxScore, which leaves the
// online softmax room. INVALID_ARGUMENT naming options.softmax_scale and
// the query otherwise.
constexpr float kMaxScore = 1e37f;
absl::Status CheckScoresFinite(const AttentionParams& params, absl::Span<const float> queries, int head_dim,
                               absl::string_view what);

absl::Status CheckResultSize(int64_t n, int q_heads, int head_dim, const AttentionParams& params, size_t max_bytes);

// The bytes of the attention result of `rows` query rows (a query and one
// head each) of head_dim values with top_k: output, lse and top-k.
double ResultBytes(double rows, int64_t head_dim, int64_t top_k);

}  // namespace turbokv
