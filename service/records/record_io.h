// Little-endian record fields, CRC-32C and the encoding of a session's
// configuration: what the snapshot files and the tiers' records share
// (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/page_layout.h"
#include "service/records/session_config.h"

namespace turbokv {

// CRC-32C (Castagnoli) of `bytes`, continuing from `crc` (the CRC of the
// bytes before them; 0 to start).
uint32_t Crc32c(absl::string_view bytes, uint32_t crc = 0);

template <typename T>
void Put(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only, as the wire format
  out->append(bytes, sizeof(T));
}

// A u16 length, then the bytes (strings of at most 65535 bytes).
void PutString(std::string* out, const std::string& s);

// Reads little-endian fields, remembering whether it ran past the end.
class Reader {
 public:
  explicit Reader(absl::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  T Get() {
    T value{};
    if (bytes_.size() < sizeof(T)) {
      short_ = true;
      return value;
    }
    std::memcpy(&value, bytes_.data(), sizeof(T));
    bytes_.remove_prefix(sizeof(T));
    return value;
  }
  absl::string_view Take(size_t n);
  std::string GetString() { return std::string(Take(Get<uint16_t>())); }
  bool short_read() const { return short_; }
  size_t left() const { return bytes_.size(); }

 private:
  absl::string_view bytes_;
  bool short_ = false;
};

// Appends slots [from, to) of a canonical `page` (SlotShape,
// kernels/page_layout.h) to out: each head's keys of them, then
// its values (slots_bytes(from, to) bytes).
void CopySlots(const uint8_t* page, const SlotShape& shape, int32_t from, int32_t to, std::string* out);
// Writes slots as CopySlots gave them back into their places in `page`.
void PlaceSlots(absl::string_view slots, const SlotShape& shape, int32_t from, int32_t to, uint8_t* page);

// A layer's key transform and sink tokens (LayerCache::Extras), as
// snapshots and the tiers' manifests keep them beside its pages.
struct LayerExtras {
  bool transform_fixed = false;  // tokens past the sinks are stored (with `transform`, maybe empty)
  KeyTransform transform;
  int64_t sink_tokens = 0;       // held
  std::string sinks;             // the sink page's bytes (empty without sinks)
};
void PutLayerExtras(std::string* out, const LayerExtras& extras);
// Whether a layer keeps tokens past its `sink_tokens` sinks in its sink
// page (held exact until its transform is fitted, LayerStorage::hold_tokens):
// what only the newest format versions hold, written in them alone.
inline bool HoldsPastSinks(const LayerExtras& extras, int sink_tokens) { return extras.sink_tokens > sink_tokens; }
// Reads one; DATA_LOSS naming `what` when it is cut short or malformed
// (whether it fits its layer is LayerCache::LoadPages's to say).
absl::Status GetLayerExtras(Reader& in, absl::string_view what, LayerExtras* extras);

// The blocks a session named for reuse by content (PrefixIndex), as the
// newest snapshots and tiers' manifests keep them after its layers.
struct NamedBlocks {
  int64_t reuse_from_tokens = 0;   // PrefixIndex::Holding's
  std::vector<std::string> hashes;  // of blocks 0, 1, ...
};
void PutNamedBlocks(std::string* out, const NamedBlocks& blocks);
// Reads them back; DATA_LOSS naming `what` when cut short or malformed.
absl::Status GetNamedBlocks(Reader& in, absl::string_view what, NamedBlocks* blocks);

// What a session header holds, by format (the snapshot's and tiers'
// versions map to one): 1 the shape, codecs and limits; 2 also per-layer
// codecs and the preset; 3 also the key transform, value centering and sink
// tokens (read from the older ones as none).
constexpr int kHeaderLayerCodecs = 2;
constexpr int kHeaderStorage = 3;

// A session's id, tenant, configuration, creation time and page size, as
// the snapshot header and the tiers' manifest records hold them.
struct SessionHeader {
  std::string id;
  std::string tenant;
  SessionConfig config;
  absl::Time created;
  int32_t page_tokens = 0;
};
void PutSessionHeader(std::string* out, const SessionHeader& header);
// Reads one of `format` (PutSessionHeader writes kHeaderStorage) and checks
// it against the limits CreateSession enforces (so that nothing is sized
// from a bad record) and against this daemon's page_tokens; DATA_LOSS
// naming `what` ("the snapshot") otherwise.
absl::StatusOr<SessionHeader> GetSessionHeader(Reader& in, int page_tokens, absl::string_view what, int format);

}  // namespace turbokv
