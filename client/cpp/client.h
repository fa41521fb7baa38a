// The C++ client of turbokvd: turbokv::Client (one channel) and
// turbokv::Session (one session's calls). Tensors go in as spans of f32, or
// of f16/bf16 bit patterns, laid out as the API says (docs/API.md):
// keys/values [tokens][kv_heads][head_dim] (all layers:
// [layers][tokens][kv_heads][head_dim]), queries [n][q_heads][head_dim].
// Errors come back as absl::Status carrying the server's code and message.
// A Client and its Sessions are thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/cpp/shared_memory.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "turbokv/v1/turbokv.grpc.pb.h"

namespace turbokv {

// The one conversion from grpc::Status to absl::Status on the client side.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A tensor's values as the caller holds them.
struct TensorData {
  v1::DType dtype = v1::DTYPE_F32;
  const void* data = nullptr;
  size_t count = 0;  // values

  static TensorData F32(absl::Span<const float> values) { return {v1::DTYPE_F32, values.data(), values.size()}; }
  static TensorData F16(absl::Span<const uint16_t> bits) { return {v1::DTYPE_F16, bits.data(), bits.size()}; }
  static TensorData BF16(absl::Span<const uint16_t> bits) { return {v1::DTYPE_BF16, bits.data(), bits.size()}; }
};

struct SessionOptions {
  int layers = 1;
  int kv_heads = 1;
  int q_heads = 1;
  int head_dim = 128;
  // Unspecified codecs and no preset: the daemon's default preset. A preset
  // excludes key_codec and value_codec; layer_codecs override either.
  v1::Codec key_codec = v1::CODEC_UNSPECIFIED;
  v1::Codec value_codec = v1::CODEC_UNSPECIFIED;
  std::string preset;  // k8v4, k4v4, k4v3, k3v4, k3v3, k2v2 (docs/API.md "Choosing a codec")
  std::vector<v1::LayerCodecs> layer_codecs;
  std::optional<uint64_t> rotation_seed;  // unset: the daemon draws one
  int64_t max_tokens = 0;                 // 0: the daemon's limit
  absl::Duration idle_ttl = absl::ZeroDuration();  // zero: the daemon's --session-ttl
  bool pinned = false;  // never demoted to the daemon's --spill-dir
  // How keys are stored before their codec (docs/API.md "Keys made safe");
  // unspecified: the daemon's default, center and scale.
  v1::KeyTransform key_transform = v1::KEY_TRANSFORM_UNSPECIFIED;
  bool center_values = false;
  std::optional<int> sink_tokens;  // unset: the daemon's default (4)
  v1::Codec sink_codec = v1::CODEC_UNSPECIFIED;  // f16 or q8_0
  // Reuse by content: the hashes of the session's first blocks
  // (BlockHashes); it starts with the longest prefix of them a session of
  // the same tenant and storage named (Session::NameBlocks), sharing its
  // pages. Session::prefix_tokens() says how many tokens it got.
  std::vector<std::string> prefix_blocks;
};

// The chained hashes naming the full blocks of `tokens` (token ids), as
// NameBlocks and SessionOptions::prefix_blocks take them: hash i =
// SHA-256(hash i-1 || block i's ids as little-endian int32), hash -1 =
// SHA-256(salt). A salt (e.g. the model's name and revision) keeps equal
// token ids of different models apart. docs/API.md "Reusing prefixes".
std::vector<std::string> BlockHashes(absl::Span<const int32_t> tokens, int block_tokens,
                                     absl::string_view salt = "");

struct Attention {
  std::vector<float> output;  // [n][q_heads][head_dim]
  std::vector<float> lse;     // [n][q_heads]
  std::vector<int64_t> top_k_tokens;  // [n][q_heads][top_k] when asked for
  std::vector<float> top_k_logits;
};

struct StepResult {
  int64_t tokens = 0;  // the layer's length after the step
  Attention attention;
};

struct KvData {
  int64_t tokens = 0;
  std::vector<float> keys;    // [tokens][kv_heads][head_dim], decoded
  std::vector<float> values;
};

struct ClientOptions {
  int max_message_bytes = 64 << 20;
  // Deadline of each unary call (streams have none); zero: none.
  absl::Duration timeout = absl::ZeroDuration();
  // Sent as "authorization: Bearer TOKEN" on every call (turbokvd with
  // --auth-tokens-file); empty: none.
  std::string auth_token;
  // TLS to a TCP listener: the PEM of the CA that signed the daemon's
  // certificate (empty: plaintext); for mTLS also this client's certificate
  // and key (PEM contents).
  std::string tls_root_certs;
  std::string tls_client_cert;
  std::string tls_client_key;
  // Over a unix socket, tensors travel through a shared-memory region of
  // this many bytes (docs/API.md, "Shared memory"), registered with the
  // daemon on first use; a call whose tensors do not fit, or a daemon that
  // serves no shared memory, sends them in the message. 0: always in the
  // message.
  size_t shared_memory_bytes = size_t{64} << 20;
};

// A pipelined Append stream: Write sends chunks without waiting for their
// acknowledgements, which a background thread collects. Finish closes the
// stream and returns the last acknowledgement or the stream's error. Use from
// one thread.
class AppendStream {
 public:
  ~AppendStream();  // cancels the stream if Finish was not called
  AppendStream(const AppendStream&) = delete;
  AppendStream& operator=(const AppendStream&) = delete;

