#include "service/kv_events.h"

#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/log.h"

namespace turbokv {
namespace {

// msgpack, the few types the events use (big-endian lengths and numbers).
class Msgpack {
 public:
  void Array(size_t n) { Header(n, 0x90, 15, 0xdc, 0xdd); }
  void Map(size_t n) { Header(n, 0x80, 15, 0xde, 0xdf); }
  void Str(const std::string& s) {
    if (s.size() <= 31) {
      out_.push_back(static_cast<char>(0xa0 | s.size()));
    } else {
      Header(s.size(), 0, 0, 0xda, 0xdb, 0xd9);
    }
    out_ += s;
  }
  void Bin(const std::string& b) {
    Header(b.size(), 0, 0, 0xc5, 0xc6, 0xc4);
    out_ += b;
  }
  void Nil() { out_.push_back(static_cast<char>(0xc0)); }
  void Int(int64_t v) {
    if (v >= 0) {
      UInt(static_cast<uint64_t>(v));
      return;
    }
    out_.push_back(static_cast<char>(0xd3));
    BigEndian(static_cast<uint64_t>(v), 8);
  }
  void UInt(uint64_t v) {
    if (v <= 127) {
      out_.push_back(static_cast<char>(v));
      return;
    }
    out_.push_back(static_cast<char>(0xcf));
    BigEndian(v, 8);
  }
  void Double(double v) {
    uint64_t bits = 0;
    std::memcpy(&bits, &v, 8);
    out_.push_back(static_cast<char>(0xcb));
    BigEndian(bits, 8);
  }
  std::string Take() { return std::move(out_); }

