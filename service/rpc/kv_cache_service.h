// gRPC transport of KvCacheService: callback reactors that move messages
// between gRPC and the Handler. They hold no logic and never block: each
// request is handed to the Executor, and the reactor is resumed from there.
#pragma once

#include <atomic>
#include <memory>

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

class KvCacheService final : public v1::KvCacheService::CallbackService {
 public:
  // metrics: RPC durations and errors (nullptr: none). authenticator: every
  // call needs a bearer token naming its tenant (nullptr: no tokens, one
  // tenant).
  KvCacheService(Handler* handler, Executor* executor, Metrics* metrics, const Authenticator* authenticator);
  ~KvCacheService() override;

  // From now on new calls are refused with UNAVAILABLE; calls in flight go
  // on. A Decode stream waiting for its client's next message ends at once
  // with UNAVAILABLE; one with a message in flight, once that is answered.
  void StartDraining();
  // Calls started and not yet finished.
  int active_calls() const { return active_.load(); }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::CreateSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(grpc::CallbackServerContext* context,
                                          const v1::DeleteSessionRequest* request,
                                          v1::DeleteSessionResponse* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* context,
                                            const v1::TruncateSessionRequest* request,
                                            v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::ForkSessionResponse* response) override;
  grpc::ServerBidiReactor<v1::AppendRequest, v1::AppendResponse>* Append(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* Attend(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context, const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* Decode(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<v1::ReadKvResponse>* ReadKv(grpc::CallbackServerContext* context,
                                                       const v1::ReadKvRequest* request) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context, const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;
  grpc::ServerUnaryReactor* Snapshot(grpc::CallbackServerContext* context, const v1::SnapshotRequest* request,
                                     v1::SnapshotResponse* response) override;

  // The bidirectional streams open now (rpc/kv_cache_service.cc).
  struct OpenStreams;

 private:
  // The caller's tenant from its metadata, or UNAUTHENTICATED.
  absl::StatusOr<std::string> Tenant(grpc::CallbackServerContext* context) const;

  template <typename Request, typename Response, typename Method>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, const Request* request,
                                  Response* response, Method method, const char* name);

  Handler* handler_;
  Executor* executor_;
  Metrics* metrics_;
  const Authenticator* authenticator_;
  std::atomic<bool> draining_{false};
  std::atomic<int> active_{0};
  std::unique_ptr<OpenStreams> open_;
};

}  // namespace turbokv
