#include "service/rpc/kv_cache_service.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.h"
#include "service/error_side.h"

namespace turbokv {
namespace {

const grpc::Status kDraining(grpc::StatusCode::UNAVAILABLE, "turbokvd is shutting down");

absl::Status Draining() { return absl::UnavailableError(kDraining.error_message()); }

absl::Status CancelledBeforeRun() {
  return absl::CancelledError("the client cancelled the call (or went away) before it ran; nothing was applied");
}

// The call's deadline as the handler's waits take it (CallDeadline).
absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  return deadline == std::chrono::system_clock::time_point::max() ? absl::InfiniteFuture() : absl::FromChrono(deadline);
}

void Observe(Metrics* metrics, const char* method, const absl::Status& status, absl::Time start) {
  if (metrics != nullptr) metrics->ObserveRpc(method, status, absl::ToDoubleSeconds(absl::Now() - start));
}

// Parses (and empties) `buffer`; false when it is not a valid message.
template <typename Message>
bool Parse(grpc::ByteBuffer* buffer, Message* message) {
  return grpc::SerializationTraits<Message>::Deserialize(buffer, message).ok();
}

template <typename Message>
absl::Status Serialize(const Message& message, grpc::ByteBuffer* out) {
  bool own = false;
  const grpc::Status status = grpc::SerializationTraits<Message>::Serialize(message, out, &own);
  if (!status.ok()) return absl::InternalError(absl::StrCat("cannot serialize the reply: ", status.error_message()));
  return absl::OkStatus();
}

absl::Status Malformed(const std::string& type, int64_t message) {
  if (message == 0) return absl::InvalidArgumentError(absl::StrCat("the request is not a valid ", type, " (it does not parse)"));
  return absl::InvalidArgumentError(absl::StrCat("message ", message, " of this stream is not a valid ", type,
                                                 " (it does not parse); the stream ends here, the messages before "
                                                 "it were answered"));
}

// The sessions a request touches: work on them runs one at a time.
template <typename Request>
std::vector<std::string> Keys(const Request& request) {
  return {request.session_id()};
}
template <>
std::vector<std::string> Keys(const v1::CreateSessionRequest&) {
  return {};
}
template <>
std::vector<std::string> Keys(const v1::ListSessionsRequest&) {
  return {};
}
template <>
std::vector<std::string> Keys(const v1::StatsRequest&) {
  return {};
}
template <>
std::vector<std::string> Keys(const v1::SnapshotRequest&) {
  return {};
}
template <>
std::vector<std::string> Keys(const v1::ForkSessionRequest& request) {
  return {request.source_session_id()};
}
template <>
std::vector<std::string> Keys(const v1::DecodeRequest& request) {
  return {request.session_ids().begin(), request.session_ids().end()};
}
template <>
std::vector<std::string> Keys(const v1::PrefetchRequest& request) {
  return {request.session_ids().begin(), request.session_ids().end()};
}

// Calls, and bytes of requests and of replies not yet taken by their
// client, in flight per tenant.
class InFlight {
 public:
  explicit InFlight(const ServiceLimits& limits) : limits_(limits) {}

  // Counts a call of `bytes`, or RESOURCE_EXHAUSTED naming the limit it
  // would pass. One call is always let in, however large (the message size
  // limit bounds it).
  absl::Status Admit(const std::string& tenant, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    Use& use = use_[tenant];
    const std::string who = tenant.empty() ? std::string("the daemon's callers already have")
                                           : absl::StrCat("tenant '", tenant, "' already has");
    if (use.calls + 1 > limits_.tenant_calls) {
      return CallerLimit(absl::ResourceExhaustedError(absl::StrCat(
          who, " ", use.calls, " calls in flight, the most allowed (--tenant-max-calls); "
          "retry when some have finished")));
    }
    if (use.calls > 0 && use.bytes + bytes > limits_.tenant_bytes) {
      return CallerLimit(absl::ResourceExhaustedError(absl::StrCat(
          who, " ", use.bytes, " bytes of requests and replies in ", use.calls, " calls in flight; ", bytes,
          " more would pass ", limits_.tenant_bytes, " (--tenant-max-inflight-bytes)")));
    }
    ++use.calls;
    use.bytes += bytes;
    return absl::OkStatus();
  }