 private:
  void BigEndian(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  // A length: a fixed form up to `fixed_max` (when fixed_max > 0), else 8-
  // (when one8 is set), 16- or 32-bit forms.
  void Header(size_t n, uint8_t fixed, size_t fixed_max, uint8_t one16, uint8_t one32, uint8_t one8 = 0) {
    if (fixed_max > 0 && n <= fixed_max) {
      out_.push_back(static_cast<char>(fixed | n));
    } else if (one8 != 0 && n <= 0xff) {
      out_.push_back(static_cast<char>(one8));
      BigEndian(n, 1);
    } else if (n <= 0xffff) {
      out_.push_back(static_cast<char>(one16));
      BigEndian(n, 2);
    } else {
      out_.push_back(static_cast<char>(one32));
      BigEndian(n, 4);
    }
  }

  std::string out_;
};

std::string SeqBytes(int64_t seq) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((static_cast<uint64_t>(seq) >> (8 * (7 - i))) & 0xff);
  return bytes;
}

// Sends frames as one message; false when the socket refuses it.
bool SendFrames(void* socket, const std::vector<const std::string*>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const int flags = (i + 1 < frames.size() ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT;
    if (zmq_send(socket, frames[i]->data(), frames[i]->size(), flags) < 0) return false;
  }
  return true;
}

double Now() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

}  // namespace

std::string EncodeKvEventBatch(double ts, const std::vector<BlockEvent>& events, const KvEventsOptions& options) {
  Msgpack m;
  m.Array(3);  // ts, events, data-parallel rank
  m.Double(ts);
  m.Array(events.size());
  const auto hash = [&m, &options](const std::string& name) {
    if (!options.int_hashes) {
      m.Bin(name);
      return;
    }
    // vLLM's int.from_bytes(name, "big") & (2**64 - 1): the last 8 bytes.
    uint64_t value = 0;
    for (size_t i = name.size() > 8 ? name.size() - 8 : 0; i < name.size(); ++i) {
      value = (value << 8) | static_cast<uint8_t>(name[i]);
    }
    m.UInt(value);
  };
  // An event's map of `fields` entries, its type and its hashes first.
  const auto start_event = [&m, &hash](size_t fields, const char* type, const BlockEvent& event) {
    m.Map(fields);
    m.Str("type");
    m.Str(type);
    m.Str("block_hashes");
    m.Array(event.hashes.size());
    for (const std::string& name : event.hashes) hash(name);
  };
  for (const BlockEvent& event : events) {
    switch (event.kind) {
      case BlockEvent::kStored:
        start_event(10, "BlockStored", event);
        m.Str("parent_block_hash");
        if (event.has_parent) {
          hash(event.parent);
        } else {
          m.Nil();
        }
        m.Str("token_ids");
        m.Array(0);  // the daemon never sees them
        m.Str("block_size");
        m.Int(options.block_tokens);
        m.Str("lora_id");
        m.Nil();
        m.Str("medium");
        m.Str(event.medium);
        m.Str("lora_name");
        m.Nil();
        m.Str("group_idx");
        m.Int(0);
        m.Str("kv_cache_spec_kind");
        m.Str("full_attention");
        break;
      case BlockEvent::kRemoved:
        start_event(4, "BlockRemoved", event);
        m.Str("medium");
        m.Str(event.medium);
        m.Str("group_idx");
        m.Int(0);
        break;
      case BlockEvent::kCleared:
        m.Map(1);
        m.Str("type");
        m.Str("AllBlocksCleared");
        break;
    }
  }
  m.Int(options.data_parallel_rank);
  return m.Take();
}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(const KvEventsOptions& options) {
  std::unique_ptr<KvEventPublisher> publisher(new KvEventPublisher(options));
  publisher->context_ = zmq_ctx_new();
  if (publisher->context_ == nullptr) return absl::InternalError("cannot make a ZeroMQ context");
  const int linger_ms = 1000;
  const int hwm = kSendQueueBatches;
  const int64_t max_message = kMaxPeerMessageBytes;
  auto open = [&](int type, const std::string& endpoint, const char* flag) -> absl::StatusOr<void*> {
    void* socket = zmq_socket(publisher->context_, type);
    if (socket == nullptr) return absl::InternalError(absl::StrCat("cannot make a ZeroMQ socket: ", zmq_strerror(errno)));
    zmq_setsockopt(socket, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
    zmq_setsockopt(socket, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(socket, ZMQ_MAXMSGSIZE, &max_message, sizeof(max_message));
    if (zmq_bind(socket, endpoint.c_str()) != 0) {
      const std::string why = zmq_strerror(errno);
      zmq_close(socket);
      return absl::InvalidArgumentError(absl::StrCat(flag, "=", endpoint, ": cannot bind: ", why));
    }
    return socket;
  };
  absl::StatusOr<void*> pub = open(ZMQ_PUB, options.endpoint, "--kv-events-endpoint");
  if (!pub.ok()) return pub.status();
  publisher->pub_ = *pub;
  if (!options.replay_endpoint.empty()) {
    absl::StatusOr<void*> replay = open(ZMQ_ROUTER, options.replay_endpoint, "--kv-events-replay-endpoint");
    if (!replay.ok()) return replay.status();
    publisher->replay_ = *replay;
  }
  BlockEvent cleared;
  cleared.kind = BlockEvent::kCleared;
  publisher->Publish({cleared});
  publisher->thread_ = std::thread([p = publisher.get()] { p->Run(); });
  return publisher;
}

void KvEventPublisher::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

KvEventPublisher::~KvEventPublisher() {
  Stop();
  if (pub_ != nullptr) zmq_close(pub_);
  if (replay_ != nullptr) zmq_close(replay_);
  if (context_ != nullptr) zmq_ctx_term(context_);
}

void KvEventPublisher::Publish(const std::vector<BlockEvent>& events) {
  // Cut into batches of at most kMaxBatchHashes hashes (a stored chain cut
  // in two: the second part's parent is the first part's last hash).
  std::vector<std::vector<BlockEvent>> batches(1);
  size_t hashes = 0;
  for (const BlockEvent& event : events) {
    size_t from = 0;
    do {
      if (hashes == kMaxBatchHashes) {
        batches.emplace_back();
        hashes = 0;
      }
      const size_t take = std::min(event.hashes.size() - from, kMaxBatchHashes - hashes);
      BlockEvent part = event;
      part.hashes.assign(event.hashes.begin() + static_cast<std::ptrdiff_t>(from),
                         event.hashes.begin() + static_cast<std::ptrdiff_t>(from + take));
      if (from > 0) {
        part.has_parent = true;
        part.parent = event.hashes[from - 1];
      }
      batches.back().push_back(std::move(part));
      hashes += take;
      from += take;
    } while (from < event.hashes.size());
  }
  const double now = Now();
  std::vector<std::string> encoded;
  for (const std::vector<BlockEvent>& batch : batches) encoded.push_back(EncodeKvEventBatch(now, batch, options_));
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::string& batch : encoded) queued_.emplace_back(next_seq_.fetch_add(1), std::move(batch));
}

void KvEventPublisher::SetSnapshot(SnapshotFn snapshot) {
  std::lock_guard<std::mutex> lock(mutex_);
  snapshot_ = std::move(snapshot);
}

void KvEventPublisher::Run() {
  while (!stop_.load()) {
    zmq_pollitem_t items[1] = {{replay_, 0, ZMQ_POLLIN, 0}};
    // Batches wait at most this long; replay requests wake it at once.
    zmq_poll(items, replay_ != nullptr ? 1 : 0, 5);
    SendQueued();
    if (replay_ != nullptr && (items[0].revents & ZMQ_POLLIN) != 0) ServeReplay();
  }
  SendQueued();
}

void KvEventPublisher::SendQueued() {
  std::deque<std::pair<uint64_t, std::string>> batches;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    batches.swap(queued_);
  }
  for (auto& [seq, batch] : batches) {
    const std::string seq_bytes = SeqBytes(static_cast<int64_t>(seq));
    // A subscriber too slow for the send queue misses batches: the gap in
    // the numbers tells it to ask for a replay.
    SendFrames(pub_, {&options_.topic, &seq_bytes, &batch});
    size_t kept_bytes = kept_bytes_.load() + batch.size();
    kept_.emplace_back(seq, std::move(batch));
    while (kept_.size() > 1 && (kept_.size() > options_.buffer_batches || kept_bytes > options_.buffer_bytes)) {
      kept_bytes -= kept_.front().second.size();
      kept_.pop_front();
    }
    kept_bytes_.store(kept_bytes);
  }
}

void KvEventPublisher::ServeReplay() {
  std::vector<std::string> frames;
  for (;;) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, replay_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&part);
      return;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&part)), zmq_msg_size(&part));
    const bool more = zmq_msg_more(&part) != 0;
    zmq_msg_close(&part);
    if (!more) break;
  }
  // [identity, empty, start]
  if (frames.size() != 3 || !frames[1].empty() || frames[2].size() != 8) {
    static RateLimitedLog malformed(absl::Seconds(10));
    malformed.Log(LogLevel::kWarning, absl::StrCat("kv events: a replay request of ", frames.empty() ? 0 : frames.size() - 1,
                                                   " frames is not [empty, 8-byte start]: ignored"));
    return;
  }
  uint64_t start = 0;
  for (char c : frames[2]) start = (start << 8) | static_cast<uint8_t>(c);
  const std::string empty;
  auto reply = [&](uint64_t seq, const std::string& batch) {
    const std::string seq_bytes = SeqBytes(static_cast<int64_t>(seq));
    return SendFrames(replay_, {&frames[0], &empty, &seq_bytes, &batch});
  };
  SendQueued();
  uint64_t from = start;
  SnapshotFn snapshot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot = snapshot_;
  }
  if ((kept_.empty() || start < kept_.front().first) && snapshot != nullptr) {
    uint64_t seq = 0;
    std::string batch;
    snapshot([&](std::vector<BlockEvent> events) {
      // Under the index's lock: no batch is numbered meanwhile.
      seq = next_seq_.load() - 1;
      batch = EncodeKvEventBatch(Now(), events, options_);
    });
    if (!reply(seq, batch)) return;
    SendQueued();
    from = seq + 1;
  }
  for (const auto& [seq, batch] : kept_) {
    if (seq >= from && !reply(seq, batch)) return;
  }
  const std::string end = SeqBytes(-1);
  SendFrames(replay_, {&frames[0], &empty, &end, &empty});
}

}  // namespace turbokv
