#include "service/records/record_io.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/codec.h"

namespace turbokv {

namespace {

uint32_t Crc32cTable(absl::string_view bytes, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  for (unsigned char b : bytes) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// SSE4.2's crc32 instruction computes CRC-32C: about 8 bytes a cycle here
// against about one for the table (pages are checked on every read back).
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(absl::string_view bytes, uint32_t crc) {
  const char* p = bytes.data();
  size_t n = bytes.size();
  uint64_t c = crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = __builtin_ia32_crc32qi(c32, static_cast<unsigned char>(*p));
  return c32;
}
#endif

}  // namespace

uint32_t Crc32c(absl::string_view bytes, uint32_t crc) {
  crc ^= 0xFFFFFFFFu;
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  crc = sse42 ? Crc32cSse42(bytes, crc) : Crc32cTable(bytes, crc);
#else
  crc = Crc32cTable(bytes, crc);
#endif
  return crc ^ 0xFFFFFFFFu;
}

void PutString(std::string* out, const std::string& s) {
  Put<uint16_t>(out, static_cast<uint16_t>(s.size()));
  out->append(s);
}

namespace {

// Calls f(offset in the page, offset in the slots, bytes) for each run of
// slots [from, to): per head, its keys, then its values.
template <typename F>
void ForEachSlotRun(const SlotShape& shape, int32_t from, int32_t to, F f) {
  const size_t n = static_cast<size_t>(to - from);
  size_t at = 0;
  for (int32_t h = 0; h < shape.heads; ++h) {
    f(shape.key_offset(h, from), at, n * shape.key_bytes);
    at += n * shape.key_bytes;
    f(shape.value_offset(h, from), at, n * shape.value_bytes);
    at += n * shape.value_bytes;
  }
}

}  // namespace

void CopySlots(const uint8_t* page, const SlotShape& shape, int32_t from, int32_t to, std::string* out) {
  const size_t start = out->size();
  out->resize(start + shape.slots_bytes(from, to));
  ForEachSlotRun(shape, from, to, [&](size_t in_page, size_t in_slots, size_t bytes) {
    std::memcpy(out->data() + start + in_slots, page + in_page, bytes);
  });
}

void PlaceSlots(absl::string_view slots, const SlotShape& shape, int32_t from, int32_t to, uint8_t* page) {
  ForEachSlotRun(shape, from, to, [&](size_t in_page, size_t in_slots, size_t bytes) {
    std::memcpy(page + in_page, slots.data() + in_slots, bytes);
  });
}

absl::string_view Reader::Take(size_t n) {
  if (bytes_.size() < n) {
    short_ = true;
    return {};
  }
  absl::string_view taken = bytes_.substr(0, n);
  bytes_.remove_prefix(n);
  return taken;
}

void PutSessionHeader(std::string* out, const SessionHeader& header) {
  const SessionConfig& c = header.config;
  PutString(out, header.id);
  PutString(out, header.tenant);
  Put<int32_t>(out, c.layers);
  Put<int32_t>(out, c.kv_heads);
  Put<int32_t>(out, c.q_heads);
  Put<int32_t>(out, c.head_dim);
  Put<uint8_t>(out, static_cast<uint8_t>(c.key_codec));
  Put<uint8_t>(out, static_cast<uint8_t>(c.value_codec));
  Put<uint64_t>(out, c.rotation_seed);
  Put<int64_t>(out, c.max_tokens);
  Put<int64_t>(out, absl::ToInt64Nanoseconds(c.idle_ttl));
  Put<int64_t>(out, absl::ToUnixNanos(header.created));
  Put<int32_t>(out, header.page_tokens);
  PutString(out, c.preset);
  Put<uint32_t>(out, static_cast<uint32_t>(c.layer_codecs.size()));
  for (const LayerCodecRange& range : c.layer_codecs) {
    Put<int32_t>(out, range.first);
    Put<int32_t>(out, range.last);
    Put<uint8_t>(out, static_cast<uint8_t>(range.key));
    Put<uint8_t>(out, static_cast<uint8_t>(range.value));
  }
  Put<uint8_t>(out, static_cast<uint8_t>(c.key_transform));
  Put<uint8_t>(out, c.center_values ? 1 : 0);
  Put<int32_t>(out, c.sink_tokens);
  Put<uint8_t>(out, static_cast<uint8_t>(c.sink_codec));
}

namespace {

enum ExtrasFlags : uint8_t { kFixed = 1, kKeyMean = 2, kKeyScale = 4, kValueMean = 8 };

}  // namespace

void PutLayerExtras(std::string* out, const LayerExtras& extras) {
  const KeyTransform& t = extras.transform;
  const uint8_t flags = (extras.transform_fixed ? kFixed : 0) | (t.key_mean.empty() ? 0 : kKeyMean) |
                        (t.key_scale.empty() ? 0 : kKeyScale) | (t.value_mean.empty() ? 0 : kValueMean);
  Put<uint8_t>(out, flags);
  if (!t.empty()) {
    Put<int32_t>(out, t.kv_heads);
    Put<int32_t>(out, t.head_dim);
    for (const std::vector<float>* v : {&t.key_mean, &t.key_scale, &t.value_mean}) {
      out->append(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(float));
    }
  }
  Put<int64_t>(out, extras.sink_tokens);
  Put<uint32_t>(out, static_cast<uint32_t>(extras.sinks.size()));
  out->append(extras.sinks);
}

absl::Status GetLayerExtras(Reader& in, absl::string_view what, LayerExtras* extras) {
  const auto malformed = [&] { return absl::DataLossError(absl::StrCat(what, ": a layer's transform or sinks are malformed")); };
  const uint8_t flags = in.Get<uint8_t>();
  if ((flags & ~(kFixed | kKeyMean | kKeyScale | kValueMean)) != 0) return malformed();
  extras->transform_fixed = (flags & kFixed) != 0;
  KeyTransform& t = extras->transform;
  if ((flags & (kKeyMean | kKeyScale | kValueMean)) != 0) {
    t.kv_heads = in.Get<int32_t>();
    t.head_dim = in.Get<int32_t>();
    if (in.short_read() || t.kv_heads < 1 || t.kv_heads > kMaxHeads || t.head_dim < 1 || t.head_dim > 4096) {
      return malformed();
    }
    const size_t size = static_cast<size_t>(t.kv_heads) * t.head_dim;
    for (const auto& [flag, v] : {std::make_pair(kKeyMean, &t.key_mean), std::make_pair(kKeyScale, &t.key_scale),
                                  std::make_pair(kValueMean, &t.value_mean)}) {
      if ((flags & flag) == 0) continue;
      const absl::string_view bytes = in.Take(size * sizeof(float));
      if (in.short_read()) return malformed();
      v->resize(size);
      std::memcpy(v->data(), bytes.data(), bytes.size());
    }
  }
  extras->sink_tokens = in.Get<int64_t>();
  const uint32_t sink_bytes = in.Get<uint32_t>();
  if (in.short_read() || extras->sink_tokens < 0 || sink_bytes > in.left()) return malformed();
  extras->sinks = std::string(in.Take(sink_bytes));
  return absl::OkStatus();
}

void PutNamedBlocks(std::string* out, const NamedBlocks& blocks) {
  Put<int64_t>(out, blocks.reuse_from_tokens);
  Put<uint32_t>(out, static_cast<uint32_t>(blocks.hashes.size()));
  for (const std::string& hash : blocks.hashes) {
    Put<uint8_t>(out, static_cast<uint8_t>(hash.size()));
    out->append(hash);
  }
}

absl::Status GetNamedBlocks(Reader& in, absl::string_view what, NamedBlocks* blocks) {
  const auto malformed = [&] { return absl::DataLossError(absl::StrCat(what, ": its named blocks are malformed")); };
  blocks->reuse_from_tokens = in.Get<int64_t>();
  const uint32_t count = in.Get<uint32_t>();
  // Each hash takes two bytes at least.
  if (in.short_read() || blocks->reuse_from_tokens < 0 || count > in.left() / 2) return malformed();
  blocks->hashes.clear();
  blocks->hashes.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    const uint8_t size = in.Get<uint8_t>();
    const absl::string_view hash = in.Take(size);
    if (in.short_read() || size == 0 || size > kMaxBlockHashBytes) return malformed();
    blocks->hashes.emplace_back(hash);
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionHeader> GetSessionHeader(Reader& in, int page_tokens, absl::string_view what, int format) {
  SessionHeader s;
  s.id = in.GetString();
  s.tenant = in.GetString();
  SessionConfig& c = s.config;
  c.layers = in.Get<int32_t>();
  c.kv_heads = in.Get<int32_t>();
  c.q_heads = in.Get<int32_t>();
  c.head_dim = in.Get<int32_t>();
  c.key_codec = static_cast<CodecKind>(in.Get<uint8_t>());
  c.value_codec = static_cast<CodecKind>(in.Get<uint8_t>());
  c.rotation_seed = in.Get<uint64_t>();
  c.max_tokens = in.Get<int64_t>();
  c.idle_ttl = absl::Nanoseconds(in.Get<int64_t>());
  s.created = absl::FromUnixNanos(in.Get<int64_t>());
  s.page_tokens = in.Get<int32_t>();
  if (format >= kHeaderLayerCodecs) {
    c.preset = in.GetString();
    const uint32_t ranges = in.Get<uint32_t>();
    if (ranges > static_cast<uint32_t>(kMaxLayers)) return absl::DataLossError(absl::StrCat(what, " header is malformed"));
    for (uint32_t i = 0; i < ranges && !in.short_read(); ++i) {
      LayerCodecRange range;
      range.first = in.Get<int32_t>();
      range.last = in.Get<int32_t>();
      range.key = static_cast<CodecKind>(in.Get<uint8_t>());
      range.value = static_cast<CodecKind>(in.Get<uint8_t>());
      c.layer_codecs.push_back(range);
    }
  }
  // Sessions written before these fields stored every layer as given.
  c.key_transform = KeyTransformMode::kNone;
  c.center_values = false;
  c.sink_tokens = 0;
  c.sink_codec = CodecKind::kF16;
  if (format >= kHeaderStorage) {
    c.key_transform = static_cast<KeyTransformMode>(in.Get<uint8_t>());
    c.center_values = in.Get<uint8_t>() != 0;
    c.sink_tokens = in.Get<int32_t>();
    c.sink_codec = static_cast<CodecKind>(in.Get<uint8_t>());
    if (c.key_transform != KeyTransformMode::kNone && c.key_transform != KeyTransformMode::kCenter &&
        c.key_transform != KeyTransformMode::kCenterScale) {
      return absl::DataLossError(absl::StrCat(what, " header names an unknown key transform"));
    }
    if (c.sink_tokens < 0 || c.sink_tokens > std::min(kMaxSinkTokens, page_tokens) ||
        (c.sink_codec != CodecKind::kF16 && c.sink_codec != CodecKind::kQ8_0)) {
      return absl::DataLossError(absl::StrCat(what, " header's sink tokens are malformed"));
    }
  }
  if (in.short_read() || c.layers < 1 || c.layers > kMaxLayers || c.kv_heads < 1 || c.kv_heads > kMaxHeads ||
      c.q_heads < c.kv_heads || c.q_heads > kMaxHeads || c.q_heads % c.kv_heads != 0 || c.max_tokens < 1) {
    return absl::DataLossError(absl::StrCat(what, " header is malformed"));
  }
  if (s.page_tokens != page_tokens) {
    return absl::DataLossError(absl::StrCat(what, " has pages of ", s.page_tokens, " tokens, this turbokvd uses ",
                                            page_tokens));
  }
  int previous_last = -1;
  for (const LayerCodecRange& range : c.layer_codecs) {
    if (range.first <= previous_last || range.last < range.first || range.last >= c.layers) {
      return absl::DataLossError(absl::StrCat(what, " header's layer codecs are malformed"));
    }
    previous_last = range.last;
  }
  for (int l = 0; l < c.layers; ++l) {
    if (!CheckCodecSpec(CodecSpec{c.KeyCodec(l), c.head_dim, 0}).ok() ||
        !CheckCodecSpec(CodecSpec{c.ValueCodec(l), c.head_dim, 0}).ok()) {
      return absl::DataLossError(absl::StrCat(what, " names an unknown codec or head_dim"));
    }
  }
  return s;
}

}  // namespace turbokv
