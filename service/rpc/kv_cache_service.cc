#include "service/rpc/kv_cache_service.h"

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/time/clock.h"

namespace turbokv {
namespace {

const grpc::Status kDraining(grpc::StatusCode::UNAVAILABLE, "turbokvd is shutting down");

// Seconds since `start`, for the RPC duration metrics.
double Since(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

void Observe(Metrics* metrics, const char* method, const absl::Status& status, absl::Time start) {
  if (metrics != nullptr) metrics->ObserveRpc(method, status.code(), Since(start));
}

}  // namespace

// A stream that a drain can end: the open streams are kept here so that
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

struct KvCacheService::OpenStreams {
  std::mutex mutex;
  std::set<DrainableStream*> streams;
};

namespace {

// One message in, one message out, until the client closes its side: each
// request goes to the executor, its response is written, then the next read
// starts. The first error ends the stream with its status. A stream
// registered in `open` (Decode: held open for a worker's whole life) is ended
// by a drain with UNAVAILABLE once the message in flight is answered; the
// others (Append, Attend: open nullptr) go on within the shutdown deadline.
template <typename Request, typename Response>
class StreamReactor final : public grpc::ServerBidiReactor<Request, Response>, public DrainableStream {
 public:
  using Method = absl::StatusOr<Response> (Handler::*)(const Request&, const std::string&);

  // tenant: the caller's, or why the call is refused (draining,
  // unauthenticated): then it ends at once with that status. active counts
  // the calls in flight; the caller has counted this one, OnDone uncounts it.
  StreamReactor(Handler* handler, Executor* executor, Method method, absl::StatusOr<std::string> tenant,
                std::atomic<int>* active, KvCacheService::OpenStreams* open, Metrics* metrics, const char* name)
      : handler_(handler),
        executor_(executor),
        method_(method),
        active_(active),
        open_(open),
        metrics_(metrics),
        name_(name) {
    if (open_ != nullptr) {
      std::lock_guard<std::mutex> lock(open_->mutex);
      open_->streams.insert(this);
    }
    if (!tenant.ok()) {
      Observe(metrics_, name_, tenant.status(), absl::Now());
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
    const absl::Time start = absl::Now();
    const bool queued = executor_->Submit([this, start] {
      absl::StatusOr<Response> response = (handler_->*method_)(request_, tenant_);
      Observe(metrics_, name_, response.status(), start);
      if (!response.ok()) {
        FinishOnce(ToGrpcStatus(response.status()));
        return;
      }
      response_ = *std::move(response);
      this->StartWrite(&response_);
    });
    if (!queued) FinishOnce(kDraining);
  }

  void OnWriteDone(bool ok) override {
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
    if (open_ != nullptr) {
      std::lock_guard<std::mutex> lock(open_->mutex);
      open_->streams.erase(this);
    }
    active_->fetch_sub(1);
    Unref();
  }

 private:
  void StartNextRead() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      reading_ = true;
    }
    this->StartRead(&request_);
  }

  // Finish at most once, whoever gets there first (the stream's own flow or
  // a drain).
  void FinishOnce(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      finished_ = true;
    }
    this->Finish(status);
  }

  Handler* handler_;
  Executor* executor_;
  Method method_;
  std::atomic<int>* active_;
  KvCacheService::OpenStreams* open_;  // where it is registered; nullptr: not ended by a drain
  Metrics* metrics_;
  const char* name_;
  std::string tenant_;
  Request request_;
  Response response_;
  std::mutex mutex_;
  bool reading_ = false;   // a read is outstanding and no message is in flight
  bool draining_ = false;
  bool finished_ = false;
};

// ReadKv: messages produced one at a time on the executor, each written
// before the next is made.
class ReadKvReactor final : public grpc::ServerWriteReactor<v1::ReadKvResponse> {
 public:
  // tenant: the caller's, or why the call is refused. The caller has
  // counted this call in `active`; OnDone uncounts it.
  ReadKvReactor(Handler* handler, Executor* executor, const v1::ReadKvRequest* request,
                absl::StatusOr<std::string> tenant, std::atomic<int>* active, Metrics* metrics)
      : handler_(handler), executor_(executor), active_(active), metrics_(metrics), start_(absl::Now()) {
    if (!tenant.ok()) {
      Done(tenant.status());
      return;
    }
    if (!executor_->Submit([this, request, tenant = *std::move(tenant)] {
          absl::StatusOr<ReadKvCursor> cursor = handler_->StartReadKv(*request, tenant);
          if (!cursor.ok()) {
            Done(cursor.status());
            return;
          }
          cursor_ = *std::move(cursor);
          Next();
        })) {
      Finish(kDraining);
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away"));
      return;
    }
    if (!executor_->Submit([this] { Next(); })) Finish(kDraining);
  }

