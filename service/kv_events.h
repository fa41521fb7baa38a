// KV events for routers that place requests where the KV already is: the
// blocks held for reuse (PrefixIndex), per medium, published the way vLLM
// publishes its KV cache events (docs/OPERATIONS.md "KV events"):
//
//   PUB socket, each message three frames: the topic, the sequence number
//   (8 bytes, big-endian, from 0, one per batch), and the batch in msgpack:
//   [ts, [event, ...]], each event a map tagged by its "type", as vLLM
//   encodes them since its events became maps (vLLM PR 42892, vLLM 0.26):
//     {type: "BlockStored", block_hashes: [hash, ...], parent_block_hash:
//      hash | nil, token_ids: [], block_size, lora_id: nil, medium,
//      lora_name: nil}
//     {type: "BlockRemoved", block_hashes: [hash, ...], medium}
//     {type: "AllBlocksCleared"}
//   hashes as the clients named the blocks (msgpack bin); token_ids empty
//   (the daemon never sees tokens); medium "memory", "disk" or "redis".
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
  size_t buffer_batches = 10000;  // kept for replay
  int block_tokens = 0;           // BlockStored's block_size
};

// msgpack of a batch of events at time `ts` (seconds since the epoch).
std::string EncodeKvEventBatch(double ts, const std::vector<BlockEvent>& events, int block_tokens);

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
  std::thread thread_;
};

}  // namespace turbokv
