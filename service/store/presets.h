// Named codec presets: points on the bits/quality curve a user picks by name
// (docs/API.md "Choosing a codec"). A preset fixes the keys' and values'
// codecs of the session and of its boundary layers, the first and last ones,
// which are the most sensitive to quantization.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "service/records/session_config.h"

namespace turbokv {

struct Preset {
  const char* name;
  CodecKind key;
  CodecKind value;
  // The first and the last `boundary` layers each (for sessions of at least
  // 4 x boundary layers; fewer layers have none) take these codecs.
  int boundary;
  CodecKind boundary_key;
  CodecKind boundary_value;
};

// k8v4, k4v4, k4v3, k3v4, k3v3, k2v2, in that order.
absl::Span<const Preset> Presets();

// The preset the service uses when a session names neither a preset nor a
// codec (chosen by the measurement in README "Choosing a codec").
extern const char kDefaultPreset[];

// Sets config's key_codec, value_codec, layer_codecs and preset from the
// preset `name` for config.layers layers; INVALID_ARGUMENT naming `field`
// and the presets for an unknown name.
absl::Status ApplyPreset(absl::string_view name, absl::string_view field, SessionConfig* config);

}  // namespace turbokv
