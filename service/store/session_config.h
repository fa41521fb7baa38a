// A session's configuration and the limits of its shape.
#pragma once

#include <cstdint>

#include "absl/time/time.h"
#include "kernels/codec.h"

namespace turbokv {

// Limits of a session's shape (CreateSession and snapshots enforce them).
constexpr int kMaxLayers = 1024;
constexpr int kMaxHeads = 1024;  // kv heads, and query heads

// A session's configuration, checked and with every default filled in.
struct SessionConfig {
  int layers = 0;
  int kv_heads = 0;
  int q_heads = 0;
  int head_dim = 0;
  CodecKind key_codec = CodecKind::kTurbo3;
  CodecKind value_codec = CodecKind::kTurbo3;
  uint64_t rotation_seed = 0;
  int64_t max_tokens = 0;  // per layer
  absl::Duration idle_ttl = absl::ZeroDuration();
  bool pinned = false;  // never demoted to the spill tier
};

}  // namespace turbokv
