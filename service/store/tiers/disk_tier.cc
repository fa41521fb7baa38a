#include "service/store/tiers/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "service/byte_size.h"
#include "service/log.h"

namespace turbokv {
namespace {

constexpr char kMagic[4] = {'T', 'K', 'V', 'R'};
// 2: a manifest's session header holds per-layer codecs and the preset;
// 3: it holds the key transform, value centering and sink tokens, and each
// layer's entry its transform and sink page; 4: a page names the shared
// tier's copy of it and a manifest the session's epoch there (a stacked
// daemon's); 5: a manifest also lists the blocks its session named for
// reuse; 6: as 5, and a layer's sink page may hold tokens past the sinks
// (held exact until its transform is fitted). Records of versions 1 to 5
// are still read, and each record is written in the oldest version that
// holds what it has (a turbokvd of before reads it).
constexpr uint16_t kVersion = 6;
constexpr uint16_t kVersionNamed = 5;
constexpr uint16_t kVersionWithoutRedis = 3;
constexpr uint16_t kVersionShared = 4;
constexpr uint16_t kOldestVersion = 1;
constexpr size_t kFrameBytes = 24;  // magic, version, type, 0, lsn, header bytes, payload bytes
constexpr size_t kCrcBytes = 4;
constexpr uint32_t kMaxHeaderBytes = 1 << 28;  // a manifest's, with each layer's transform and sinks
constexpr char kSegmentPrefix[] = "seg-";
constexpr char kSegmentSuffix[] = ".tkvl";

enum RecordType : uint8_t { kPage = 1, kManifest = 2, kTombstone = 3 };

std::string SegmentName(uint64_t number) { return absl::StrFormat("%s%08d%s", kSegmentPrefix, number, kSegmentSuffix); }

absl::Status Errno(absl::string_view what, const std::string& path) {
  const int error = errno;
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(error));
  return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message) : absl::UnavailableError(message);
}

std::string Frame(RecordType type, uint64_t lsn, const std::string& header, size_t payload, uint16_t version) {
  std::string out(kMagic, sizeof(kMagic));
  Put<uint16_t>(&out, version);
  Put<uint8_t>(&out, type);
  Put<uint8_t>(&out, 0);
  Put<uint64_t>(&out, lsn);
  Put<uint32_t>(&out, static_cast<uint32_t>(header.size()));
  Put<uint32_t>(&out, static_cast<uint32_t>(payload));
  out += header;
  return out;
}

bool ReadAll(int fd, void* out, size_t n, uint64_t offset) {
  for (size_t done = 0; done < n;) {
    const ssize_t got = pread(fd, static_cast<char*>(out) + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    done += static_cast<size_t>(got);
  }
  return true;
}

}  // namespace

struct DiskTier::Segment {
  uint64_t number = 0;
  std::string path;
  int fd = -1;
  size_t size = 0;  // bytes of whole records
  size_t live = 0;  // of records still held
  std::set<std::string> sessions;    // with page or manifest records here
  std::set<std::string> tombstones;  // with tombstones here (and their tenants)
  std::map<std::string, std::string> tombstone_tenants;
  std::set<Record*> records;  // the live ones
  int pins = 0;               // reads and a compaction in progress: not removed meanwhile
};

class DiskTier::Record final : public TierRecord {
 public:
  Record(DiskTier* tier, uint64_t lsn, size_t bytes, std::string shared_name = "")
      : TierRecord(lsn, bytes, std::move(shared_name)), tier_(tier) {}
  ~Record() override {
    std::lock_guard<std::mutex> lock(tier_->mutex_);
    tier_->Release(this);
  }

  // Under the tier's mutex.
  Segment* segment = nullptr;  // once written
  uint64_t offset = 0;
  bool done = false;
  absl::Status status;

 private:
  DiskTier* const tier_;
};

struct DiskTier::Job {
  RecordType type = kPage;
  uint64_t lsn = 0;
  std::weak_ptr<Record> record;  // none for tombstones; expired: nobody needs it any more
  std::string session;
  std::string tenant;
  std::string head;  // the frame, header and payload
  size_t bytes = 0;  // the whole record
};

