// `turbokv demo`: a model-shaped workload driven through the client against a
// running turbokvd, checked against float attention computed here.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "client/cpp/client.h"

namespace turbokv {

struct DemoOptions {
  int layers = 32;
  int kv_heads = 8;
  int q_heads = 32;
  int head_dim = 128;
  int64_t tokens = 8192;  // prefill
  int64_t chunk = 128;    // tokens per Append message (all layers)
  int steps = 32;         // decode steps, each over every layer
  int checked_layers = 4; // layers whose attention is compared with the float reference
  int attend_calls = 64;  // Attend calls timed after the decode steps
  // Unspecified codecs and no preset: the daemon's default preset.
  v1::Codec key_codec = v1::CODEC_UNSPECIFIED;
  v1::Codec value_codec = v1::CODEC_UNSPECIFIED;
  std::string preset;
  uint64_t seed = 1;
};

// Runs the workload, printing progress to stderr and the result table to
// stdout; deletes its session at the end.
absl::Status RunDemo(const Client& client, const DemoOptions& options);

}  // namespace turbokv
