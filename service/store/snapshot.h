// Snapshots of sessions on disk (--snapshot-dir): one file a session,
// <id>.tkvs, in the versioned format of docs/FORMAT.md ("Snapshots"): a
// header (id, tenant, configuration, tokens per layer), the layers' pages
// as the kernels read them, and a CRC-32C of everything before it. Files
// are written and read page by page: neither side holds a copy of the
// session. A drain that wrote every session also writes MANIFEST, the list
// of the files that are their sessions' last state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <unordered_map>
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "service/backend/backend.h"
#include "service/records/record_io.h"
#include "service/store/layer_cache.h"
#include "service/store/session_cache.h"

namespace turbokv {

constexpr char kSnapshotSuffix[] = ".tkvs";
constexpr char kManifestName[] = "MANIFEST";
// <id>.tkvs.stale: the older file of a session whose latest state could not
// be written; never loaded, kept for an operator.
constexpr char kStaleSuffix[] = ".stale";

// A snapshot's header, as read.
struct SnapshotHeader : SessionHeader {
  std::vector<int64_t> tokens;      // per layer
  std::vector<LayerExtras> extras;  // per layer (empty ones before version 3)
  NamedBlocks named;                // none before version 4
};

// Writes the snapshot of `session` with `layers` (its layers, or a frozen
// copy of them: see LayerCache::Fork; their pages read through `backend`)
// and the blocks it named
// to dir/<id>.tkvs through a temp file, fsync and rename, then fsyncs the
// directory: a crash leaves the old file or the new one, whole. Returns the
// CRC stored in it.
absl::StatusOr<uint32_t> WriteSnapshot(const std::string& dir, const SessionCache& session,
                                       const std::vector<LayerCache>& layers, const NamedBlocks& named,
                                       int page_tokens, Backend& backend);

// Reads the snapshot at `path`: checks the header against the limits
// CreateSession enforces and the file's size, calls make(header) for the
// session to fill, reads each layer's pages into it and checks the CRC.
// DATA_LOSS naming what is wrong (bad magic, version or checksum, a
// truncated file, sizes that do not add up, a page size other than
// page_tokens); make's error as it is. *crc: the file's CRC.
using MakeSession = std::function<absl::StatusOr<std::shared_ptr<SessionCache>>(const SnapshotHeader&)>;
absl::StatusOr<std::shared_ptr<SessionCache>> ReadSnapshot(const std::string& path, int page_tokens,
                                                           const MakeSession& make, uint32_t* crc);

// MANIFEST: session id -> CRC of its file.
using SnapshotManifest = std::unordered_map<std::string, uint32_t>;
absl::Status WriteManifest(const std::string& dir, const SnapshotManifest& manifest);
// NOT_FOUND when there is none; DATA_LOSS when it does not parse.
absl::StatusOr<SnapshotManifest> ReadManifest(const std::string& dir);

// Writes `bytes` to dir/name through dir/name.tmp, fsync and rename, then
// fsyncs the directory.
absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, absl::string_view bytes);

}  // namespace turbokv