  // layer < 0: all layers. queries (optional: none when empty), the
  // chunk's, [(layers)][n][q_heads][head_dim]: send them with a layer's first
  // chunk, which fits its key transform (docs/API.md "Keys made safe").
  // FAILED_PRECONDITION once the stream has failed (Finish then says why).
  absl::Status Write(int layer, int64_t start, const TensorData& keys, const TensorData& values,
                     const TensorData& queries = {});
  absl::StatusOr<v1::AppendResponse> Finish();
  int64_t acknowledged() const { return acknowledged_.load(); }

 private:
  friend class Session;
  AppendStream(v1::KvCacheService::Stub* stub, std::string session_id, const v1::SessionConfig& config,
               const ClientOptions& options, std::shared_ptr<SharedChannel> shared);

  std::string session_id_;
  v1::SessionConfig config_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AppendRequest, v1::AppendResponse>> stream_;
  std::thread reader_;
  std::atomic<int64_t> acknowledged_{0};
  v1::AppendResponse last_;  // written by the reader thread, read after join
  bool finished_ = false;
  bool broken_ = false;
  std::shared_ptr<SharedChannel> shared_;
  // The shared blocks of the chunks written and not yet acknowledged, in
  // order (null: sent as bytes); blocks_released_ were dropped before them.
  std::deque<std::unique_ptr<SharedBlock>> blocks_;
  int64_t blocks_released_ = 0;
};

// One message of a Decode stream: one layer's step for a batch of B
// sessions with k queries each (k > 1: draft tokens verified at once).
struct DecodeBatch {
  int layer = 0;
  std::vector<std::string> session_ids;  // [B], each once
  // [B][k]: query j of item i at positions[i * k + j]; with keys, item i's
  // tokens go at positions[i * k] + 0 .. k - 1.
  std::vector<int64_t> positions;
  int k = 1;
  int q_heads = 0;
  int kv_heads = 0;  // with keys
  int head_dim = 0;
  TensorData queries;  // [B][k][q_heads][head_dim]
  TensorData keys;     // [B][k][kv_heads][head_dim]; empty (count 0) with values: attention only
  TensorData values;
  v1::AttentionOptions options;
};

struct DecodeResult {
  int64_t batch = 0;
  int k = 1;
  std::vector<float> output;          // [B][k][q_heads][head_dim]; zeros for a failed item
  std::vector<float> lse;             // [B][k][q_heads]; -inf for a failed item
  std::vector<int64_t> tokens;        // [B] the layer's length after the step
  std::vector<absl::Status> status;   // [B] each item's outcome
  std::vector<int64_t> top_k_tokens;  // [B][k][q_heads][top_k] when asked for
  std::vector<float> top_k_logits;
  int failed = 0;                     // items whose status is not OK
};

// A Decode stream, held open for many steps: Write sends a batch without
// waiting, Read returns the results in the order written (a background
// thread collects them, so any number may be in flight). A bad item fails
// alone, in DecodeResult::status; a malformed message ends the stream, and
// Read and Finish then return why. Use from one thread.
class DecodeStream {
 public:
  ~DecodeStream();  // cancels the stream if Finish was not called
  DecodeStream(const DecodeStream&) = delete;
  DecodeStream& operator=(const DecodeStream&) = delete;

  absl::Status Write(const DecodeBatch& batch);
  // The result of the oldest batch written and not yet read.
  absl::StatusOr<DecodeResult> Read();
  // Write, then Read.
  absl::StatusOr<DecodeResult> Step(const DecodeBatch& batch);
  // Closes the stream: OK, or why it ended.
  absl::Status Finish();

 private:
  friend class Client;
  DecodeStream(v1::KvCacheService::Stub* stub, const ClientOptions& options, std::shared_ptr<SharedChannel> shared);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  std::thread reader_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<v1::DecodeResponse> responses_;  // read, not yet returned
  std::shared_ptr<SharedChannel> shared_;
  std::deque<std::unique_ptr<SharedBlock>> blocks_;  // of the batches written and not yet read (null: none)
  bool reader_done_ = false;
  int64_t pending_ = 0;  // written, not yet returned
  absl::Status finish_status_;  // the stream's status once the reader is done and Finish ran
  bool finished_ = false;
  bool broken_ = false;
};

class Session {
 public:
  const std::string& id() const { return id_; }
  // The effective configuration, as the daemon returned it.
  const v1::SessionConfig& config() const { return config_; }
  // Tokens per layer it started with (SessionOptions::prefix_blocks; 0 for
  // a handle from OpenSession or Fork), and the daemon's block size (also
  // Client::Stats().block_tokens()).
  int64_t prefix_tokens() const { return prefix_tokens_; }
  int block_tokens() const { return block_tokens_; }