DiskTier::DiskTier(const DiskTierOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& options) {
  const std::string& dir = options.dir;
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create --spill-dir ", dir, ": ", std::strerror(errno)));
  }
  const std::string probe = dir + "/.probe";
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, "x", 1) != 1) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::InvalidArgumentError(absl::StrCat("cannot write in --spill-dir ", dir, ": ", why));
  }
  close(fd);
  unlink(probe.c_str());
  return std::unique_ptr<DiskTier>(new DiskTier(options));
}

DiskTier::~DiskTier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  if (writer_.joinable()) writer_.join();
  for (auto& [number, segment] : segments_) {
    if (segment->fd >= 0) {
      fdatasync(segment->fd);
      close(segment->fd);
    }
  }
}

absl::Status DiskTier::OpenActive() {
  const uint64_t number = segments_.empty() ? 1 : segments_.rbegin()->first + 1;
  auto segment = std::make_unique<Segment>();
  segment->number = number;
  segment->path = options_.dir + "/" + SegmentName(number);
  segment->fd = open(segment->path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (segment->fd < 0) return Errno("cannot create", segment->path);
  const int dir_fd = open(options_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Segment* previous = active_;
  active_ = segment.get();
  segments_.emplace(number, std::move(segment));
  if (previous != nullptr) MaybeRemove(previous);
  return absl::OkStatus();
}

absl::StatusOr<TierScanReport> DiskTier::Scan() {
  std::vector<std::string> names;
  if (DIR* d = opendir(options_.dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      const std::string name = entry->d_name;
      if (absl::StartsWith(name, kSegmentPrefix) && absl::EndsWith(name, kSegmentSuffix)) names.push_back(name);
    }
    closedir(d);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("cannot read --spill-dir ", options_.dir, ": ", std::strerror(errno)));
  }
  std::sort(names.begin(), names.end());
  TierScanReport report;
  struct PageInfo {
    uint64_t lsn;
    std::string session;
    int32_t layer, index, tokens;
    CodecKind key_codec, value_codec;
    uint64_t seed;
    std::string tenant;
    std::string shared_name;  // from version 4
  };
  struct ManifestInfo {
    uint64_t lsn;
    std::string header;  // its header bytes, parsed once chosen
    uint16_t version;
  };
  std::unordered_map<uint64_t, std::shared_ptr<Record>> records;
  std::unordered_map<std::string, std::vector<PageInfo>> pages;
  std::unordered_map<std::string, ManifestInfo> newest_manifest;
  std::unordered_map<std::string, uint64_t> tombstone;
  std::map<std::string, std::string> damaged;
  uint64_t max_lsn = 0;
  for (const std::string& name : names) {
    uint64_t number = 0;
    const std::string digits = name.substr(std::strlen(kSegmentPrefix),
                                           name.size() - std::strlen(kSegmentPrefix) - std::strlen(kSegmentSuffix));
    if (!absl::SimpleAtoi(digits, &number)) continue;
    auto segment = std::make_unique<Segment>();
    segment->number = number;
    segment->path = options_.dir + "/" + name;
    segment->fd = open(segment->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (segment->fd < 0) return Errno("cannot open", segment->path);
    struct stat st;
    if (fstat(segment->fd, &st) != 0) return Errno("cannot stat", segment->path);
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    uint64_t offset = 0;
    std::string buffer;
    while (offset + kFrameBytes + kCrcBytes <= file_size) {
      char frame[kFrameBytes];
      if (!ReadAll(segment->fd, frame, kFrameBytes, offset)) break;
      Reader in(absl::string_view(frame, kFrameBytes));
      const absl::string_view magic = in.Take(4);
      const uint16_t version = in.Get<uint16_t>();
      const uint8_t type = in.Get<uint8_t>();
      in.Get<uint8_t>();
      const uint64_t lsn = in.Get<uint64_t>();
      const uint32_t header_bytes = in.Get<uint32_t>(), payload_bytes = in.Get<uint32_t>();
      const uint64_t bytes = kFrameBytes + uint64_t{header_bytes} + payload_bytes + kCrcBytes;
      if (magic != absl::string_view(kMagic, 4) || header_bytes > kMaxHeaderBytes || offset + bytes > file_size) {
        ++report.torn;  // a torn tail (or not a record): nothing after it is framed
        break;
      }
      buffer.resize(bytes);
      if (!ReadAll(segment->fd, buffer.data(), bytes, offset)) break;
      uint32_t stored = 0;
      std::memcpy(&stored, buffer.data() + bytes - kCrcBytes, kCrcBytes);
      const uint64_t at = offset;
      offset += bytes;
      if (Crc32c(absl::string_view(buffer.data(), bytes - kCrcBytes)) != stored) {
        ++report.torn;
        ++crc_failures_;
        continue;
      }
      ++report.records;
      max_lsn = std::max(max_lsn, lsn);
      segment->size = offset;
      Reader header(absl::string_view(buffer.data() + kFrameBytes, header_bytes));
      const std::string session = header.GetString();
      if (version < kOldestVersion || version > kVersion) {
        damaged[session] = absl::StrCat("its records on disk are of spill format version ", version,
                                        ", this turbokvd reads ", kOldestVersion, " to ", kVersion);
        continue;
      }
      const std::string tenant = header.GetString();
      if (type == kTombstone) {
        tombstone[session] = std::max(tombstone[session], lsn);
        segment->tombstones.insert(session);
        segment->tombstone_tenants[session] = tenant;
        continue;
      }
      segment->sessions.insert(session);
      PageInfo page;
      if (type == kPage) {
        page = PageInfo{lsn, session, header.Get<int32_t>(), header.Get<int32_t>(), header.Get<int32_t>(),
                        static_cast<CodecKind>(header.Get<uint8_t>()), static_cast<CodecKind>(header.Get<uint8_t>()),
                        header.Get<uint64_t>(), tenant, version >= kVersionShared ? header.GetString() : ""};
      }
      auto record = std::make_shared<Record>(this, lsn, bytes, page.shared_name);
      record->segment = segment.get();
      record->offset = at;
      record->done = true;
      segment->records.insert(record.get());
      segment->live += bytes;
      live_bytes_ += static_cast<int64_t>(bytes);
      records[lsn] = record;
      if (type == kManifest) {
        ManifestInfo& newest = newest_manifest[session];
        if (lsn > newest.lsn) {
          newest = ManifestInfo{lsn, std::string(buffer.data() + kFrameBytes, header_bytes), version};
        }
      } else if (type == kPage && !header.short_read()) {
        pages[session].push_back(std::move(page));
      }
    }
    segments_.emplace(number, std::move(segment));
  }
  next_lsn_ = max_lsn + 1;
  written_lsn_ = max_lsn;
  const int pt = options_.page_tokens;
  for (auto& [id, manifest] : newest_manifest) {
    auto dead = tombstone.find(id);
    if (dead != tombstone.end() && dead->second > manifest.lsn) continue;
    if (damaged.count(id) != 0) continue;
    Reader in(manifest.header);
    absl::StatusOr<SessionHeader> header =
        GetSessionHeader(in, pt, "its manifest on disk", std::min<int>(manifest.version, kHeaderStorage));
    if (!header.ok()) {
      damaged[id] = std::string(header.status().message());
      continue;
    }
    TierSession session;
    session.header = *std::move(header);
    session.pinned = in.Get<uint8_t>() != 0;
    session.manifest = records[manifest.lsn];
    const SessionConfig& config = session.header.config;
    bool malformed = false;
    for (int l = 0; l < config.layers; ++l) {
      TierLayer layer;
      layer.tokens = in.Get<int64_t>();
      const uint32_t count = in.Get<uint32_t>();
      if (in.short_read() || layer.tokens < 0 || layer.tokens > config.max_tokens ||
          count != static_cast<uint64_t>((layer.tokens + pt - 1) / pt)) {
        malformed = true;
        break;
      }
      // Every lsn is read (the next layer's entry follows them); a page it
      // names that is not there (a crash, or its record failed its CRC)
      // ends the layer.
      bool missing = false;
      for (uint32_t i = 0; i < count; ++i) {
        auto found = records.find(in.Get<uint64_t>());
        if (missing || found == records.end()) {
          if (!missing) layer.tokens = std::min<int64_t>(layer.tokens, int64_t{i} * pt);
          missing = true;
          continue;
        }
        layer.pages.push_back(found->second);
      }
      if (manifest.version >= 3 && !GetLayerExtras(in, "its manifest on disk", &layer.extras).ok()) {
        malformed = true;
        break;
      }
      session.layers.push_back(std::move(layer));
    }
    if (manifest.version >= kVersionShared) session.shared_epoch = in.Get<int64_t>();
    if (!malformed && manifest.version >= kVersionNamed) {
      malformed = !GetNamedBlocks(in, "its manifest on disk", &session.named).ok();
    }
    if (malformed || in.short_read()) {
      damaged[id] = "its manifest on disk is malformed";
      continue;
    }
    // Pages sealed after the manifest extend (or replace the tail of) their layer.
    std::vector<PageInfo>& later = pages[id];
    std::sort(later.begin(), later.end(), [](const PageInfo& a, const PageInfo& b) { return a.lsn < b.lsn; });
    for (const PageInfo& page : later) {
      if (page.lsn < manifest.lsn || page.layer < 0 || page.layer >= config.layers || page.index < 0 ||
          page.tokens < 1 || page.tokens > pt) {
        continue;
      }
      if (page.key_codec != config.KeyCodec(page.layer) || page.value_codec != config.ValueCodec(page.layer) ||
          page.seed != config.rotation_seed) {
        malformed = true;
        break;
      }
      TierLayer& layer = session.layers[static_cast<size_t>(page.layer)];
      if (static_cast<size_t>(page.index) > layer.pages.size()) continue;  // after a page that is missing
      layer.pages.resize(static_cast<size_t>(page.index));
      layer.pages.push_back(records[page.lsn]);
      layer.tokens = int64_t{page.index} * pt + page.tokens;
    }
    if (malformed) {
      damaged[id] = "its page records on disk do not match its manifest's codecs";
      continue;
    }
    report.sessions.push_back(std::move(session));
  }
  for (auto& [id, why] : damaged) report.damaged.emplace_back(id, absl::DataLossError(why));
  for (const auto& [id, infos] : pages) {
    auto dead = tombstone.find(id);
    for (const PageInfo& page : infos) {
      if (page.shared_name.empty() || (dead != tombstone.end() && dead->second > page.lsn)) continue;
      report.named.push_back(TierScanReport::Named{id, page.tenant, records[page.lsn]});
    }
  }
  // Records no session holds die here (and segments left without live
  // records go); the writer appends to a new segment.
  records.clear();
  newest_manifest.clear();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Segment*> all;
    for (auto& [number, segment] : segments_) all.push_back(segment.get());
    for (Segment* segment : all) MaybeRemove(segment);
  }
  for (const TierSession& session : report.sessions) {
    report.bytes += static_cast<int64_t>(session.manifest->bytes());
    for (const TierLayer& layer : session.layers) {
      for (const auto& page : layer.pages) report.bytes += static_cast<int64_t>(page->bytes());
    }
  }
  if (absl::Status status = OpenActive(); !status.ok()) return status;
  writer_ = std::thread([this] { WriterLoop(); });
  return report;
}

void DiskTier::Enqueue(Job job) {
  job.lsn = next_lsn_++;
  queued_bytes_ += static_cast<int64_t>(job.bytes);
  queue_.push_back(std::move(job));
  work_.notify_one();
}

absl::StatusOr<std::shared_ptr<TierRecord>> DiskTier::PutPage(const PageKey& key, absl::string_view page, bool force) {
  std::string header;
  PutString(&header, key.session);
  PutString(&header, key.tenant);
  Put<int32_t>(&header, key.layer);
  Put<int32_t>(&header, key.index);
  Put<int32_t>(&header, key.tokens);
  Put<uint8_t>(&header, static_cast<uint8_t>(key.key_codec));
  Put<uint8_t>(&header, static_cast<uint8_t>(key.value_codec));
  Put<uint64_t>(&header, key.rotation_seed);
  const uint16_t version = key.shared_name.empty() ? kVersionWithoutRedis : kVersionShared;
  if (version >= kVersionShared) PutString(&header, key.shared_name);
  const size_t bytes = kFrameBytes + header.size() + page.size() + kCrcBytes;
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<size_t>(live_bytes_ + queued_bytes_) + bytes > options_.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "spill budget exceeded: ", FormatByteSize(static_cast<size_t>(live_bytes_ + queued_bytes_)), " on disk, ",
        FormatByteSize(bytes), " needed, --spill-budget ", FormatByteSize(options_.budget_bytes)));
  }
  if (!force && static_cast<size_t>(queued_bytes_) + bytes > options_.max_queued_bytes) {
    return absl::UnavailableError(absl::StrCat("the spill writer has ", FormatByteSize(queued_bytes_), " queued"));
  }
  auto record = std::make_shared<Record>(this, next_lsn_, bytes, key.shared_name);
  Job job;
  job.type = kPage;
  job.record = record;
  job.session = key.session;
  job.head = Frame(kPage, next_lsn_, header, page.size(), version);
  job.head.append(page.data(), page.size());
  job.bytes = bytes;
  Enqueue(std::move(job));
  return std::shared_ptr<TierRecord>(std::move(record));
}

