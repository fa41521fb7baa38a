// KV events for routers that place requests where the KV already is: the
// blocks held for reuse (PrefixIndex), per medium, published the way vLLM
// publishes its KV cache events (docs/OPERATIONS.md "KV events"):
//
//   PUB socket, each message three frames: the topic, the sequence number
//   (8 bytes, big-endian, from 0, one per batch), and the batch in msgpack:
//   [ts, [event, ...], data_parallel_rank], each event a map tagged by its
//   "type", as vLLM 0.32 encodes them (KVEventBatch, its events maps since
//   vLLM 0.26):
//     {type: "BlockStored", block_hashes: [hash, ...], parent_block_hash:
//      hash | nil, token_ids: [], block_size, lora_id: nil, medium,
//      lora_name: nil, group_idx: 0, kv_cache_spec_kind: "full_attention"}
//     {type: "BlockRemoved", block_hashes: [hash, ...], medium, group_idx: 0}
//     {type: "AllBlocksCleared"}
//   hashes as the clients named the blocks (msgpack bin), or with
//   int_hashes the unsigned 64-bit integer of each name's last 8 bytes
//   (big-endian), which is how vLLM publishes its own (its default,
//   VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a client that names blocks by
//   vLLM's block hashes gets vLLM's integers. token_ids empty (the daemon
//   never sees tokens); medium "memory", "disk" or "redis"; one cache group
//   holding every layer.
//
//   Replay (optional): a ROUTER socket; a request [empty, start seq (8
//   bytes, big-endian)] (what a REQ socket sends) is answered with
//   [empty, seq, batch] for every batch kept from `start` on, then
//   [empty, -1 (8 bytes), empty]. When `start` is older than the batches
//   kept, the first answer is a snapshot: one batch (numbered as the last
//   batch it includes) of AllBlocksCleared and BlockStored events building
//   what is held now.
//
// The first batch a publisher sends (seq 0) is AllBlocksCleared. No gRPC and
// no store types beyond the events.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "service/store/prefix_index.h"

namespace turbokv {

struct KvEventsOptions {
  std::string endpoint;         // PUB, e.g. tcp://*:5557 (empty: no events)
  std::string replay_endpoint;  // ROUTER (empty: no replay)
  std::string topic = "kv-events";
  size_t buffer_batches = 10000;  // kept for replay, at most
  size_t buffer_bytes = 0;        // and at most these bytes of them (0: the server's default, KvEventsBufferBytes)
  int block_tokens = 0;         // BlockStored's block_size
  bool int_hashes = false;      // hashes as vLLM's integers (above), not bytes
  int64_t data_parallel_rank = 0;  // the batch's third element
};

// The replay buffer's bytes when none are given: a 64th of the memory
// budget, from 1 MiB to 64 MiB.
inline size_t KvEventsBufferBytes(size_t memory_budget) {
  return std::clamp(memory_budget / 64, size_t{1} << 20, size_t{64} << 20);
}

// Hashes in one batch at most: a change of more (NameBlocks of a long
// prompt) goes out as several consecutive batches, so that each message a
// slow subscriber's send queue holds stays small.
constexpr size_t kMaxBatchHashes = 1024;
// Messages a subscriber's send queue holds at most (ZMQ_SNDHWM); past them
// the subscriber misses batches and asks for a replay.
constexpr int kSendQueueBatches = 1000;
// The largest message either socket takes from a peer (ZMQ_MAXMSGSIZE): a
// replay request is 8 bytes, a subscription its topic; a peer that sends
// more is disconnected before the daemon buffers it.
constexpr int64_t kMaxPeerMessageBytes = 1024;

// msgpack of a batch of events at time `ts` (seconds since the epoch), as
// `options` say (block_tokens, int_hashes, data_parallel_rank).
std::string EncodeKvEventBatch(double ts, const std::vector<BlockEvent>& events, const KvEventsOptions& options);

class KvEventPublisher {
 public:
  // Binds the sockets (INVALID_ARGUMENT naming the endpoint that fails) and
  // queues the first batch, AllBlocksCleared.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(const KvEventsOptions& options);
  ~KvEventPublisher();  // Stop, then closes the sockets
  // Sends what is queued and stops the thread: no replay is answered, and
  // the snapshot function is not called, from then on (batches published
  // later are dropped).
  void Stop();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Queues one batch: only encodes and queues (called under the index's
  // lock, in the order of the changes).
  void Publish(const std::vector<BlockEvent>& events);
  // How a replay that starts before the batches kept gets the state: calls
  // its argument with the events that build it (PrefixIndex::Snapshot).
  using SnapshotFn = std::function<void(const std::function<void(std::vector<BlockEvent>)>&)>;
  void SetSnapshot(SnapshotFn snapshot);
  uint64_t batches() const { return next_seq_.load(); }
  // Bytes of the batches kept for replay (within options.buffer_bytes).
  size_t kept_bytes() const { return kept_bytes_.load(); }

 private:
  explicit KvEventPublisher(const KvEventsOptions& options) : options_(options) {}
  void Run();
  // Sends what is queued, keeping it for replay.
  void SendQueued();
  void ServeReplay();

  const KvEventsOptions options_;
  void* context_ = nullptr;
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  std::mutex mutex_;
  std::deque<std::pair<uint64_t, std::string>> queued_;  // seq, batch
  std::atomic<uint64_t> next_seq_{0};
  SnapshotFn snapshot_;
  std::atomic<bool> stop_{false};
  std::deque<std::pair<uint64_t, std::string>> kept_;  // the thread's
  std::atomic<size_t> kept_bytes_{0};
  std::thread thread_;
};

}  // namespace turbokv
