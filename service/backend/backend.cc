#include "service/backend/backend.h"

namespace turbokv {

absl::Status Backend::EncodeAndAttend(absl::Span<const EncodeChunk> chunks, const AttentionBatch& batch,
                                      const AttentionParams& params) {
  if (!chunks.empty()) {
    if (absl::Status encoded = Encode(chunks); !encoded.ok()) return encoded;
  }
  return Attend(batch, params);
}

}  // namespace turbokv