  // Counts the reply a call admitted will make, before it is made, or
  // RESOURCE_EXHAUSTED when it would pass the bound (unless the call is the
  // tenant's only one).
  absl::Status Reserve(const std::string& tenant, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    Use& use = use_[tenant];
    if (use.calls > 1 && use.bytes + bytes > limits_.tenant_bytes) {
      const std::string who = tenant.empty() ? std::string("the daemon's callers have")
                                             : absl::StrCat("tenant '", tenant, "' has");
      return CallerLimit(absl::ResourceExhaustedError(absl::StrCat(
          who, " ", use.bytes, " bytes of requests and replies in ", use.calls, " calls in flight; this call's reply"
          " of ", bytes, " bytes would pass ", limits_.tenant_bytes, " (--tenant-max-inflight-bytes)")));
    }
    use.bytes += bytes;
    return absl::OkStatus();
  }

  // Counts `bytes` more (or fewer) for a call already admitted: its reply
  // as made, against what was reserved.
  void Hold(const std::string& tenant, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    use_[tenant].bytes += bytes;
  }

  // Request and reply bytes in flight, over tenants.
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t total = 0;
    for (const auto& [tenant, use] : use_) total += use.bytes;
    return total;
  }

  void Release(const std::string& tenant, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    Use& use = use_[tenant];
    --use.calls;
    use.bytes -= bytes;
  }

 private:
  struct Use {
    int64_t calls = 0;
    int64_t bytes = 0;
  };
  const ServiceLimits limits_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Use> use_;
};

// A stream that a drain can end: the open streams are kept in Parts so that
// StartDraining reaches those waiting for their client's next message. Each
// is reference counted (gRPC's hold until OnDone, and a drain's while it
// calls Drain) and deletes itself when the last goes.
class DrainableStream {
 public:
  virtual ~DrainableStream() = default;
  // Ends the stream with UNAVAILABLE once the message in flight, if any, is
  // answered; messages not yet read are never applied.
  virtual void Drain() = 0;
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  std::atomic<int> refs_{1};
};

}  // namespace

struct KvCacheService::Parts {
  Parts(Handler* handler, Executor* executor, Metrics* metrics, const ServiceLimits& limits)
      : handler(handler), executor(executor), metrics(metrics), in_flight(limits) {}

  // A call of `method` began (counted before the draining check inside
  // Tenant(), so that a drain that sees no call in flight also sees every
  // later call refused), or ended.
  void Began(const char* method) {
    active.fetch_add(1);
    if (metrics != nullptr) metrics->CallStarted(method);
  }
  void Ended(const char* method) {
    if (metrics != nullptr) metrics->CallEnded(method);
    active.fetch_sub(1);
  }

  Handler* const handler;
  Executor* const executor;
  Metrics* const metrics;
  std::atomic<int> active{0};
  InFlight in_flight;
  std::mutex open_mutex;
  std::set<DrainableStream*> open;  // the streams a drain ends (Decode)
};

namespace {

using Parts = KvCacheService::Parts;

// One unary call: admitted, parsed on the executor, then run as work keyed
// by its sessions. Deletes itself when finished.
template <typename Request, typename Response>
class UnaryCall {
 public:
  using Method = absl::StatusOr<Response> (Handler::*)(const Request&, const std::string&);

  // The caller has counted the call (Parts::Began); Done uncounts it.
  UnaryCall(Parts* parts, grpc::CallbackServerContext* context, const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
            Method method, const char* name)
      : parts_(parts),
        context_(context),
        reactor_(context->DefaultReactor()),
        in_(*in),
        out_(out),
        method_(method),
        name_(name),
        start_(absl::Now()) {}

  grpc::ServerUnaryReactor* Start(absl::StatusOr<std::string> tenant) {
    grpc::ServerUnaryReactor* reactor = reactor_;
    if (!tenant.ok()) {
      Done(tenant.status());
      return reactor;
    }
    tenant_ = *std::move(tenant);
    const int64_t bytes = static_cast<int64_t>(in_.Length());
    if (absl::Status admitted = parts_->in_flight.Admit(tenant_, bytes); !admitted.ok()) {
      Done(admitted);
      return reactor;
    }
    admitted_bytes_ = bytes;
    if (!parts_->executor->Submit({tenant_, {}, [this] { ParseAndQueue(); }})) Done(Draining());
    return reactor;
  }

 private:
  void ParseAndQueue() {
    if (context_->IsCancelled()) return Done(CancelledBeforeRun());
    if (!Parse(&in_, &request_)) return Done(Malformed(Request::descriptor()->full_name(), 0));
    if (!parts_->executor->Submit({tenant_, Keys(request_), [this] { Run(); }})) Done(Draining());
  }

