// Snapshots of sessions on disk (--snapshot-dir): one file a session,
// <id>.tkvs, in the versioned format of docs/FORMAT.md ("Snapshots"): a
// header (id, tenant, configuration, tokens per layer), the layers' pages
// as the kernels read them, and a CRC-32C of everything before it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "service/store/session_store.h"

namespace turbokv {

constexpr char kSnapshotSuffix[] = ".tkvs";

// CRC-32C (Castagnoli) of `bytes`.
uint32_t Crc32c(absl::string_view bytes);

// The snapshot of a session whose mutex the caller holds.
std::string EncodeSnapshot(const SessionCache& session, int page_tokens);

struct DecodedSnapshot {
  std::string id;
  std::string tenant;
  SessionConfig config;
  absl::Time created;
  std::vector<int64_t> tokens;             // per layer
  std::vector<absl::string_view> pages;    // per layer, into the decoded bytes
};

// DATA_LOSS naming what is wrong: a bad magic, version or checksum, a
// truncated file, sizes that do not add up, a page size other than
// page_tokens.
absl::StatusOr<DecodedSnapshot> DecodeSnapshot(absl::string_view bytes, int page_tokens);

// Writes `bytes` to dir/name through dir/name.tmp, fsync and rename, then
// fsyncs the directory: a crash leaves the old file or the new one, whole.
absl::Status WriteFileAtomically(const std::string& dir, const std::string& name, absl::string_view bytes);

}  // namespace turbokv
