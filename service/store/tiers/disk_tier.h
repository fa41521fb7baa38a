// The local disk tier (--spill-dir): an append-only log of records in
// segment files seg-NNNNNNNN.tkvl (docs/FORMAT.md, "Spill segments"), written
// by one writer thread from a bounded queue, fdatasync'ed every sync_bytes
// and at each segment's end. A segment whose records are all dead is
// removed (tombstones it holds that still matter are written again first);
// once dead records pass a quarter of the files, the writer, when idle,
// copies the live records of the deadest segment to the log's end.
// At start the segments are scanned and the sessions rebuilt: the newest
// manifest of each, then its page records written after it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "service/store/tiers/tier.h"

namespace turbokv {

struct DiskTierOptions {
  std::string dir;
  size_t budget_bytes = size_t{64} << 30;  // of live records
  int page_tokens = 64;
  size_t segment_bytes = size_t{16} << 20;
  size_t sync_bytes = size_t{16} << 20;
  // Queued bytes past which writes that may wait (write-through) are
  // refused. The queue holds copies of the pages, outside the memory budget.
  size_t max_queued_bytes = size_t{64} << 20;
};

class DiskTier final : public Tier {
 public:
  // Creates the directory when missing and proves it writable (a probe
  // file); the error names it. Starts the writer.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  // Writes what is queued, syncs and stops the writer. Every handle must be
  // gone first.
  ~DiskTier() override;

  const char* name() const override { return "disk"; }
  absl::StatusOr<TierScanReport> Scan() override;
  absl::StatusOr<std::shared_ptr<TierRecord>> PutPage(const PageKey& key, absl::string_view page, bool force) override;
  std::shared_ptr<TierRecord> PutManifest(const TierSession& session) override;
  void PutTombstone(const std::string& session, const std::string& tenant) override;
  absl::Status Wait(const TierRecord& record) override;
  absl::Status Read(const TierRecord& record, uint8_t* out, size_t bytes) override;
  void WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) override;
  absl::Status Sync() override;
  void Close() override;
  TierStats Stats() const override;

  const DiskTierOptions& options() const { return options_; }

 private:
  struct Segment;
  class Record;
  struct Job;
  explicit DiskTier(const DiskTierOptions& options);

  // Under mutex_: queues a job (its lsn: the next one).
  void Enqueue(Job job);
  // Under mutex_: queues a tombstone of the session.
  void EnqueueTombstone(const std::string& session, const std::string& tenant);
  void WriterLoop();
  // Writes one record to the active segment (rolling it when full).
  absl::Status WriteRecord(const std::string& bytes, Segment** segment, uint64_t* offset);
  // Under mutex_: a record's last handle went.
  void Release(Record* record);
  // Under mutex_: removes a closed segment without live records.
  void MaybeRemove(Segment* segment);
  // Under mutex_: the closed segment to compact, when dead records take
  // more than a quarter of the files; or null.
  Segment* CompactionVictim() const;
  // The writer, when idle: copies the segment's live records to the log's
  // end and removes it.
  void Compact(Segment* segment);
  absl::Status OpenActive();

  const DiskTierOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable work_;     // the writer waits for jobs
  std::condition_variable written_;  // Wait waits for the writer
  std::deque<Job> queue_;
  bool stopping_ = false;
  bool closed_ = false;  // nothing is reclaimed
  uint64_t next_lsn_ = 1;
  uint64_t written_lsn_ = 0;  // every job up to it is done
  std::map<uint64_t, std::unique_ptr<Segment>> segments_;  // by number
  Segment* active_ = nullptr;
  size_t unsynced_ = 0;
  int64_t queued_bytes_ = 0;
  int64_t live_bytes_ = 0;
  int64_t records_written_ = 0;
  int64_t write_errors_ = 0;
  int64_t crc_failures_ = 0;
  int64_t compactions_ = 0;
  std::thread writer_;
};

}  // namespace turbokv
