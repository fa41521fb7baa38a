// A session's configuration and the limits of its shape.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/codec.h"
#include "kernels/key_transform.h"

namespace turbokv {

// Limits of a session's shape (CreateSession and snapshots enforce them).
constexpr int kMaxLayers = 1024;
constexpr int kMaxHeads = 1024;  // kv heads, and query heads
// Sink tokens a layer may keep apart, and how many it does by default.
constexpr int kMaxSinkTokens = 64;
constexpr int kDefaultSinkTokens = 4;
// Blocks named for reuse by content (PrefixIndex): bytes of a block's hash,
// and hashes in one message.
constexpr size_t kMaxBlockHashBytes = 64;
constexpr int kMaxNamedBlocks = 1 << 16;
// A session's reuse_from_tokens (and a layer's transform end) once it was
// cut back within the chunk its transforms were fitted on: its later tokens
// follow others than those the transforms saw, and no prefix of it is
// reused.
constexpr int64_t kNeverReused = std::numeric_limits<int64_t>::max();

// How a layer's keys are stored before their codec (KeyTransform).
enum class KeyTransformMode : uint8_t { kNone = 1, kCenter = 2, kCenterScale = 3 };

// The codecs of layers [first, last], in place of the session's key_codec
// and value_codec there.
struct LayerCodecRange {
  int first = 0;
  int last = 0;
  CodecKind key = CodecKind::kTurbo3;
  CodecKind value = CodecKind::kTurbo3;
};

// A session's configuration, checked and with every default filled in.
struct SessionConfig {
  int layers = 0;
  int kv_heads = 0;
  int q_heads = 0;
  int head_dim = 0;
  // The codecs of every layer that no range of layer_codecs names.
  CodecKind key_codec = CodecKind::kTurbo3;
  CodecKind value_codec = CodecKind::kTurbo3;
  // Sorted by first, disjoint, within [0, layers).
  std::vector<LayerCodecRange> layer_codecs;
  std::string preset;  // the preset the codecs came from; "" for none
  uint64_t rotation_seed = 0;
  int64_t max_tokens = 0;  // per layer
  absl::Duration idle_ttl = absl::ZeroDuration();
  bool pinned = false;  // never demoted to the spill tier
  KeyTransformMode key_transform = KeyTransformMode::kCenterScale;
  bool center_values = false;
  int sink_tokens = 0;  // kept apart in sink_codec, per layer
  CodecKind sink_codec = CodecKind::kF16;

  // What a layer's transform fits: keys only where they are not f16, values
  // only where they are not f16.
  KeyTransformOptions TransformOptions(int layer) const {
    const bool keys = key_transform != KeyTransformMode::kNone && KeyCodec(layer) != CodecKind::kF16;
    return KeyTransformOptions{keys, keys && key_transform == KeyTransformMode::kCenterScale,
                               center_values && ValueCodec(layer) != CodecKind::kF16};
  }

  CodecKind KeyCodec(int layer) const { return Codecs(layer).key; }
  CodecKind ValueCodec(int layer) const { return Codecs(layer).value; }
  LayerCodecRange Codecs(int layer) const {
    for (const LayerCodecRange& range : layer_codecs) {
      if (layer >= range.first && layer <= range.last) return range;
    }
    return LayerCodecRange{layer, layer, key_codec, value_codec};
  }
};

// Bytes of one page of `layer` (keys and values of every kv head).
inline size_t LayerPageBytes(const SessionConfig& config, int layer, int page_tokens) {
  return static_cast<size_t>(config.kv_heads) * static_cast<size_t>(page_tokens) *
         (MakeCodecLayout(config.KeyCodec(layer), config.head_dim).code_size() +
          MakeCodecLayout(config.ValueCodec(layer), config.head_dim).code_size());
}

// Stored bits per key and value over the whole session, block scales and
// norms included.
inline double BitsPerValue(const SessionConfig& config) {
  double bytes = 0;
  for (int l = 0; l < config.layers; ++l) {
    bytes += static_cast<double>(MakeCodecLayout(config.KeyCodec(l), config.head_dim).code_size() +
                                 MakeCodecLayout(config.ValueCodec(l), config.head_dim).code_size());
  }
  return config.layers == 0 ? 0.0 : 8.0 * bytes / (2.0 * config.layers * config.head_dim);
}

}  // namespace turbokv