std::shared_ptr<TierRecord> DiskTier::PutManifest(const TierSession& session) {
  std::string header;
  PutSessionHeader(&header, session.header);
  Put<uint8_t>(&header, session.pinned ? 1 : 0);
  for (const TierLayer& layer : session.layers) {
    Put<int64_t>(&header, layer.tokens);
    Put<uint32_t>(&header, static_cast<uint32_t>(layer.pages.size()));
    for (const auto& page : layer.pages) Put<uint64_t>(&header, page->lsn());
    PutLayerExtras(&header, layer.extras);
  }
  bool holds = false;
  for (const TierLayer& layer : session.layers) {
    holds = holds || HoldsPastSinks(layer.extras, session.header.config.sink_tokens);
  }
  const uint16_t version = holds                           ? kVersion
                           : !session.named.hashes.empty() ? kVersionNamed
                           : session.shared_epoch == 0     ? kVersionWithoutRedis
                                                           : kVersionShared;
  if (version >= kVersionShared) Put<int64_t>(&header, session.shared_epoch);
  if (version >= kVersionNamed) PutNamedBlocks(&header, session.named);
  const size_t bytes = kFrameBytes + header.size() + kCrcBytes;
  std::lock_guard<std::mutex> lock(mutex_);
  auto record = std::make_shared<Record>(this, next_lsn_, bytes);
  Job job;
  job.type = kManifest;
  job.record = record;
  job.session = session.header.id;
  job.head = Frame(kManifest, next_lsn_, header, 0, version);
  job.bytes = bytes;
  Enqueue(std::move(job));
  return record;
}

