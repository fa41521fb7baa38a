#include "client/cpp/client.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"

namespace turbokv {
namespace {

size_t ValueBytes(v1::DType dtype) { return dtype == v1::DTYPE_F32 ? 4 : 2; }

// The deadline of a unary call (streams: with_deadline false) and the bearer token.
// A batch's per-item statuses.
std::vector<absl::Status> ItemStatuses(const google::protobuf::RepeatedPtrField<v1::ItemStatus>& items) {
  std::vector<absl::Status> status;
  for (const v1::ItemStatus& item : items) status.emplace_back(static_cast<absl::StatusCode>(item.code()), item.message());
  return status;
}

void Prepare(grpc::ClientContext* context, const ClientOptions& options, bool with_deadline = true) {
  if (with_deadline && options.timeout > absl::ZeroDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  }
  if (!options.auth_token.empty()) context->AddMetadata("authorization", "Bearer " + options.auth_token);
}

// One unary call with the deadline and token of `options`, its status converted.
template <typename Request, typename Response>
absl::StatusOr<Response> Call(grpc::Status (v1::KvCacheService::Stub::*method)(grpc::ClientContext*, const Request&,
                                                                                Response*),
                              v1::KvCacheService::Stub& stub, const ClientOptions& options, const Request& request) {
  grpc::ClientContext context;
  Prepare(&context, options);
  Response response;
  absl::Status status = FromGrpcStatus((stub.*method)(&context, request, &response));
  if (!status.ok()) return status;
  return response;
}

// The tensor message for data holding `rows` rows of `row` values: its shape
// is `prefix` followed by [rows][...row shape]. INVALID_ARGUMENT when the
// count is not a whole number of rows.
// Where a call's tensors go in its shared block: each at the next 64-byte
// boundary, then the results (output_to) in the rest.
class Placement {
 public:
  explicit Placement(const SharedBlock* block) : block_(block) {}
  bool active() const { return block_ != nullptr; }
  void Put(const TensorData& data, v1::Tensor* tensor) {
    const size_t bytes = data.count * ValueBytes(data.dtype);
    std::memcpy(block_->data() + used_, data.data, bytes);
    v1::SharedSlice* slice = tensor->mutable_shared();
    slice->set_region(block_->region_id());
    slice->set_offset(block_->offset() + used_);
    slice->set_length(bytes);
    used_ += SharedAligned(bytes);
  }
  void Results(v1::SharedSlice* slice) const {
    slice->set_region(block_->region_id());
    slice->set_offset(block_->offset() + used_);
    slice->set_length(block_->size() - used_);
  }

 private:
  const SharedBlock* block_;
  size_t used_ = 0;
};

// A call's block: room for its tensors and for `results` f32 result values
// in `result_tensors` tensors; null (send bytes) when there is no channel
// or no room.
std::unique_ptr<SharedBlock> BlockFor(SharedChannel* shared, std::initializer_list<const TensorData*> tensors,
                                      size_t result_values, size_t result_tensors) {
  if (shared == nullptr) return nullptr;
  size_t bytes = 0;
  for (const TensorData* t : tensors) bytes += SharedAligned(t->count * ValueBytes(t->dtype));
  bytes += SharedAligned(result_values * 4) + 64 * result_tensors;
  return shared->Allocate(bytes);
}

// The daemon no longer holds the region of a call's block (it restarted):
// register a new one next time, and send this call's tensors as bytes.
bool RegionLost(const absl::Status& status, const SharedBlock* block) {
  return block != nullptr && absl::IsNotFound(status) && absl::StrContains(status.message(), "shared-memory region");
}

absl::Status ToTensor(const TensorData& data, std::vector<int64_t> prefix, std::vector<int64_t> row,
                      absl::string_view what, v1::Tensor* tensor, Placement* placement = nullptr) {
  int64_t row_values = 1;
  for (int64_t d : prefix) row_values *= d;
  for (int64_t d : row) row_values *= d;
  if (data.count == 0 || data.count % static_cast<size_t>(row_values) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", data.count, " values, not a positive multiple of ",
                                                   row_values));
  }
  tensor->set_dtype(data.dtype);
  prefix.push_back(static_cast<int64_t>(data.count / row_values));
  prefix.insert(prefix.end(), row.begin(), row.end());
  tensor->mutable_shape()->Assign(prefix.begin(), prefix.end());
  if (placement != nullptr && placement->active()) {
    placement->Put(data, tensor);
  } else {
    tensor->set_data(static_cast<const char*>(data.data), data.count * ValueBytes(data.dtype));
  }
  return absl::OkStatus();
}

