#include "service/store/record_io.h"

#include <array>

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
}

absl::StatusOr<SessionHeader> GetSessionHeader(Reader& in, int page_tokens, absl::string_view what,
                                               bool layer_codecs) {
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
  if (layer_codecs) {
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
