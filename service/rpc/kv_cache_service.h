// gRPC transport of KvCacheService: callback reactors that move messages
// between gRPC and the Handler. They hold no logic and never block: each
// request is handed to the Executor, and the reactor is resumed from there.
//
// Every method is registered raw (bytes in, bytes out): requests are parsed
// on the executor, so that a message that does not parse is answered
// INVALID_ARGUMENT naming the method (and, in a stream, which message), and
// counted, instead of gRPC's bare UNIMPLEMENTED or a stream ending OK.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/handler/handler.h"
#include "service/metrics.h"
#include "turbokv/v1/turbokv.grpc.pb.h"

namespace turbokv {

// The one conversion from absl::Status to grpc::Status.
grpc::Status ToGrpcStatus(const absl::Status& status);

struct ServiceLimits {
  // Per tenant: calls (a stream counts once per message being processed)
  // and bytes in flight (requests, and stream replies their client has not
  // taken yet). Past either, a call is refused at once
  // with RESOURCE_EXHAUSTED naming the limit.
  int64_t tenant_calls = 128;
  int64_t tenant_bytes = int64_t{1} << 30;
};

// Every method raw and on the callback API, through the classes gRPC
// generates for that (WithRawCallbackMethod_*).
using RawKvCacheService = v1::KvCacheService::WithRawCallbackMethod_CreateSession<
    v1::KvCacheService::WithRawCallbackMethod_GetSession<
    v1::KvCacheService::WithRawCallbackMethod_ListSessions<
    v1::KvCacheService::WithRawCallbackMethod_DeleteSession<
    v1::KvCacheService::WithRawCallbackMethod_TruncateSession<
    v1::KvCacheService::WithRawCallbackMethod_ForkSession<
    v1::KvCacheService::WithRawCallbackMethod_NameBlocks<
    v1::KvCacheService::WithRawCallbackMethod_Append<
    v1::KvCacheService::WithRawCallbackMethod_Attend<
    v1::KvCacheService::WithRawCallbackMethod_Step<
    v1::KvCacheService::WithRawCallbackMethod_Decode<
    v1::KvCacheService::WithRawCallbackMethod_ReadKv<
    v1::KvCacheService::WithRawCallbackMethod_Stats<
    v1::KvCacheService::WithRawCallbackMethod_Snapshot<
    v1::KvCacheService::WithRawCallbackMethod_Prefetch<
    v1::KvCacheService::Service>>>>>>>>>>>>>>>;

class KvCacheService final : public RawKvCacheService {
 public:
  // metrics: RPC durations and errors (nullptr: none). authenticator: every
  // call needs a bearer token naming its tenant (nullptr: no tokens, one
  // tenant).
  KvCacheService(Handler* handler, Executor* executor, Metrics* metrics, const Authenticator* authenticator,
                 const ServiceLimits& limits);
  ~KvCacheService() override;

  // From now on new calls are refused with UNAVAILABLE; calls in flight go
  // on. A Decode stream waiting for its client's next message ends at once
  // with UNAVAILABLE; one with a message in flight, once that is answered.
  void StartDraining();
  // Calls started and not yet finished.
  int active_calls() const;
  // Bytes of requests and replies (reserved or made, not yet taken by their
  // client) in flight, over tenants.
  int64_t in_flight_bytes() const;

  // What the calls share: the handler, the executor, the open streams and
  // the calls and bytes in flight per tenant (rpc/kv_cache_service.cc).
  struct Parts;

  // The methods' reactors (each hides the base's synchronous overload, which
  // the raw callback class already disables).
  using RawKvCacheService::CreateSession;
  using RawKvCacheService::GetSession;
  using RawKvCacheService::ListSessions;
  using RawKvCacheService::DeleteSession;
  using RawKvCacheService::TruncateSession;
  using RawKvCacheService::ForkSession;
  using RawKvCacheService::NameBlocks;
  using RawKvCacheService::Append;
  using RawKvCacheService::Attend;
  using RawKvCacheService::Step;
  using RawKvCacheService::Decode;
  using RawKvCacheService::ReadKv;
  using RawKvCacheService::Stats;
  using RawKvCacheService::Snapshot;
  using RawKvCacheService::Prefetch;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* NameBlocks(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Snapshot(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Prefetch(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Append(grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Attend(grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ReadKv(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request) override;

 private:
  // The caller's tenant from its metadata, or UNAUTHENTICATED.
  absl::StatusOr<std::string> Tenant(grpc::CallbackServerContext* context) const;

  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Unary(const char* name,
                                  absl::StatusOr<Response> (Handler::*method)(const Request&, const std::string&),
                                  grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response);
  template <typename Request, typename Response>
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      const char* name, absl::StatusOr<Response> (Handler::*method)(const Request&, const std::string&),
      bool drainable, grpc::CallbackServerContext* context);

  const Authenticator* authenticator_;
  std::atomic<bool> draining_{false};
  std::unique_ptr<Parts> parts_;
};

}  // namespace turbokv