// An f32 result tensor's values, from the message or from the call's block.
absl::StatusOr<std::vector<float>> Floats(const v1::Tensor& tensor, const SharedBlock* block = nullptr) {
  absl::string_view bytes = tensor.data();
  if (tensor.has_shared()) {
    const v1::SharedSlice& slice = tensor.shared();
    if (block == nullptr || slice.region() != block->region_id() || slice.offset() < block->offset() ||
        slice.length() > block->size() || slice.offset() - block->offset() > block->size() - slice.length()) {
      return absl::InternalError("the daemon answered with a result outside the shared memory the call gave it");
    }
    bytes = absl::string_view(reinterpret_cast<const char*>(block->data()) + (slice.offset() - block->offset()),
                              slice.length());
  }
  std::vector<float> values(bytes.size() / 4);
  std::memcpy(values.data(), bytes.data(), values.size() * 4);
  return values;
}

absl::StatusOr<Attention> FromResult(const v1::AttentionResult& result, const SharedBlock* block) {
  Attention attention;
  absl::StatusOr<std::vector<float>> output = Floats(result.output(), block);
  if (!output.ok()) return output.status();
  absl::StatusOr<std::vector<float>> lse = Floats(result.lse(), block);
  if (!lse.ok()) return lse.status();
  attention.output = *std::move(output);
  attention.lse = *std::move(lse);
  attention.top_k_tokens.assign(result.top_k_tokens().begin(), result.top_k_tokens().end());
  attention.top_k_logits.assign(result.top_k_logits().begin(), result.top_k_logits().end());
  return attention;
}