void DiskTier::PutTombstone(const std::string& session, const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mutex_);
  EnqueueTombstone(session, tenant);
}

void DiskTier::EnqueueTombstone(const std::string& session, const std::string& tenant) {
  std::string header;
  PutString(&header, session);
  PutString(&header, tenant);
  Job job;
  job.type = kTombstone;
  job.session = session;
  job.tenant = tenant;
  job.head = Frame(kTombstone, next_lsn_, header, 0, kVersionWithoutRedis);  // the same in every version
  job.bytes = kFrameBytes + header.size() + kCrcBytes;
  Enqueue(std::move(job));
}

absl::Status DiskTier::WriteRecord(const std::string& bytes, Segment** segment, uint64_t* offset) {
  Segment* active;
  size_t size;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    active = active_;
    size = active_->size;
  }
  if (size > 0 && size + bytes.size() > options_.segment_bytes) {
    if (fdatasync(active->fd) != 0) return Errno("cannot sync", active->path);
    unsynced_ = 0;
    if (absl::Status status = OpenActive(); !status.ok()) return status;
    std::lock_guard<std::mutex> lock(mutex_);
    active = active_;
    size = 0;
  }
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = pwrite(active->fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(size + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status status = Errno("cannot write", active->path);
      // Nothing half-written stays: the segment ends at its last whole record.
      if (ftruncate(active->fd, static_cast<off_t>(size)) != 0) {
        Logf(LogLevel::kError, "cannot cut %s back after a failed write: %s", active->path.c_str(),
                     std::strerror(errno));
      }
      return status;
    }
    done += static_cast<size_t>(n);
  }
  unsynced_ += bytes.size();
  if (unsynced_ >= options_.sync_bytes) {
    if (fdatasync(active->fd) != 0) return Errno("cannot sync", active->path);
    unsynced_ = 0;
  }
  *segment = active;
  *offset = size;
  return absl::OkStatus();
}

