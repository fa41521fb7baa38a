#include "service/store/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/codec.h"
#include "service/records/record_io.h"
#include "service/status_macros.h"

namespace turbokv {
namespace {

constexpr char kMagic[8] = {'T', 'K', 'V', 'S', 'N', 'A', 'P', '\n'};
// 2: the session header holds per-layer codecs and the preset; 3: it holds
// the key transform, value centering and sink tokens, and each layer's
// transform and sink page follow the token counts; 4: the blocks the session
// named for reuse follow them; 5: as 4, and a layer's sink page may hold
// tokens past the sinks (held exact until its transform is fitted). Files
// of versions 1 to 4 are still read, and a session is written in the oldest
// version that holds what it has (a turbokvd of before reads it).
constexpr uint32_t kVersion = 5;
constexpr uint32_t kVersionNamed = 4;
constexpr uint32_t kVersionUnnamed = 3;
constexpr char kManifestMagic[] = "turbokv snapshot manifest 1";

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

namespace {

constexpr size_t kIoBuffer = size_t{1} << 20;

// Writes through a buffer to a file, keeping the CRC of what it wrote and
// the first error.
class FileWriter {
 public:
  FileWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) { buffer_.reserve(kIoBuffer); }

  void Append(const void* data, size_t n) {
    const absl::string_view bytes(static_cast<const char*>(data), n);
    crc_ = Crc32c(bytes, crc_);
    if (buffer_.size() + n > kIoBuffer) Flush();
    if (n >= kIoBuffer) {
      WriteAll(bytes);
    } else {
      buffer_.append(bytes.data(), bytes.size());
    }
  }
  void Flush() {
    WriteAll(buffer_);
    buffer_.clear();
  }
  uint32_t crc() const { return crc_; }
  const absl::Status& status() const { return status_; }

 private:
  void WriteAll(absl::string_view bytes) {
    for (size_t done = 0; status_.ok() && done < bytes.size();) {
      const ssize_t n = write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        status_ = Errno("cannot write", path_);
        return;
      }
      done += static_cast<size_t>(n);
    }
  }

  const int fd_;
  const std::string path_;
  std::string buffer_;
  uint32_t crc_ = 0;
  absl::Status status_;
};

// Writes `write`'s bytes to dir/name through dir/name.tmp, fsync and rename,
// then fsyncs the directory. Returns the CRC of what `write` wrote.
absl::StatusOr<uint32_t> WriteAtomically(const std::string& dir, const std::string& name,
                                         const std::function<absl::Status(FileWriter*)>& write) {
  const std::string path = dir + "/" + name;
  const std::string temp = path + ".tmp";
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create", temp);
  FileWriter writer(fd, temp);
  absl::Status status = write(&writer);
  writer.Flush();
  if (status.ok()) status = writer.status();
  if (status.ok() && fsync(fd) != 0) status = Errno("cannot fsync", temp);
  close(fd);
  if (status.ok() && rename(temp.c_str(), path.c_str()) != 0) status = Errno("cannot rename", temp);
  if (!status.ok()) {
    unlink(temp.c_str());
    return status;
  }
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return writer.crc();
}

// Reads a file through a buffer, keeping the CRC of what it read.
class FileReader {
 public:
  explicit FileReader(FILE* file) : file_(file) {}
  bool Read(void* out, size_t n) {
    if (std::fread(out, 1, n, file_) != n) return false;
    crc_ = Crc32c(absl::string_view(static_cast<const char*>(out), n), crc_);
    return true;
  }
  uint32_t crc() const { return crc_; }

 private:
  FILE* file_;
  uint32_t crc_ = 0;
};

// (The file's size bounds it too: nothing is sized from the field alone.)
constexpr uint32_t kMaxHeaderBytes = 1u << 30;

// The header's fields, checked against the limits CreateSession enforces:
// nothing is sized from a bad header.
absl::StatusOr<SnapshotHeader> ParseHeader(absl::string_view bytes, int page_tokens, uint32_t version) {
  Reader header(bytes);
  SnapshotHeader s;
  absl::StatusOr<SessionHeader> session =
      GetSessionHeader(header, page_tokens, "the snapshot", std::min<int>(static_cast<int>(version), kHeaderStorage));
  if (!session.ok()) return session.status();
  static_cast<SessionHeader&>(s) = *std::move(session);
  for (int l = 0; l < s.config.layers; ++l) s.tokens.push_back(header.Get<int64_t>());
  s.extras.resize(static_cast<size_t>(s.config.layers));
  for (int l = 0; l < s.config.layers && version >= 3; ++l) {
    if (absl::Status read = GetLayerExtras(header, "the snapshot", &s.extras[static_cast<size_t>(l)]); !read.ok()) {
      return read;
    }
  }
  if (version >= kVersionNamed) TURBOKV_RETURN_IF_ERROR(GetNamedBlocks(header, "the snapshot", &s.named));
  if (header.short_read() || header.left() != 0) return absl::DataLossError("the snapshot header is malformed");
  for (int64_t tokens : s.tokens) {
    if (tokens < 0 || tokens > s.config.max_tokens) return absl::DataLossError("the snapshot's token counts are malformed");
  }
  return s;
}

}  // namespace