  void Run() {
    if (context_->IsCancelled()) return Done(CancelledBeforeRun());
    const CallDeadline deadline(DeadlineOf(*context_));
    absl::StatusOr<Response> result = (parts_->handler->*method_)(request_, tenant_);
    if (!result.ok()) return Done(result.status());
    Done(Serialize(*result, out_));
  }

  void Done(const absl::Status& status) {
    Observe(parts_->metrics, name_, status, start_);
    if (admitted_bytes_ >= 0) parts_->in_flight.Release(tenant_, admitted_bytes_);
    Parts* parts = parts_;
    grpc::ServerUnaryReactor* reactor = reactor_;
    const char* name = name_;
    delete this;
    reactor->Finish(ToGrpcStatus(status));
    parts->Ended(name);
  }

  Parts* const parts_;
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer* const out_;
  const Method method_;
  const char* const name_;
  const absl::Time start_;
  std::string tenant_;
  int64_t admitted_bytes_ = -1;  // -1: not admitted
  Request request_;
};

// One message in, one message out, until the client closes its side: each
// message is admitted, parsed and run on the executor as a unary call is,
// its response written, then the next read starts. The first error ends
// the stream with its status. A drainable stream (Decode: held open for a
// worker's whole life) is ended by a drain with UNAVAILABLE once the message
// in flight is answered; the others (Append, Attend) go on within the
// shutdown deadline.
template <typename Request, typename Response>
class StreamCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>, public DrainableStream {
 public:
  using Method = absl::StatusOr<Response> (Handler::*)(const Request&, const std::string&);

  // tenant: the caller's, or why the call is refused (draining,
  // unauthenticated): then it ends at once with that status. The caller has
  // counted the call (Parts::Began); OnDone uncounts it.
  StreamCall(Parts* parts, grpc::CallbackServerContext* context, Method method, absl::StatusOr<std::string> tenant,
             bool drainable, const char* name)
      : parts_(parts), context_(context), method_(method), drainable_(drainable), name_(name) {
    if (drainable_) {
      std::lock_guard<std::mutex> lock(parts_->open_mutex);
      parts_->open.insert(this);
    }
    if (!tenant.ok()) {
      Observe(parts_->metrics, name_, tenant.status(), absl::Now());
      FinishOnce(ToGrpcStatus(tenant.status()));
    } else {
      tenant_ = *std::move(tenant);
      StartNextRead();
    }
  }

  void OnReadDone(bool ok) override {
    bool draining;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reading_ = false;
      if (finished_) return;  // drained while waiting: the message, if any, is not applied
      draining = draining_;
    }
    if (!ok) {  // the client finished writing (or went away)
      FinishOnce(grpc::Status::OK);
      return;
    }
    if (draining) {
      FinishOnce(kDraining);
      return;
    }
    ++messages_;
    start_ = absl::Now();
    const int64_t bytes = static_cast<int64_t>(in_.Length());
    if (absl::Status admitted = parts_->in_flight.Admit(tenant_, bytes); !admitted.ok()) {
      Fail(admitted);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_bytes_ = bytes;
    }
    if (!parts_->executor->Submit({tenant_, {}, [this] { ParseAndQueue(); }})) Fail(Draining());
  }