  // Stores tokens [start, start + n) of one layer; n from the keys' size.
  // Returns the layer's new length. queries: as AppendStream::Write.
  absl::StatusOr<int64_t> Append(int layer, int64_t start, const TensorData& keys, const TensorData& values,
                                 const TensorData& queries = {}) const;
  // The same tokens for every layer at once: [layers][n][kv_heads][head_dim].
  absl::StatusOr<int64_t> AppendAllLayers(int64_t start, const TensorData& keys, const TensorData& values,
                                          const TensorData& queries = {}) const;
  std::unique_ptr<AppendStream> OpenAppendStream() const;

  // n queries; positions empty: each sees every stored token.
  absl::StatusOr<Attention> Attend(int layer, const TensorData& queries, absl::Span<const int64_t> positions = {},
                                   const v1::AttentionOptions& options = {}) const;
  // Appends one token at `position` and attends with its query.
  absl::StatusOr<StepResult> Step(int layer, int64_t position, const TensorData& key, const TensorData& value,
                                  const TensorData& query, const v1::AttentionOptions& options = {}) const;
  // Decoded keys and values of tokens [start, end) of a layer (end 0: all).
  absl::StatusOr<KvData> ReadKv(int layer, int64_t start = 0, int64_t end = 0) const;

  absl::StatusOr<Session> Fork(int64_t prefix_tokens) const;
  // Names blocks first_block, first_block + 1, ... (full in every layer) for
  // reuse by later sessions of the tenant (BlockHashes).
  absl::StatusOr<v1::NameBlocksResponse> NameBlocks(int64_t first_block, const std::vector<std::string>& hashes) const;
  absl::StatusOr<v1::SessionInfo> Truncate(int64_t tokens) const;
  absl::StatusOr<v1::SessionInfo> Info() const;
  absl::Status Delete() const;

 private:
  friend class Client;
  Session(std::shared_ptr<v1::KvCacheService::Stub> stub, std::string id, v1::SessionConfig config,
          std::shared_ptr<const ClientOptions> options, std::shared_ptr<SharedChannel> shared)
      : stub_(std::move(stub)),
        id_(std::move(id)),
        config_(std::move(config)),
        options_(std::move(options)),
        shared_(std::move(shared)) {}

  std::shared_ptr<v1::KvCacheService::Stub> stub_;
  std::string id_;
  v1::SessionConfig config_;
  std::shared_ptr<const ClientOptions> options_;
  std::shared_ptr<SharedChannel> shared_;  // null: tensors in the messages
  int64_t prefix_tokens_ = 0;
  int block_tokens_ = 0;
};


// The gRPC target `target` names: a bare absolute path is the unix socket
// there (unix://PATH; never a host name to look up), anything else itself.
std::string ChannelTarget(const std::string& target);

class Client {
 public:
  // target: unix:///path (or the bare absolute path) or host:port. Does not
  // wait for the daemon.
  static std::unique_ptr<Client> Connect(const std::string& target, const ClientOptions& options = {});

  // Waits until the daemon answers its health check as SERVING; past the
  // timeout, DEADLINE_EXCEEDED with the last reason it could not be reached.
  absl::Status WaitUntilServing(absl::Duration timeout) const;
  // One health check round trip: SERVING, NOT_SERVING, ...
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health() const;

  absl::StatusOr<Session> CreateSession(const SessionOptions& options) const;
  // A handle on an existing session (one GetSession call).
  absl::StatusOr<Session> OpenSession(const std::string& id) const;
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& id) const;
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions() const;
  absl::Status DeleteSession(const std::string& id) const;
  absl::StatusOr<v1::StatsResponse> Stats() const;
  // Writes every session to the daemon's --snapshot-dir now.
  absl::StatusOr<v1::SnapshotResponse> Snapshot() const;
  // Brings sessions demoted to the daemon's --spill-dir back into memory
  // ahead of use: a status per id (OK, NOT_FOUND, RESOURCE_EXHAUSTED, ...).
  absl::StatusOr<std::vector<absl::Status>> Prefetch(const std::vector<std::string>& ids) const;
  // A Decode stream: batched decode steps over many sessions.
  std::unique_ptr<DecodeStream> OpenDecodeStream() const;

  v1::KvCacheService::Stub& stub() const { return *stub_; }

 private:
  Client() = default;

  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::KvCacheService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::shared_ptr<const ClientOptions> options_;
  std::shared_ptr<SharedChannel> shared_;
};

}  // namespace turbokv