void DiskTier::WriterLoop() {
  std::string bytes;
  for (;;) {
    Job job;
    std::shared_ptr<Record> record;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Idle: reclaim a segment that is mostly dead records, one at a time.
      while (!stopping_ && queue_.empty()) {
        Segment* victim = CompactionVictim();
        if (victim == nullptr) {
          work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
          break;
        }
        lock.unlock();
        Compact(victim);
        lock.lock();
      }
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      record = job.record.lock();
    }
    absl::Status status;
    Segment* segment = nullptr;
    uint64_t offset = 0;
    if (record != nullptr || job.type == kTombstone) {
      bytes = std::move(job.head);
      Put<uint32_t>(&bytes, Crc32c(bytes));
      status = WriteRecord(bytes, &segment, &offset);
      if (!status.ok()) {
        Logf(LogLevel::kError, "spill write failed, the session stays in memory: %s",
                     std::string(status.message()).c_str());
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queued_bytes_ -= static_cast<int64_t>(job.bytes);
      written_lsn_ = job.lsn;
      if (!status.ok()) {
        ++write_errors_;
      } else if (segment != nullptr) {
        segment->size = offset + bytes.size();
        ++records_written_;
        if (job.type == kTombstone) {
          segment->tombstones.insert(job.session);
          segment->tombstone_tenants[job.session] = job.tenant;
        } else {
          segment->sessions.insert(job.session);
        }
      }
      if (record != nullptr) {
        record->done = true;
        record->status = status;
        if (status.ok()) {
          record->segment = segment;
          record->offset = offset;
          segment->records.insert(record.get());
          segment->live += record->bytes();
          live_bytes_ += static_cast<int64_t>(record->bytes());
        }
      }
    }
    written_.notify_all();
    record.reset();  // may be the last handle: Release takes the mutex
  }
}