  void OnWriteDone(bool ok) override {
    out_.Clear();
    ReleaseHeld();
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    bool draining;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      draining = draining_;
    }
    if (draining) {
      FinishOnce(kDraining);
    } else {
      StartNextRead();
    }
  }

  void Drain() override {
    bool idle;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      draining_ = true;
      idle = reading_;
    }
    if (idle) FinishOnce(kDraining);
  }

  void OnDone() override {
    if (drainable_) {
      std::lock_guard<std::mutex> lock(parts_->open_mutex);
      parts_->open.erase(this);
    }
    ReleaseHeld();
    parts_->Ended(name_);
    Unref();
  }

 private:
  void ParseAndQueue() {
    if (context_->IsCancelled()) return Fail(CancelledBeforeRun());
    if (!Parse(&in_, &request_)) return Fail(Malformed(Request::descriptor()->full_name(), messages_));
    const int64_t reply = Handler::ReplyBytes(request_);
    absl::Status reserved;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_bytes_ < 0) return;  // the stream finished meanwhile
      reserved = parts_->in_flight.Reserve(tenant_, reply);
      if (reserved.ok()) {
        held_bytes_ += reply;
        reserved_bytes_ = reply;
      }
    }
    if (!reserved.ok()) return Fail(reserved);
    if (!parts_->executor->Submit({tenant_, Keys(request_), [this] { Run(); }})) Fail(Draining());
  }

  void Run() {
    if (context_->IsCancelled()) return Fail(CancelledBeforeRun());
    const CallDeadline deadline(DeadlineOf(*context_));
    absl::StatusOr<Response> response = (parts_->handler->*method_)(request_, tenant_);
    Request().Swap(&request_);  // its memory goes now, not at the next message
    absl::Status status = response.status();
    if (status.ok()) status = Serialize(*response, &out_);
    Observe(parts_->metrics, name_, status, start_);
    if (!status.ok()) {
      FinishOnce(ToGrpcStatus(status));
      return;
    }
    // The reply counts against its tenant until the client has taken it:
    // as made, in place of what was reserved.
    const int64_t reply = static_cast<int64_t>(out_.Length());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_bytes_ >= 0) {
        parts_->in_flight.Hold(tenant_, reply - reserved_bytes_);
        held_bytes_ += reply - reserved_bytes_;
      }
    }
    StartWrite(&out_);
  }

  // Ends the stream because of the message in flight.
  void Fail(const absl::Status& status) {
    Observe(parts_->metrics, name_, status, start_);
    FinishOnce(ToGrpcStatus(status));
  }

  void StartNextRead() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      reading_ = true;
    }
    StartRead(&in_);
  }

  // The message in flight stops counting against its tenant.
  void ReleaseHeld() {
    int64_t bytes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bytes = held_bytes_;
      held_bytes_ = -1;
    }
    if (bytes >= 0) parts_->in_flight.Release(tenant_, bytes);
  }

  // Finish at most once, whoever gets there first (the stream's own flow or
  // a drain).
  void FinishOnce(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      finished_ = true;
    }
    ReleaseHeld();
    Finish(status);
  }

  Parts* const parts_;
  grpc::CallbackServerContext* const context_;
  const Method method_;
  const bool drainable_;
  const char* const name_;
  std::string tenant_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  Request request_;
  int64_t messages_ = 0;  // read so far
  absl::Time start_;      // of the message in flight
  std::mutex mutex_;
  int64_t held_bytes_ = -1;  // of the admitted message in flight; -1: none
  int64_t reserved_bytes_ = 0;  // of those, for its reply before it was made
  bool reading_ = false;     // a read is outstanding and no message is in flight
  bool draining_ = false;
  bool finished_ = false;
};

// ReadKv: messages produced one at a time on the executor (as work keyed by
// the session), each written before the next is made.
class ReadKvCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // tenant: the caller's, or why the call is refused. The caller has
  // counted this call (Parts::Began); OnDone uncounts it.
  ReadKvCall(Parts* parts, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
             absl::StatusOr<std::string> tenant)
      : parts_(parts), context_(context), in_(*request), start_(absl::Now()) {
    if (!tenant.ok()) {
      Done(tenant.status());
      return;
    }
    tenant_ = *std::move(tenant);
    const int64_t bytes = static_cast<int64_t>(in_.Length());
    if (absl::Status admitted = parts_->in_flight.Admit(tenant_, bytes); !admitted.ok()) {
      Done(admitted);
      return;
    }
    admitted_bytes_ = bytes;
    if (!parts_->executor->Submit({tenant_, {}, [this] { ParseAndStart(); }})) Done(Draining());
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away"));
      return;
    }
    if (!parts_->executor->Submit({tenant_, {request_.session_id()}, [this] { Next(); }, /*continuation=*/true})) {
      Done(Draining());
    }
  }

  void OnDone() override {
    if (admitted_bytes_ >= 0) parts_->in_flight.Release(tenant_, admitted_bytes_);
    parts_->Ended("ReadKv");
    delete this;
  }

 private:
  void ParseAndStart() {
    if (context_->IsCancelled()) return Done(CancelledBeforeRun());
    if (!Parse(&in_, &request_)) return Done(Malformed(v1::ReadKvRequest::descriptor()->full_name(), 0));
    if (!parts_->executor->Submit({tenant_, {request_.session_id()}, [this] { StartCursor(); }})) Done(Draining());
  }

  void StartCursor() {
    if (context_->IsCancelled()) return Done(CancelledBeforeRun());
    const CallDeadline deadline(DeadlineOf(*context_));
    absl::StatusOr<ReadKvCursor> cursor = parts_->handler->StartReadKv(request_, tenant_);
    if (!cursor.ok()) return Done(cursor.status());
    cursor_ = *std::move(cursor);
    Next();
  }

  // On the executor.
  void Next() {
    if (context_->IsCancelled()) return Done(absl::CancelledError("the client went away"));
    response_.Clear();
    out_.Clear();
    const CallDeadline deadline(DeadlineOf(*context_));
    absl::StatusOr<bool> more = parts_->handler->NextReadKv(cursor_, &response_);
    if (!more.ok()) return Done(more.status());
    if (!*more) return Done(absl::OkStatus());
    if (absl::Status status = Serialize(response_, &out_); !status.ok()) return Done(status);
    StartWrite(&out_);
  }

  void Done(const absl::Status& status) {
    Observe(parts_->metrics, "ReadKv", status, start_);
    Finish(ToGrpcStatus(status));
  }

  Parts* const parts_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer in_;
  const absl::Time start_;
  std::string tenant_;
  int64_t admitted_bytes_ = -1;
  v1::ReadKvRequest request_;
  ReadKvCursor cursor_;
  v1::ReadKvResponse response_;
  grpc::ByteBuffer out_;
};

}  // namespace