absl::StatusOr<uint32_t> WriteSnapshot(const std::string& dir, const SessionCache& session,
                                       const std::vector<LayerCache>& layers, const NamedBlocks& named,
                                       int page_tokens, Backend& backend) {
  std::string header;
  PutSessionHeader(&header, SessionHeader{session.id(), session.tenant(), session.config(), session.created(), page_tokens});
  for (const LayerCache& layer : layers) Put<int64_t>(&header, layer.tokens());
  bool holds = false;
  for (const LayerCache& layer : layers) {
    const LayerExtras extras = layer.Extras();
    holds = holds || HoldsPastSinks(extras, session.config().sink_tokens);
    PutLayerExtras(&header, extras);
  }
  const uint32_t version = holds ? kVersion : named.hashes.empty() ? kVersionUnnamed : kVersionNamed;
  if (version >= kVersionNamed) PutNamedBlocks(&header, named);
  std::string start(kMagic, sizeof(kMagic));
  Put<uint32_t>(&start, version);
  Put<uint32_t>(&start, static_cast<uint32_t>(header.size()));
  start += header;
  uint32_t crc = 0;
  absl::StatusOr<uint32_t> written =
      WriteAtomically(dir, session.id() + kSnapshotSuffix, [&](FileWriter* out) -> absl::Status {
        out->Append(start.data(), start.size());
        for (const LayerCache& layer : layers) {
          for (const std::shared_ptr<Page>& page : layer.pages()) {
            TURBOKV_RETURN_IF_ERROR(backend.ReadPage(layer.page_format(), page->data, [&](absl::string_view bytes) {
              out->Append(bytes.data(), bytes.size());
              return absl::OkStatus();
            }));
          }
        }
        crc = out->crc();
        out->Append(&crc, sizeof(crc));  // little-endian hosts only, as the wire format
        return absl::OkStatus();
      });
  if (!written.ok()) return written.status();
  return crc;
}

absl::StatusOr<std::shared_ptr<SessionCache>> ReadSnapshot(const std::string& path, int page_tokens,
                                                           const MakeSession& make, uint32_t* crc) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rbe"), &std::fclose);
  if (file == nullptr) return Errno("cannot open", path);
  std::vector<char> buffer(kIoBuffer);
  std::setvbuf(file.get(), buffer.data(), _IOFBF, buffer.size());
  struct stat st;
  if (fstat(fileno(file.get()), &st) != 0) return Errno("cannot stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  FileReader in(file.get());
  char magic[sizeof(kMagic)];
  uint32_t version = 0, header_bytes = 0;
  if (!in.Read(magic, sizeof(magic)) || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError("not a turbokv snapshot (bad magic or too short)");
  }
  if (!in.Read(&version, 4) || !in.Read(&header_bytes, 4)) return absl::DataLossError("the snapshot is truncated");
  if (version < 1 || version > kVersion) {
    return absl::DataLossError(
        absl::StrCat("snapshot format version ", version, ", this turbokvd reads 1 to ", kVersion));
  }
  if (header_bytes > kMaxHeaderBytes || 16 + uint64_t{header_bytes} + 4 > size) {
    return absl::DataLossError("the snapshot header is malformed");
  }
  std::string header_text(header_bytes, '\0');
  if (!in.Read(header_text.data(), header_bytes)) return absl::DataLossError("the snapshot is truncated");
  TURBOKV_ASSIGN_OR_RETURN(SnapshotHeader header, ParseHeader(header_text, page_tokens, version));
  // The pages the header promises must be exactly what the file holds.
  uint64_t left = size - 16 - header_bytes - 4;
  for (size_t l = 0; l < header.tokens.size(); ++l) {
    const int64_t tokens = header.tokens[l];
    const uint64_t page_bytes = LayerPageBytes(header.config, static_cast<int>(l), page_tokens);
    const uint64_t pages = static_cast<uint64_t>(tokens / page_tokens + (tokens % page_tokens != 0));
    if (pages > left / page_bytes) return absl::DataLossError("the snapshot's pages do not match its header (truncated?)");
    left -= pages * page_bytes;
  }
  if (left != 0) return absl::DataLossError("the snapshot's pages do not match its header");
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, make(header));
  for (size_t l = 0; l < header.tokens.size(); ++l) {
    TURBOKV_RETURN_IF_ERROR(session->layers()[l].LoadPages(header.tokens[l], header.extras[l], [&](uint8_t* data, size_t bytes) {
      return in.Read(data, bytes) ? absl::OkStatus() : absl::DataLossError("the snapshot is truncated");
    }));
  }
  const uint32_t computed = in.crc();
  uint32_t stored = 0;
  if (std::fread(&stored, 1, 4, file.get()) != 4) return absl::DataLossError("the snapshot is truncated");
  if (stored != computed) return absl::DataLossError("checksum mismatch: the file is corrupt or truncated");
  *crc = stored;
  return session;
}

absl::Status WriteManifest(const std::string& dir, const SnapshotManifest& manifest) {
  std::vector<std::string> lines;
  for (const auto& [id, crc] : manifest) lines.push_back(absl::StrCat(id, " ", absl::Hex(crc, absl::kZeroPad8), "\n"));
  std::sort(lines.begin(), lines.end());
  std::string text = absl::StrCat(kManifestMagic, "\n");
  for (const std::string& line : lines) text += line;
  return WriteFileAtomically(dir, kManifestName, text);
}

absl::StatusOr<SnapshotManifest> ReadManifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifestName;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no ", path));
  std::string line;
  if (!std::getline(in, line) || line != kManifestMagic) {
    return absl::DataLossError(absl::StrCat(path, " is not a turbokv snapshot manifest"));
  }
  SnapshotManifest manifest;
  while (std::getline(in, line)) {
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
    uint32_t crc = 0;
    if (fields.size() != 2 || !absl::SimpleHexAtoi(fields[1], &crc)) {
      return absl::DataLossError(absl::StrCat(path, " is malformed: '", line.substr(0, 80), "'"));
    }
    manifest[std::string(fields[0])] = crc;
  }
  return manifest;
}

absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, absl::string_view bytes) {
  return WriteAtomically(dir, name, [&](FileWriter* out) {
           out->Append(bytes.data(), bytes.size());
           return absl::OkStatus();
         })
      .status();
}

}  // namespace turbokv
