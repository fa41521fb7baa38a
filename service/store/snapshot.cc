#include "service/store/snapshot.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/codec.h"

namespace turbokv {
namespace {

constexpr char kMagic[8] = {'T', 'K', 'V', 'S', 'N', 'A', 'P', '\n'};
constexpr uint32_t kVersion = 1;

template <typename T>
void Put(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only, as the wire format
  out->append(bytes, sizeof(T));
}

void PutString(std::string* out, const std::string& s) {
  Put<uint16_t>(out, static_cast<uint16_t>(s.size()));
  out->append(s);
}

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
  absl::string_view Take(size_t n) {
    if (bytes_.size() < n) {
      short_ = true;
      return {};
    }
    absl::string_view taken = bytes_.substr(0, n);
    bytes_.remove_prefix(n);
    return taken;
  }
  std::string GetString() { return std::string(Take(Get<uint16_t>())); }
  bool short_read() const { return short_; }
  size_t left() const { return bytes_.size(); }

 private:
  absl::string_view bytes_;
  bool short_ = false;
};

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

uint32_t Crc32c(absl::string_view bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::string EncodeSnapshot(const SessionCache& session, int page_tokens) {
  const SessionConfig& c = session.config();
  std::string header;
  PutString(&header, session.id());
  PutString(&header, session.tenant());
  Put<int32_t>(&header, c.layers);
  Put<int32_t>(&header, c.kv_heads);
  Put<int32_t>(&header, c.q_heads);
  Put<int32_t>(&header, c.head_dim);
  Put<uint8_t>(&header, static_cast<uint8_t>(c.key_codec));
  Put<uint8_t>(&header, static_cast<uint8_t>(c.value_codec));
  Put<uint64_t>(&header, c.rotation_seed);
  Put<int64_t>(&header, c.max_tokens);
  Put<int64_t>(&header, absl::ToInt64Nanoseconds(c.idle_ttl));
  Put<int64_t>(&header, absl::ToUnixNanos(session.created()));
  Put<int32_t>(&header, page_tokens);
  for (const LayerCache& layer : session.layers()) Put<int64_t>(&header, layer.tokens());

  std::string out(kMagic, sizeof(kMagic));
  Put<uint32_t>(&out, kVersion);
  Put<uint32_t>(&out, static_cast<uint32_t>(header.size()));
  out += header;
  for (const LayerCache& layer : session.layers()) layer.AppendPagesTo(&out);
  Put<uint32_t>(&out, Crc32c(out));
  return out;
}

absl::StatusOr<DecodedSnapshot> DecodeSnapshot(absl::string_view bytes, int page_tokens) {
  if (bytes.size() < sizeof(kMagic) + 12 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError("not a turbokv snapshot (bad magic or too short)");
  }
  uint32_t stored_crc;
  std::memcpy(&stored_crc, bytes.data() + bytes.size() - 4, 4);
  const absl::string_view body = bytes.substr(0, bytes.size() - 4);
  if (Crc32c(body) != stored_crc) return absl::DataLossError("checksum mismatch: the file is corrupt or truncated");
  Reader reader(body.substr(sizeof(kMagic)));
  const uint32_t version = reader.Get<uint32_t>();
  if (version != kVersion) {
    return absl::DataLossError(absl::StrCat("snapshot format version ", version, ", this turbokvd reads ", kVersion));
  }
  Reader header(reader.Take(reader.Get<uint32_t>()));
  DecodedSnapshot s;
  s.id = header.GetString();
  s.tenant = header.GetString();
  SessionConfig& c = s.config;
  c.layers = header.Get<int32_t>();
  c.kv_heads = header.Get<int32_t>();
  c.q_heads = header.Get<int32_t>();
  c.head_dim = header.Get<int32_t>();
  c.key_codec = static_cast<CodecKind>(header.Get<uint8_t>());
  c.value_codec = static_cast<CodecKind>(header.Get<uint8_t>());
  c.rotation_seed = header.Get<uint64_t>();
  c.max_tokens = header.Get<int64_t>();
  c.idle_ttl = absl::Nanoseconds(header.Get<int64_t>());
  s.created = absl::FromUnixNanos(header.Get<int64_t>());
  const int32_t stored_page_tokens = header.Get<int32_t>();
  // The limits CreateSession enforces: nothing sized from a bad header.
  if (header.short_read() || c.layers < 1 || c.layers > kMaxLayers || c.kv_heads < 1 || c.kv_heads > kMaxHeads ||
      c.q_heads < c.kv_heads || c.q_heads > kMaxHeads || c.q_heads % c.kv_heads != 0 || c.max_tokens < 1) {
    return absl::DataLossError("the snapshot header is malformed");
  }
  if (stored_page_tokens != page_tokens) {
    return absl::DataLossError(absl::StrCat("the snapshot has pages of ", stored_page_tokens,
                                            " tokens, this turbokvd uses ", page_tokens));
  }
  for (int l = 0; l < c.layers; ++l) s.tokens.push_back(header.Get<int64_t>());
  if (header.short_read() || header.left() != 0) return absl::DataLossError("the snapshot header is malformed");
  absl::StatusOr<CodecLayout> key = CheckCodecSpec(CodecSpec{c.key_codec, c.head_dim, 0});
  absl::StatusOr<CodecLayout> value = CheckCodecSpec(CodecSpec{c.value_codec, c.head_dim, 0});
  if (!key.ok() || !value.ok()) return absl::DataLossError("the snapshot names an unknown codec or head_dim");
  const size_t page_bytes = static_cast<size_t>(c.kv_heads) * page_tokens * (key->code_size() + value->code_size());
  for (int64_t tokens : s.tokens) {
    if (tokens < 0 || tokens > c.max_tokens) return absl::DataLossError("the snapshot's token counts are malformed");
    const size_t pages = static_cast<size_t>(tokens / page_tokens + (tokens % page_tokens != 0));
    if (pages > reader.left() / page_bytes) return absl::DataLossError("the snapshot's pages do not match its header");
    s.pages.push_back(reader.Take(pages * page_bytes));
  }
  if (reader.short_read() || reader.left() != 0) {
    return absl::DataLossError("the snapshot's pages do not match its header");
  }
  return s;
}

absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, absl::string_view bytes) {
  const std::string path = dir + "/" + name;
  const std::string temp = path + ".tmp";
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create", temp);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status status = Errno("cannot write", temp);
      close(fd);
      unlink(temp.c_str());
      return status;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    const absl::Status status = Errno("cannot fsync", temp);
    close(fd);
    unlink(temp.c_str());
    return status;
  }
  close(fd);
  if (rename(temp.c_str(), path.c_str()) != 0) {
    const absl::Status status = Errno("cannot rename", temp);
    unlink(temp.c_str());
    return status;
  }
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return absl::OkStatus();
}

}  // namespace turbokv