absl::Status FillAppend(const std::string& id, const v1::SessionConfig& config, int layer, int64_t start,
                        const TensorData& keys, const TensorData& values, const TensorData& queries,
                        Placement* placement, v1::AppendRequest* request) {
  request->set_session_id(id);
  request->set_start(start);
  std::vector<int64_t> prefix;
  if (layer < 0) {
    request->set_all_layers(true);
    prefix.push_back(config.shape().layers());
  } else {
    request->set_layer(layer);
  }
  const std::vector<int64_t> row = {config.shape().kv_heads(), config.shape().head_dim()};
  absl::Status status = ToTensor(keys, prefix, row, "keys", request->mutable_keys(), placement);
  if (!status.ok()) return status;
  status = ToTensor(values, prefix, row, "values", request->mutable_values(), placement);
  if (!status.ok() || queries.count == 0) return status;
  return ToTensor(queries, prefix, {config.shape().q_heads(), config.shape().head_dim()}, "queries",
                  request->mutable_queries(), placement);
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC and absl share the canonical code numbers.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

AppendStream::AppendStream(v1::KvCacheService::Stub* stub, std::string session_id, const v1::SessionConfig& config,
                           const ClientOptions& options, std::shared_ptr<SharedChannel> shared)
    : session_id_(std::move(session_id)), config_(config), shared_(std::move(shared)) {
  Prepare(&context_, options, /*with_deadline=*/false);
  stream_ = stub->Append(&context_);
  reader_ = std::thread([this] {
    v1::AppendResponse response;
    while (stream_->Read(&response)) {
      last_ = response;
      acknowledged_.fetch_add(1);
    }
  });
}

AppendStream::~AppendStream() {
  if (!finished_) {
    context_.TryCancel();
    reader_.join();
    stream_->Finish().IgnoreError();
  }
}

absl::Status AppendStream::Write(int layer, int64_t start, const TensorData& keys, const TensorData& values,
                                 const TensorData& queries) {
  if (finished_) return absl::FailedPreconditionError("the append stream is finished");
  // The chunks the daemon has acknowledged are done with their blocks.
  for (const int64_t acknowledged = acknowledged_.load(); blocks_released_ < acknowledged && !blocks_.empty();
       ++blocks_released_) {
    blocks_.pop_front();
  }
  std::unique_ptr<SharedBlock> block = BlockFor(shared_.get(), {&keys, &values, &queries}, 0, 0);
  Placement placement(block.get());
  v1::AppendRequest request;
  absl::Status status = FillAppend(session_id_, config_, layer, start, keys, values, queries, &placement, &request);
  if (!status.ok()) return status;
  if (broken_ || !stream_->Write(request)) {
    broken_ = true;
    return absl::FailedPreconditionError("the append stream has failed: Finish() says why");
  }
  blocks_.push_back(std::move(block));
  return absl::OkStatus();
}

absl::StatusOr<v1::AppendResponse> AppendStream::Finish() {
  if (finished_) return absl::FailedPreconditionError("the append stream is finished");
  finished_ = true;
  stream_->WritesDone();
  reader_.join();
  absl::Status status = FromGrpcStatus(stream_->Finish());
  if (!status.ok()) return status;
  return last_;
}

DecodeStream::DecodeStream(v1::KvCacheService::Stub* stub, const ClientOptions& options,
                           std::shared_ptr<SharedChannel> shared)
    : shared_(std::move(shared)) {
  Prepare(&context_, options, /*with_deadline=*/false);
  stream_ = stub->Decode(&context_);
  reader_ = std::thread([this] {
    v1::DecodeResponse response;
    while (stream_->Read(&response)) {
      std::lock_guard<std::mutex> lock(mutex_);
      responses_.push_back(std::move(response));
      response = v1::DecodeResponse();
      ready_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    reader_done_ = true;
    ready_.notify_all();
  });
}

DecodeStream::~DecodeStream() {
  if (!finished_) {
    context_.TryCancel();
    reader_.join();
    stream_->Finish().IgnoreError();
  }
}

absl::Status DecodeStream::Write(const DecodeBatch& batch) {
  if (finished_) return absl::FailedPreconditionError("the decode stream is finished");
  const int64_t items = static_cast<int64_t>(batch.session_ids.size());
  v1::DecodeRequest request;
  request.set_layer(batch.layer);
  for (const std::string& id : batch.session_ids) request.add_session_ids(id);
  request.mutable_positions()->Assign(batch.positions.begin(), batch.positions.end());
  // Rank 3 ([B][heads][head_dim]) for one query per item, rank 4
  // ([B][k][heads][head_dim]) with k; ToTensor derives the dimension after
  // the prefix from the count, which must then be B (or k).
  const std::vector<int64_t> prefix = batch.k > 1 ? std::vector<int64_t>{items} : std::vector<int64_t>{};
  const int64_t derived = batch.k > 1 ? batch.k : items;
  const size_t rows = static_cast<size_t>(items) * std::max(batch.k, 1) * std::max(batch.q_heads, 0);
  std::unique_ptr<SharedBlock> block = BlockFor(shared_.get(), {&batch.queries, &batch.keys, &batch.values},
                                                rows * std::max(batch.head_dim, 0) + rows, 2);
  Placement placement(block.get());
  auto shaped = [&](const TensorData& data, int heads, absl::string_view what, v1::Tensor* tensor) {
    absl::Status status = ToTensor(data, prefix, {heads, batch.head_dim}, what, tensor, &placement);
    if (status.ok() && tensor->shape(static_cast<int>(prefix.size())) != derived) {
      status = absl::InvalidArgumentError(absl::StrCat(what, " holds ", data.count, " values, expected ",
                                                       items * (batch.k > 1 ? batch.k : 1) * heads * batch.head_dim,
                                                       " for ", items, " items"));
    }
    return status;
  };
  absl::Status status = shaped(batch.queries, batch.q_heads, "queries", request.mutable_queries());
  if (status.ok() && (batch.keys.count > 0 || batch.values.count > 0)) {
    status = shaped(batch.keys, batch.kv_heads, "keys", request.mutable_keys());
    if (status.ok()) status = shaped(batch.values, batch.kv_heads, "values", request.mutable_values());
  }
  if (!status.ok()) return status;
  if (block != nullptr) placement.Results(request.mutable_output_to());
  *request.mutable_options() = batch.options;
  if (broken_ || !stream_->Write(request)) {
    broken_ = true;
    return absl::FailedPreconditionError("the decode stream has failed: Read() or Finish() says why");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  ++pending_;
  blocks_.push_back(std::move(block));
  return absl::OkStatus();
}

absl::StatusOr<DecodeResult> DecodeStream::Read() {
  v1::DecodeResponse response;
  std::unique_ptr<SharedBlock> block;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (pending_ == 0) return absl::FailedPreconditionError("no batch written whose result is not read");
    ready_.wait(lock, [&] { return !responses_.empty() || reader_done_; });
    if (responses_.empty()) {
      lock.unlock();
      absl::Status status = Finish();
      return status.ok() ? absl::InternalError("the decode stream ended without an answer") : status;
    }
    response = std::move(responses_.front());
    responses_.pop_front();
    block = std::move(blocks_.front());
    blocks_.pop_front();
    --pending_;
  }
  DecodeResult result;
  result.batch = response.status_size();
  const int64_t lse_dims = response.lse().shape_size();
  result.k = lse_dims == 3 ? static_cast<int>(response.lse().shape(1)) : 1;
  absl::StatusOr<std::vector<float>> output = Floats(response.output(), block.get());
  if (!output.ok()) return output.status();
  absl::StatusOr<std::vector<float>> lse = Floats(response.lse(), block.get());
  if (!lse.ok()) return lse.status();
  result.output = *std::move(output);
  result.lse = *std::move(lse);
  result.tokens.assign(response.tokens().begin(), response.tokens().end());
  result.status = ItemStatuses(response.status());
  result.top_k_tokens.assign(response.top_k_tokens().begin(), response.top_k_tokens().end());
  result.top_k_logits.assign(response.top_k_logits().begin(), response.top_k_logits().end());
  result.failed = response.failed();
  return result;
}

absl::StatusOr<DecodeResult> DecodeStream::Step(const DecodeBatch& batch) {
  absl::Status status = Write(batch);
  if (status.ok()) return Read();
  if (!broken_) return status;
  // The stream ended: its own status says why.
  const absl::Status ended = Finish();
  return ended.ok() ? absl::UnavailableError("the decode stream ended before this batch was sent") : ended;
}

absl::Status DecodeStream::Finish() {
  if (finished_) return finish_status_;
  finished_ = true;
  stream_->WritesDone();
  reader_.join();
  finish_status_ = FromGrpcStatus(stream_->Finish());
  return finish_status_;
}

std::unique_ptr<DecodeStream> Client::OpenDecodeStream() const {
  return std::unique_ptr<DecodeStream>(new DecodeStream(stub_.get(), *options_, shared_));
}

std::unique_ptr<AppendStream> Session::OpenAppendStream() const {
  return std::unique_ptr<AppendStream>(new AppendStream(stub_.get(), id_, config_, *options_, shared_));
}

absl::StatusOr<int64_t> Session::Append(int layer, int64_t start, const TensorData& keys, const TensorData& values,
                                        const TensorData& queries) const {
  if (layer < 0) return absl::InvalidArgumentError(absl::StrCat("layer = ", layer, " must be >= 0"));
  std::unique_ptr<AppendStream> stream = OpenAppendStream();
  absl::Status status = stream->Write(layer, start, keys, values, queries);
  if (!status.ok() && !absl::IsFailedPrecondition(status)) return status;
  absl::StatusOr<v1::AppendResponse> response = stream->Finish();
  if (!response.ok()) return response.status();
  return response->tokens();
}

absl::StatusOr<int64_t> Session::AppendAllLayers(int64_t start, const TensorData& keys, const TensorData& values,
                                                 const TensorData& queries) const {
  std::unique_ptr<AppendStream> stream = OpenAppendStream();
  absl::Status status = stream->Write(-1, start, keys, values, queries);
  if (!status.ok() && !absl::IsFailedPrecondition(status)) return status;
  absl::StatusOr<v1::AppendResponse> response = stream->Finish();
  if (!response.ok()) return response.status();
  return response->tokens();
}

absl::StatusOr<Attention> Session::Attend(int layer, const TensorData& queries, absl::Span<const int64_t> positions,
                                          const v1::AttentionOptions& options) const {
  const int64_t q = config_.shape().q_heads(), d = config_.shape().head_dim();
  std::unique_ptr<SharedBlock> block = BlockFor(shared_.get(), {&queries}, queries.count + queries.count / d, 2);
  for (;;) {
    v1::AttendRequest request;
    request.set_session_id(id_);
    request.set_layer(layer);
    Placement placement(block.get());
    absl::Status status = ToTensor(queries, {}, {q, d}, "queries", request.mutable_queries(), &placement);
    if (!status.ok()) return status;
    if (block != nullptr) placement.Results(request.mutable_output_to());
    request.mutable_positions()->Assign(positions.begin(), positions.end());
    *request.mutable_options() = options;
    grpc::ClientContext context;
    Prepare(&context, *options_);
    auto stream = stub_->Attend(&context);
    v1::AttendResponse response;
    const bool exchanged = stream->Write(request) && stream->WritesDone() && stream->Read(&response);
    status = FromGrpcStatus(stream->Finish());
    if (RegionLost(status, block.get())) {
      shared_->Forget();
      block.reset();
      continue;
    }
    if (!status.ok()) return status;
    if (!exchanged) return absl::UnavailableError("the Attend stream ended without a response");
    return FromResult(response.result(), block.get());
  }
}

absl::StatusOr<StepResult> Session::Step(int layer, int64_t position, const TensorData& key, const TensorData& value,
                                         const TensorData& query, const v1::AttentionOptions& options) const {
  const int64_t kv = config_.shape().kv_heads(), q = config_.shape().q_heads(), d = config_.shape().head_dim();
  std::unique_ptr<SharedBlock> block = BlockFor(shared_.get(), {&key, &value, &query}, q * d + q, 2);
  for (;;) {
    v1::StepRequest request;
    request.set_session_id(id_);
    request.set_layer(layer);
    request.set_position(position);
    Placement placement(block.get());
    absl::Status status = ToTensor(key, {}, {kv, d}, "key", request.mutable_key(), &placement);
    if (status.ok()) status = ToTensor(value, {}, {kv, d}, "value", request.mutable_value(), &placement);
    if (status.ok()) status = ToTensor(query, {}, {q, d}, "query", request.mutable_query(), &placement);
    if (!status.ok()) return status;
    if (block != nullptr) placement.Results(request.mutable_output_to());
    *request.mutable_options() = options;
    absl::StatusOr<v1::StepResponse> response = Call(&v1::KvCacheService::Stub::Step, *stub_, *options_, request);
    if (RegionLost(response.status(), block.get())) {
      shared_->Forget();
      block.reset();
      continue;
    }
    if (!response.ok()) return response.status();
    absl::StatusOr<Attention> attention = FromResult(response->result(), block.get());
    if (!attention.ok()) return attention.status();
    return StepResult{response->tokens(), *std::move(attention)};
  }
}

absl::StatusOr<KvData> Session::ReadKv(int layer, int64_t start, int64_t end) const {
  v1::ReadKvRequest request;
  request.set_session_id(id_);
  request.add_layers(layer);
  request.set_start(start);
  request.set_end(end);
  request.set_dtype(v1::DTYPE_F32);
  grpc::ClientContext context;
  Prepare(&context, *options_);
  auto reader = stub_->ReadKv(&context, request);
  KvData data;
  v1::ReadKvResponse response;
  while (reader->Read(&response)) {
    absl::StatusOr<std::vector<float>> keys = Floats(response.keys()), values = Floats(response.values());
    if (!keys.ok() || !values.ok()) {
      context.TryCancel();
      reader->Finish().IgnoreError();
      return keys.ok() ? values.status() : keys.status();
    }
    data.keys.insert(data.keys.end(), keys->begin(), keys->end());
    data.values.insert(data.values.end(), values->begin(), values->end());
    data.tokens += response.keys().shape(0);
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  if (!status.ok()) return status;
  return data;
}

absl::StatusOr<Session> Session::Fork(int64_t prefix_tokens) const {
  v1::ForkSessionRequest request;
  request.set_source_session_id(id_);
  request.set_prefix_tokens(prefix_tokens);
  absl::StatusOr<v1::ForkSessionResponse> response =
      Call(&v1::KvCacheService::Stub::ForkSession, *stub_, *options_, request);
  if (!response.ok()) return response.status();
  Session fork(stub_, response->session_id(), response->session().config(), options_, shared_);
  fork.block_tokens_ = response->session().block_tokens();
  return fork;
}

absl::StatusOr<v1::NameBlocksResponse> Session::NameBlocks(int64_t first_block,
                                                           const std::vector<std::string>& hashes) const {
  v1::NameBlocksRequest request;
  request.set_session_id(id_);
  request.set_first_block(first_block);
  for (const std::string& hash : hashes) request.add_block_hashes(hash);
  return Call(&v1::KvCacheService::Stub::NameBlocks, *stub_, *options_, request);
}

std::vector<std::string> BlockHashes(absl::Span<const int32_t> tokens, int block_tokens, absl::string_view salt) {
  std::vector<std::string> hashes;
  if (block_tokens <= 0) return hashes;
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(salt.data()), salt.size(), digest);
  std::string previous(reinterpret_cast<const char*>(digest), sizeof(digest));
  for (size_t start = 0; start + static_cast<size_t>(block_tokens) <= tokens.size(); start += block_tokens) {
    std::string input = previous;
    for (size_t t = start; t < start + static_cast<size_t>(block_tokens); ++t) {
      const uint32_t id = static_cast<uint32_t>(tokens[t]);
      const char bytes[4] = {static_cast<char>(id & 0xff), static_cast<char>((id >> 8) & 0xff),
                             static_cast<char>((id >> 16) & 0xff), static_cast<char>(id >> 24)};
      input.append(bytes, 4);
    }
    SHA256(reinterpret_cast<const unsigned char*>(input.data()), input.size(), digest);
    previous.assign(reinterpret_cast<const char*>(digest), sizeof(digest));
    hashes.push_back(previous);
  }
  return hashes;
}

absl::StatusOr<v1::SessionInfo> Session::Truncate(int64_t tokens) const {
  v1::TruncateSessionRequest request;
  request.set_session_id(id_);
  request.set_tokens(tokens);
  return Call(&v1::KvCacheService::Stub::TruncateSession, *stub_, *options_, request);
}

absl::StatusOr<v1::SessionInfo> Session::Info() const {
  v1::GetSessionRequest request;
  request.set_session_id(id_);
  return Call(&v1::KvCacheService::Stub::GetSession, *stub_, *options_, request);
}

absl::Status Session::Delete() const {
  v1::DeleteSessionRequest request;
  request.set_session_id(id_);
  return Call(&v1::KvCacheService::Stub::DeleteSession, *stub_, *options_, request).status();
}

std::string ChannelTarget(const std::string& target) {
  return !target.empty() && target[0] == '/' ? "unix://" + target : target;
}

std::unique_ptr<Client> Client::Connect(const std::string& given, const ClientOptions& options) {
  const std::string target = ChannelTarget(given);
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options.max_message_bytes);
  arguments.SetMaxSendMessageSize(options.max_message_bytes);
  // A sidecar's socket appears a moment after its worker starts: retry
  // connecting soon rather than after gRPC's default one second.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::unique_ptr<Client> client(new Client());
  client->options_ = std::make_shared<const ClientOptions>(options);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_root_certs.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_client_cert;
    ssl.pem_private_key = options.tls_client_key;
    credentials = grpc::SslCredentials(ssl);
  }
  client->channel_ = grpc::CreateCustomChannel(target, credentials, arguments);
  client->stub_ = v1::KvCacheService::NewStub(client->channel_);
  client->health_ = grpc::health::v1::Health::NewStub(client->channel_);
  client->shared_ = SharedChannel::For(target, options.shared_memory_bytes, options.auth_token);
  return client;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health() const {
  grpc::ClientContext context;
  Prepare(&context, *options_);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  absl::Status status = FromGrpcStatus(health_->Check(&context, request, &response));
  if (!status.ok()) return status;
  return response.status();
}

absl::Status Client::WaitUntilServing(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  // Each check fails fast while the channel cannot connect, with why (no
  // such socket, refused, a TLS mismatch, ...); that reason is what a caller
  // needs when the deadline passes, not the bare "Deadline Exceeded" of a
  // check still waiting then.
  absl::Status reason = absl::DeadlineExceededError("no answer");
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    const absl::Status status = FromGrpcStatus(health_->Check(&context, request, &response));
    if (status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) return absl::OkStatus();
    if (status.ok()) {
      reason = absl::UnavailableError("the daemon is not serving");
      absl::SleepFor(absl::Milliseconds(20));
      continue;
    }
    if (status.code() != absl::StatusCode::kDeadlineExceeded) reason = status;
    // Sleep until the channel's next connection attempt has an outcome (its
    // reconnect backoff is at most a second), polling at least every 250 ms.
    const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
    if (state != GRPC_CHANNEL_READY) {
      channel_->WaitForStateChange(state, absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Milliseconds(250))));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("turbokvd did not become ready within ",
                                                  absl::FormatDuration(timeout), ": ", reason.message()));
}

