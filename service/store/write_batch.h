// The store's write transaction (docs/ARCHITECTURE.md, "The store's write
// transaction"): the new tokens one call appends to layers of its sessions.
// Add takes each chunk's pages (room made first), the backend encodes the
// chunks (Jobs, alone or with the call's attention), Apply installs them in
// the layers, Commit makes them as durable as the tier promises. A batch
// dropped before Apply changes nothing: its pages go back to the pool.
// The caller holds the mutexes of the sessions it adds. No gRPC types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "service/store/layer_cache.h"
#include "service/store/session_cache.h"
#include "service/store/session_store.h"

namespace turbokv {

class WriteBatch {
 public:
  // One layer's chunk: where its keys and values ([n][kv_heads][head_dim])
  // are, and its queries ([n][q_heads][head_dim], or null) for a key
  // transform it fits; Apply fills before, after and undo.
  struct Write {
    SessionCache* session = nullptr;
    int layer = 0;
    LayerCache::PendingAppend pending;
    const float* keys = nullptr;
    const float* values = nullptr;
    const float* queries = nullptr;
    EncodeStats key_errors;  // this chunk's quantization error, once encoded
    EncodeStats value_errors;
    int64_t before = 0;  // the layer's length around Apply
    int64_t after = 0;
    LayerCache::Undo undo;  // what Apply replaced
  };

  // A batch over sessions of `store` whose mutexes the caller holds;
  // making room spares the sessions in `held`.
  WriteBatch(SessionStore& store, absl::Span<const SessionCache* const> held);
  WriteBatch(const WriteBatch&) = delete;  // the jobs point into the writes

  // Takes the pages of n tokens from `start` of each of `layers` of the
  // session, making room first (SessionStore::MakeRoom, sparing the
  // sessions the batch was prepared with); all or none. Keys and values are
  // [layers.size()][n][kv_heads][head_dim], queries [layers.size()][n]
  // [q_heads][head_dim] or null. Returns the index of the first layer's
  // write; the others follow it. Not after Jobs.
  absl::StatusOr<size_t> Add(SessionCache& session, absl::Span<const int> layers, int64_t start, int64_t n,
                             const float* keys, const float* values, const float* queries);

  // The backend's jobs, one per write with new tokens (LayerCache::Chunk);
  // made at the first call, after the last Add. Keep the batch until they
  // are done.
  absl::Span<const EncodeChunk> Jobs();
  // The attention problem over write w's layer as the batch leaves it
  // (LayerCache::PendingAttention), for a backend that encodes and then
  // attends in one call; the layer as it is when the write has no new
  // tokens. After Jobs.
  AttentionProblem Attention(size_t w, const AttentionQueries& queries, const AttentionOutput& output);
  // Installs every write (its jobs done) in its layer and adds its
  // quantization error to its session's.
  void Apply();
  // Puts the layers back as they were before Apply.
  void Undo();
  // Makes each Add's new tokens as durable as the tier promises
  // (Residency::QueueNewTokens, then AwaitNewTokens: every Add's queued
  // before any is waited for). A status per write, its Add's; an Add the
  // tier did not take is undone in its layers.
  std::vector<absl::Status> Commit();

  const std::vector<Write>& writes() const { return writes_; }

 private:
  // One past Add a's last write.
  size_t AddEnd(size_t a) const { return a + 1 < adds_.size() ? adds_[a + 1] : writes_.size(); }

  SessionStore& store_;
  std::vector<const SessionCache*> held_;
  std::vector<Write> writes_;
  std::vector<size_t> adds_;  // each Add's first write
  bool prepared_ = false;
  std::vector<EncodeChunk> chunks_;
  std::vector<size_t> chunk_of_;  // chunks_[chunk_of_[w]] is write w's (SIZE_MAX: none)
  std::vector<std::vector<const uint8_t*>> tables_;  // the pages each job points to
  std::vector<const uint8_t*> sink_tables_;          // each problem's sink page
};

}  // namespace turbokv