  void OnDone() override {
    active_->fetch_sub(1);
    delete this;
  }

 private:
  // On the executor.
  void Next() {
    response_.Clear();
    absl::StatusOr<bool> more = handler_->NextReadKv(cursor_, &response_);
    if (!more.ok()) {
      Done(more.status());
    } else if (!*more) {
      Done(absl::OkStatus());
    } else {
      StartWrite(&response_);
    }
  }

  void Done(const absl::Status& status) {
    Observe(metrics_, "ReadKv", status, start_);
    Finish(ToGrpcStatus(status));
  }

  Handler* handler_;
  Executor* executor_;
  std::atomic<int>* active_;
  Metrics* metrics_;
  const absl::Time start_;
  ReadKvCursor cursor_;
  v1::ReadKvResponse response_;
};

}  // namespace

KvCacheService::KvCacheService(Handler* handler, Executor* executor, Metrics* metrics,
                               const Authenticator* authenticator)
    : handler_(handler),
      executor_(executor),
      metrics_(metrics),
      authenticator_(authenticator),
      open_(std::make_unique<OpenStreams>()) {}

KvCacheService::~KvCacheService() = default;

void KvCacheService::StartDraining() {
  draining_.store(true);
  std::vector<DrainableStream*> streams;
  {
    std::lock_guard<std::mutex> lock(open_->mutex);
    for (DrainableStream* stream : open_->streams) {
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

template <typename Request, typename Response, typename Method>
grpc::ServerUnaryReactor* KvCacheService::Unary(grpc::CallbackServerContext* context,
                                                const Request* request, Response* response,
                                                Method method, const char* name) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time start = absl::Now();
  // Counted before the draining check inside Tenant(), so that a drain that
  // sees no call in flight also sees every later call refused.
  active_.fetch_add(1);
  absl::StatusOr<std::string> tenant = Tenant(context);
  if (!tenant.ok()) {
    Observe(metrics_, name, tenant.status(), start);
    reactor->Finish(ToGrpcStatus(tenant.status()));
    active_.fetch_sub(1);
    return reactor;
  }
  const bool queued = executor_->Submit([this, reactor, request, response, method, name, start,
                                         tenant = *std::move(tenant)] {
    absl::StatusOr<Response> result = (handler_->*method)(*request, tenant);
    Observe(metrics_, name, result.status(), start);
    if (result.ok()) *response = *std::move(result);
    reactor->Finish(ToGrpcStatus(result.status()));
    active_.fetch_sub(1);
  });
  if (!queued) {
    reactor->Finish(kDraining);
    active_.fetch_sub(1);
  }
  return reactor;
}

grpc::ServerUnaryReactor* KvCacheService::CreateSession(grpc::CallbackServerContext* context,
                                                        const v1::CreateSessionRequest* request,
                                                        v1::CreateSessionResponse* response) {
  return Unary(context, request, response, &Handler::CreateSession, "CreateSession");
}

grpc::ServerUnaryReactor* KvCacheService::GetSession(grpc::CallbackServerContext* context,
                                                     const v1::GetSessionRequest* request,
                                                     v1::SessionInfo* response) {
  return Unary(context, request, response, &Handler::GetSession, "GetSession");
}

grpc::ServerUnaryReactor* KvCacheService::ListSessions(grpc::CallbackServerContext* context,
                                                       const v1::ListSessionsRequest* request,
                                                       v1::ListSessionsResponse* response) {
  return Unary(context, request, response, &Handler::ListSessions, "ListSessions");
}

grpc::ServerUnaryReactor* KvCacheService::DeleteSession(grpc::CallbackServerContext* context,
                                                        const v1::DeleteSessionRequest* request,
                                                        v1::DeleteSessionResponse* response) {
  return Unary(context, request, response, &Handler::DeleteSession, "DeleteSession");
}

grpc::ServerUnaryReactor* KvCacheService::TruncateSession(grpc::CallbackServerContext* context,
                                                          const v1::TruncateSessionRequest* request,
                                                          v1::SessionInfo* response) {
  return Unary(context, request, response, &Handler::TruncateSession, "TruncateSession");
}

grpc::ServerUnaryReactor* KvCacheService::ForkSession(grpc::CallbackServerContext* context,
                                                      const v1::ForkSessionRequest* request,
                                                      v1::ForkSessionResponse* response) {
  return Unary(context, request, response, &Handler::ForkSession, "ForkSession");
}

grpc::ServerUnaryReactor* KvCacheService::Step(grpc::CallbackServerContext* context,
                                               const v1::StepRequest* request, v1::StepResponse* response) {
  return Unary(context, request, response, &Handler::Step, "Step");
}

grpc::ServerUnaryReactor* KvCacheService::Stats(grpc::CallbackServerContext* context,
                                                const v1::StatsRequest* request, v1::StatsResponse* response) {
  return Unary(context, request, response, &Handler::Stats, "Stats");
}

grpc::ServerUnaryReactor* KvCacheService::Snapshot(grpc::CallbackServerContext* context,
                                                   const v1::SnapshotRequest* request, v1::SnapshotResponse* response) {
  return Unary(context, request, response, &Handler::Snapshot, "Snapshot");
}

absl::StatusOr<std::string> KvCacheService::Tenant(grpc::CallbackServerContext* context) const {
  if (draining_.load()) return absl::UnavailableError(kDraining.error_message());
  if (authenticator_ == nullptr) return std::string();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return authenticator_->Authenticate(nullptr);
  const absl::string_view value(it->second.data(), it->second.size());
  return authenticator_->Authenticate(&value);
}

grpc::ServerBidiReactor<v1::AppendRequest, v1::AppendResponse>* KvCacheService::Append(
    grpc::CallbackServerContext* context) {
  active_.fetch_add(1);  // before Tenant()'s draining check; the reactor's OnDone uncounts it
  return new StreamReactor<v1::AppendRequest, v1::AppendResponse>(handler_, executor_, &Handler::Append,
                                                                   Tenant(context), &active_, /*open=*/nullptr, metrics_,
                                                                   "Append");
}

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* KvCacheService::Attend(
    grpc::CallbackServerContext* context) {
  active_.fetch_add(1);  // before Tenant()'s draining check; the reactor's OnDone uncounts it
  return new StreamReactor<v1::AttendRequest, v1::AttendResponse>(handler_, executor_, &Handler::Attend,
                                                                   Tenant(context), &active_, /*open=*/nullptr, metrics_,
                                                                   "Attend");
}

grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* KvCacheService::Decode(
    grpc::CallbackServerContext* context) {
  active_.fetch_add(1);  // before Tenant()'s draining check; the reactor's OnDone uncounts it
  return new StreamReactor<v1::DecodeRequest, v1::DecodeResponse>(handler_, executor_, &Handler::Decode,
                                                                   Tenant(context), &active_, open_.get(), metrics_,
                                                                   "Decode");
}

grpc::ServerWriteReactor<v1::ReadKvResponse>* KvCacheService::ReadKv(grpc::CallbackServerContext* context,
                                                                     const v1::ReadKvRequest* request) {
  active_.fetch_add(1);  // before Tenant()'s draining check; the reactor's OnDone uncounts it
  return new ReadKvReactor(handler_, executor_, request, Tenant(context), &active_, metrics_);
}

}  // namespace turbokv