absl::StatusOr<Session> Client::CreateSession(const SessionOptions& options) const {
  v1::CreateSessionRequest request;
  v1::SessionConfig* config = request.mutable_config();
  config->mutable_shape()->set_layers(options.layers);
  config->mutable_shape()->set_kv_heads(options.kv_heads);
  config->mutable_shape()->set_q_heads(options.q_heads);
  config->mutable_shape()->set_head_dim(options.head_dim);
  config->set_key_codec(options.key_codec);
  config->set_value_codec(options.value_codec);
  config->set_preset(options.preset);
  for (const v1::LayerCodecs& range : options.layer_codecs) *config->add_layer_codecs() = range;
  if (options.rotation_seed.has_value()) config->set_rotation_seed(*options.rotation_seed);
  config->set_max_tokens(options.max_tokens);
  *config->mutable_idle_ttl() =
      google::protobuf::util::TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(options.idle_ttl));
  config->set_pinned(options.pinned);
  config->set_key_transform(options.key_transform);
  config->set_center_values(options.center_values);
  if (options.sink_tokens.has_value()) config->set_sink_tokens(*options.sink_tokens);
  config->set_sink_codec(options.sink_codec);
  for (const std::string& hash : options.prefix_blocks) request.add_prefix_blocks(hash);
  absl::StatusOr<v1::CreateSessionResponse> response =
      Call(&v1::KvCacheService::Stub::CreateSession, *stub_, *options_, request);
  if (!response.ok()) return response.status();
  Session session(stub_, response->session_id(), response->config(), options_, shared_);
  session.prefix_tokens_ = response->prefix_tokens();
  session.block_tokens_ = response->block_tokens();
  return session;
}