KvCacheService::KvCacheService(Handler* handler, Executor* executor, Metrics* metrics,
                               const Authenticator* authenticator, const ServiceLimits& limits)
    : authenticator_(authenticator), parts_(std::make_unique<Parts>(handler, executor, metrics, limits)) {}

KvCacheService::~KvCacheService() = default;

int KvCacheService::active_calls() const { return parts_->active.load(); }

int64_t KvCacheService::in_flight_bytes() const { return parts_->in_flight.bytes(); }

template <typename Request, typename Response>
grpc::ServerUnaryReactor* KvCacheService::Unary(const char* name,
                                                absl::StatusOr<Response> (Handler::*method)(const Request&,
                                                                                            const std::string&),
                                                grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) {
  parts_->Began(name);
  auto* call = new UnaryCall<Request, Response>(parts_.get(), context, request, response, method, name);
  return call->Start(Tenant(context));
}

template <typename Request, typename Response>
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Stream(
    const char* name, absl::StatusOr<Response> (Handler::*method)(const Request&, const std::string&), bool drainable,
    grpc::CallbackServerContext* context) {
  parts_->Began(name);
  return new StreamCall<Request, Response>(parts_.get(), context, method, Tenant(context), drainable, name);
}

grpc::ServerUnaryReactor* KvCacheService::CreateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return Unary("CreateSession", &Handler::CreateSession, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::GetSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return Unary("GetSession", &Handler::GetSession, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::ListSessions(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Unary("ListSessions", &Handler::ListSessions, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::DeleteSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return Unary("DeleteSession", &Handler::DeleteSession, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::TruncateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return Unary("TruncateSession", &Handler::TruncateSession, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::ForkSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return Unary("ForkSession", &Handler::ForkSession, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::NameBlocks(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return Unary("NameBlocks", &Handler::NameBlocks, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::Step(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  return Unary("Step", &Handler::Step, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::Stats(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) {
  return Unary("Stats", &Handler::Stats, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::Snapshot(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return Unary("Snapshot", &Handler::Snapshot, context, request, response);
}

grpc::ServerUnaryReactor* KvCacheService::Prefetch(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return Unary("Prefetch", &Handler::Prefetch, context, request, response);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Append(grpc::CallbackServerContext* context) {
  return Stream("Append", &Handler::Append, /*drainable=*/false, context);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Attend(grpc::CallbackServerContext* context) {
  return Stream("Attend", &Handler::Attend, /*drainable=*/false, context);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Decode(grpc::CallbackServerContext* context) {
  return Stream("Decode", &Handler::Decode, /*drainable=*/true, context);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::ReadKv(grpc::CallbackServerContext* context,
                                                                   const grpc::ByteBuffer* request) {
  parts_->Began("ReadKv");
  return new ReadKvCall(parts_.get(), context, request, Tenant(context));
}

void KvCacheService::StartDraining() {
  draining_.store(true);
  std::vector<DrainableStream*> streams;
  {
    std::lock_guard<std::mutex> lock(parts_->open_mutex);
    for (DrainableStream* stream : parts_->open) {
      stream->Ref();
      streams.push_back(stream);
    }
  }
  for (DrainableStream* stream : streams) {
    stream->Drain();
    stream->Unref();
  }
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::StatusOr<std::string> KvCacheService::Tenant(grpc::CallbackServerContext* context) const {
  if (draining_.load()) return Draining();
  if (authenticator_ == nullptr) return std::string();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return authenticator_->Authenticate(nullptr);
  const absl::string_view value(it->second.data(), it->second.size());
  return authenticator_->Authenticate(&value);
}

}  // namespace turbokv
