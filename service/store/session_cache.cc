#include "service/store/session_cache.h"

#include <utility>

namespace turbokv {
namespace {

// Measured (tests/service/store_test.cc, SessionMetadataIsCharged) and
// rounded up.
constexpr size_t kCodecMetadataBytes = 4096;
constexpr size_t kLayerMetadataBytes = sizeof(LayerCache) + 96;

}  // namespace

size_t SessionMetadataBytes(const SessionConfig& config) {
  // The session object, then per layer its LayerCache and allocator
  // overhead; and the shared part.
  return sizeof(SessionCache) + static_cast<size_t>(config.layers) * kLayerMetadataBytes +
         SessionSharedMetadataBytes(config);
}

size_t SessionSharedMetadataBytes(const SessionConfig& config) {
  // Its codecs (sign vectors, codebooks; a pair for the keys and values of
  // every layer, and one more for each pair the ranges of layer_codecs add),
  // and each layer's sink page and transform at their largest.
  return kCodecMetadataBytes * (1 + config.layer_codecs.size()) +
         static_cast<size_t>(config.layers) *
             LayerExtrasBytes(config.kv_heads, config.head_dim, config.sink_tokens, config.sink_codec);
}

SessionCache::SessionCache(std::string id, std::string tenant, const SessionConfig& config, absl::Time now)
    : id_(std::move(id)),
      tenant_(std::move(tenant)),
      config_(config),
      created_(now),
      last_used_ns_(absl::ToUnixNanos(now)),
      errors_(static_cast<size_t>(config.layers)) {}

SessionCache::~SessionCache() = default;

void SessionCache::ReleaseMemory() {
  layers_.clear();
  charge_.reset();
  shared_charge_.reset();
}

size_t SessionCache::bytes_used() const {
  size_t bytes = 0;
  for (const LayerCache& layer : layers_) bytes += layer.bytes();
  return bytes;
}

int64_t SessionCache::layer_tokens(int layer) const {
  const size_t l = static_cast<size_t>(layer);
  return resident() ? layers_[l].tokens() : tier_.demoted->layers[l].tokens;
}

int64_t SessionCache::tokens() const {
  int64_t tokens = 0;
  if (!resident()) {
    for (const TierLayer& layer : tier_.demoted->layers) tokens += layer.tokens;
    return tokens;
  }
  for (const LayerCache& layer : layers_) tokens += layer.tokens();
  return tokens;
}

int SessionCache::transformed_layers() const {
  int count = 0;
  if (resident()) {
    for (const LayerCache& layer : layers_) count += layer.transformed() ? 1 : 0;
  } else {
    for (const TierLayer& layer : tier_.demoted->layers) count += layer.extras.transform.empty() ? 0 : 1;
  }
  return count;
}

size_t SessionCache::fp16_bytes() const {
  // Keys and values, two bytes a value.
  return static_cast<size_t>(tokens()) * config_.kv_heads * config_.head_dim * 2 * 2;
}

}  // namespace turbokv