DiskTier::Segment* DiskTier::CompactionVictim() const {
  size_t bytes = 0, dead = 0;
  Segment* victim = nullptr;
  for (const auto& [number, segment] : segments_) {
    bytes += segment->size;
    if (segment.get() == active_) continue;
    dead += segment->size - segment->live;
    if (victim == nullptr || segment->size - segment->live > victim->size - victim->live) victim = segment.get();
  }
  // Dead records past a quarter of the files (and a segment's worth): the
  // segment with the most of them goes, once its live ones are copied.
  if (victim == nullptr || dead * 4 <= bytes || dead < options_.segment_bytes || victim->live * 2 > victim->size) {
    return nullptr;
  }
  return victim;
}

void DiskTier::Compact(Segment* segment) {
  struct Live {
    Record* record;
    uint64_t offset;
    size_t bytes;
  };
  std::vector<Live> live;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++segment->pins;
    for (Record* record : segment->records) live.push_back(Live{record, record->offset, record->bytes()});
  }
  std::string bytes;
  for (const Live& one : live) {
    // The record as it is (its lsn and CRC unchanged) at the log's end.
    bytes.resize(one.bytes);
    Segment* to = nullptr;
    uint64_t offset = 0;
    if (!ReadAll(segment->fd, bytes.data(), one.bytes, one.offset) || !WriteRecord(bytes, &to, &offset).ok()) break;
    Reader header(absl::string_view(bytes).substr(kFrameBytes));
    const std::string session = header.GetString();
    std::lock_guard<std::mutex> lock(mutex_);
    to->size = offset + bytes.size();
    to->sessions.insert(session);
    if (segment->records.erase(one.record) == 0) continue;  // it died meanwhile
    segment->live -= one.bytes;
    one.record->segment = to;
    one.record->offset = offset;
    to->records.insert(one.record);
    to->live += one.bytes;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  ++compactions_;
  --segment->pins;
  MaybeRemove(segment);
}

void DiskTier::Release(Record* record) {
  if (record->segment == nullptr) return;
  record->segment->records.erase(record);
  record->segment->live -= record->bytes();
  live_bytes_ -= static_cast<int64_t>(record->bytes());
  MaybeRemove(record->segment);
}

void DiskTier::MaybeRemove(Segment* segment) {
  if (closed_ || segment == active_ || segment->live > 0 || segment->pins > 0) return;
  // A tombstone here still matters while an older segment holds records of
  // its session: written again (at the log's end) before this one goes.
  for (const std::string& session : segment->tombstones) {
    for (auto& [number, older] : segments_) {
      if (number >= segment->number) break;
      if (older->sessions.count(session) != 0) {
        EnqueueTombstone(session, segment->tombstone_tenants[session]);
        break;
      }
    }
  }
  close(segment->fd);
  unlink(segment->path.c_str());
  segments_.erase(segment->number);
}