absl::StatusOr<Session> Client::OpenSession(const std::string& id) const {
  absl::StatusOr<v1::SessionInfo> info = GetSession(id);
  if (!info.ok()) return info.status();
  Session session(stub_, id, info->config(), options_, shared_);
  session.block_tokens_ = info->block_tokens();
  return session;
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const std::string& id) const {
  v1::GetSessionRequest request;
  request.set_session_id(id);
  return Call(&v1::KvCacheService::Stub::GetSession, *stub_, *options_, request);
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListSessions() const {
  absl::StatusOr<v1::ListSessionsResponse> response =
      Call(&v1::KvCacheService::Stub::ListSessions, *stub_, *options_, v1::ListSessionsRequest());
  if (!response.ok()) return response.status();
  return std::vector<v1::SessionInfo>(response->sessions().begin(), response->sessions().end());
}

absl::Status Client::DeleteSession(const std::string& id) const {
  v1::DeleteSessionRequest request;
  request.set_session_id(id);
  return Call(&v1::KvCacheService::Stub::DeleteSession, *stub_, *options_, request).status();
}

absl::StatusOr<v1::StatsResponse> Client::Stats() const {
  return Call(&v1::KvCacheService::Stub::Stats, *stub_, *options_, v1::StatsRequest());
}

absl::StatusOr<v1::SnapshotResponse> Client::Snapshot() const {
  return Call(&v1::KvCacheService::Stub::Snapshot, *stub_, *options_, v1::SnapshotRequest());
}

absl::StatusOr<std::vector<absl::Status>> Client::Prefetch(const std::vector<std::string>& ids) const {
  v1::PrefetchRequest request;
  for (const std::string& id : ids) request.add_session_ids(id);
  absl::StatusOr<v1::PrefetchResponse> response = Call(&v1::KvCacheService::Stub::Prefetch, *stub_, *options_, request);
  if (!response.ok()) return response.status();
  return ItemStatuses(response->status());
}

}  // namespace turbokv
