#include "service/store/presets.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace turbokv {
namespace {

constexpr CodecKind kQ8 = CodecKind::kQ8_0;
constexpr CodecKind kT2 = CodecKind::kTurbo2;
constexpr CodecKind kT3 = CodecKind::kTurbo3;
constexpr CodecKind kT4 = CodecKind::kTurbo4;

// 4-bit boundary layers under the 2- and 3-bit presets; none under k8v4 and
// k4v4: on real models (README "Choosing a codec", bench/real_model.py)
// 8-bit boundary layers under turbo4 moved the KL divergence by 6% for 0.7
// more bits per value, once keys are stored through their transform.
constexpr Preset kPresets[] = {
    {"k8v4", kQ8, kT4, 0, kQ8, kT4},
    {"k4v4", kT4, kT4, 0, kT4, kT4},
    {"k4v3", kT4, kT3, 2, kT4, kT4},
    {"k3v4", kT3, kT4, 2, kT4, kT4},
    {"k3v3", kT3, kT3, 2, kT4, kT4},
    {"k2v2", kT2, kT2, 2, kT4, kT4},
};

// The boundary layer ranges of `preset` for a session of `layers` layers.
std::vector<LayerCodecRange> BoundaryRanges(const Preset& preset, int layers) {
  if (preset.boundary == 0 || layers < 4 * preset.boundary) return {};
  return {{0, preset.boundary - 1, preset.boundary_key, preset.boundary_value},
          {layers - preset.boundary, layers - 1, preset.boundary_key, preset.boundary_value}};
}

}  // namespace

const char kDefaultPreset[] = "k4v4";

absl::Span<const Preset> Presets() { return kPresets; }

absl::Status ApplyPreset(absl::string_view name, absl::string_view field, SessionConfig* config) {
  for (const Preset& preset : kPresets) {
    if (name != preset.name) continue;
    config->key_codec = preset.key;
    config->value_codec = preset.value;
    config->layer_codecs = BoundaryRanges(preset, config->layers);
    config->preset = preset.name;
    return absl::OkStatus();
  }
  std::vector<std::string> names;
  for (const Preset& preset : kPresets) names.push_back(preset.name);
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = '", name, "' is not a preset: use one of ", absl::StrJoin(names, ", ")));
}

}  // namespace turbokv