absl::Status DiskTier::Wait(const TierRecord& record) {
  const auto& r = static_cast<const Record&>(record);
  std::unique_lock<std::mutex> lock(mutex_);
  written_.wait(lock, [&] { return r.done || written_lsn_ >= r.lsn(); });
  if (!r.done) return absl::UnavailableError("the spill writer dropped the record");
  return r.status;
}

absl::Status DiskTier::Read(const TierRecord& record, uint8_t* out, size_t bytes) {
  const auto& r = static_cast<const Record&>(record);
  int fd;
  uint64_t offset;
  std::string path;
  Segment* segment;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    written_.wait(lock, [&] { return r.done; });
    if (!r.status.ok()) return r.status;
    fd = r.segment->fd;
    offset = r.offset;
    path = r.segment->path;
    ++r.segment->pins;  // a compaction may move the record meanwhile: its old segment stays until this read is done
    segment = r.segment;
  }
  const auto unpin = absl::MakeCleanup([&] {
    std::lock_guard<std::mutex> lock(mutex_);
    --segment->pins;
    MaybeRemove(segment);
  });
  // The frame and header, the payload straight into `out`, the CRC: one read.
  if (r.bytes() < kFrameBytes + bytes + kCrcBytes) {
    return absl::DataLossError(absl::StrCat("the record at ", path, " offset ", offset, " is not a page of ", bytes,
                                            " bytes"));
  }
  std::string head(r.bytes() - bytes - kCrcBytes, '\0');
  uint32_t stored = 0;
  iovec parts[3] = {{head.data(), head.size()}, {out, bytes}, {&stored, kCrcBytes}};
  const size_t total = r.bytes();
  ssize_t got;
  do {
    got = preadv(fd, parts, 3, static_cast<off_t>(offset));
  } while (got < 0 && errno == EINTR);
  if (got < 0) return Errno("cannot read", path);
  if (static_cast<size_t>(got) != total) return absl::DataLossError(absl::StrCat(path, " is cut short at offset ", offset));
  Reader in(head);
  in.Take(4);
  in.Get<uint16_t>();
  const uint8_t type = in.Get<uint8_t>();
  in.Get<uint8_t>();
  in.Get<uint64_t>();
  const uint32_t header_bytes = in.Get<uint32_t>(), payload_bytes = in.Get<uint32_t>();
  const uint32_t crc = Crc32c(absl::string_view(reinterpret_cast<const char*>(out), bytes), Crc32c(head));
  if (crc != stored) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++crc_failures_;
    return absl::DataLossError(absl::StrCat("a page record at ", path, " offset ", offset, " fails its CRC"));
  }
  if (type != kPage || payload_bytes != bytes || kFrameBytes + header_bytes != head.size()) {
    return absl::DataLossError(absl::StrCat("the record at ", path, " offset ", offset, " is not a page of ", bytes,
                                            " bytes"));
  }
  return absl::OkStatus();
}

void DiskTier::WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) {
  // The kernel reads them ahead, all at once, while Read takes one at a time.
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& record : records) {
    const auto& r = static_cast<const Record&>(*record);
    if (r.done && r.segment != nullptr) {
      posix_fadvise(r.segment->fd, static_cast<off_t>(r.offset), static_cast<off_t>(r.bytes()), POSIX_FADV_WILLNEED);
    }
  }
}

absl::Status DiskTier::Sync() {
  uint64_t lsn;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lsn = next_lsn_ - 1;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  written_.wait(lock, [&] { return written_lsn_ >= lsn; });
  for (auto& [number, segment] : segments_) {
    if (fdatasync(segment->fd) != 0 && segment.get() == active_) return Errno("cannot sync", segment->path);
  }
  return absl::OkStatus();
}

void DiskTier::Close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
}

TierStats DiskTier::Stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TierStats stats;
  for (const auto& [number, segment] : segments_) stats.bytes += static_cast<int64_t>(segment->size);
  stats.live_bytes = live_bytes_;
  stats.budget_bytes = static_cast<int64_t>(options_.budget_bytes);
  stats.queued_bytes = queued_bytes_;
  stats.records_written = records_written_;
  stats.write_errors = write_errors_;
  stats.crc_failures = crc_failures_;
  stats.compactions = compactions_;
  return stats;
}

}  // namespace turbokv
