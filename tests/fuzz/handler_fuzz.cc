// libFuzzer target: arbitrary bytes as each request type into the Handler.
// The first byte picks the call; the rest is parsed as its request message.
// Session ids "0" to "3" stand for four live sessions (made again when a
// call deletes one), so the fuzzer reaches appends, attention, forks and
// reads rather than stopping at NOT_FOUND. Every call must return a status,
// never crash, and a failed call must leave the session's lengths unchanged.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/cpu/thread_pool.h"
#include "service/handler/handler.h"

namespace turbokv {
namespace {

struct World {
  ThreadPool pool{1};
  std::unique_ptr<SessionStore> store;
  std::unique_ptr<Handler> handler;
  std::string ids[4];

  World() {
    // Invalid UTF-8 in string fields is a parse failure, logged by protobuf
    // on every such input: keep the fuzzer's output readable.
    google::protobuf::SetLogHandler(nullptr);
    StoreOptions store_options;
    store_options.budget_bytes = size_t{32} << 20;
    store_options.eviction = EvictionPolicy::kLru;
    store_options.page_tokens = 16;
    store = std::make_unique<SessionStore>(store_options);
    HandlerOptions options;
    options.kernel_pool = &pool;
    options.max_tokens = 4096;
    handler = std::make_unique<Handler>(store.get(), options);
  }

  // The real id behind "0".."3", making the session when it is gone.
  std::string Resolve(const std::string& id) {
    if (id.size() != 1 || id[0] < '0' || id[0] > '3') return id;
    std::string& real = ids[id[0] - '0'];
    v1::GetSessionRequest get;
    get.set_session_id(real);
    if (real.empty() || !handler->GetSession(get).ok()) {
      v1::CreateSessionRequest create;
      v1::ModelShape* shape = create.mutable_config()->mutable_shape();
      shape->set_layers(2);
      shape->set_kv_heads(1 + (id[0] - '0') % 2);
      shape->set_q_heads(2 * shape->kv_heads());
      shape->set_head_dim(64);
      create.mutable_config()->set_key_codec(static_cast<v1::Codec>(1 + (id[0] - '0') * 2 % 6));
      real = handler->CreateSession(create)->session_id();
    }
    return real;
  }

  std::vector<int64_t> Lengths(const std::string& id) {
    v1::GetSessionRequest get;
    get.set_session_id(id);
    auto info = handler->GetSession(get);
    if (!info.ok()) return {};
    return {info->layer_tokens().begin(), info->layer_tokens().end()};
  }
};

template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* request) {
  return request->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace
}  // namespace turbokv

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace turbokv;
  static World* world = new World();
  if (size < 1) return 0;
  const uint8_t kind = data[0] % 13;
  ++data;
  --size;
  switch (kind) {
    case 0: {
      v1::CreateSessionRequest r;
      if (!Parse(data, size, &r)) return 0;
      // Keep the fuzzer's sessions small: big shapes only cost memory.
      if (r.config().shape().layers() > 4 || r.config().shape().kv_heads() > 4 ||
          r.config().shape().head_dim() > 256) {
        return 0;
      }
      auto created = world->handler->CreateSession(r);
      if (created.ok()) {
        v1::DeleteSessionRequest d;
        d.set_session_id(created->session_id());
        if (!world->handler->DeleteSession(d).ok()) abort();
      }
      return 0;
    }
    case 1: {
      v1::AppendRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      const std::vector<int64_t> before = world->Lengths(r.session_id());
      if (!world->handler->Append(r).ok() && world->Lengths(r.session_id()) != before) abort();
      return 0;
    }
    case 2: {
      v1::AttendRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      world->handler->Attend(r).IgnoreError();
      return 0;
    }
    case 3: {
      v1::StepRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      const std::vector<int64_t> before = world->Lengths(r.session_id());
      if (!world->handler->Step(r).ok() && world->Lengths(r.session_id()) != before) abort();
      return 0;
    }
    case 4: {
      v1::ReadKvRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      auto cursor = world->handler->StartReadKv(r);
      for (int i = 0; cursor.ok() && i < 64; ++i) {
        v1::ReadKvResponse response;
        auto more = world->handler->NextReadKv(*cursor, &response);
        if (!more.ok() || !*more) break;
      }
      return 0;
    }
    case 5: {
      v1::ForkSessionRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_source_session_id(world->Resolve(r.source_session_id()));
      auto fork = world->handler->ForkSession(r);
      if (fork.ok()) {
        v1::DeleteSessionRequest d;
        d.set_session_id(fork->session_id());
        world->handler->DeleteSession(d).IgnoreError();
      }
      return 0;
    }
    case 6: {
      v1::TruncateSessionRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      world->handler->TruncateSession(r).IgnoreError();
      return 0;
    }
    case 7: {
      v1::DeleteSessionRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      world->handler->DeleteSession(r).IgnoreError();
      return 0;
    }
    case 8: {
      v1::GetSessionRequest r;
      if (!Parse(data, size, &r)) return 0;
      r.set_session_id(world->Resolve(r.session_id()));
      world->handler->GetSession(r).IgnoreError();
      return 0;
    }
    case 9: {
      world->handler->ListSessions(v1::ListSessionsRequest()).IgnoreError();
      return 0;
    }
    case 10: {
      world->handler->Stats(v1::StatsRequest()).IgnoreError();
      return 0;
    }
    case 11: {
      // A Decode batch: a failed message changes no session, and an item
      // that failed changes nothing of its own session.
      v1::DecodeRequest r;
      if (!Parse(data, size, &r) || r.session_ids_size() > 8) return 0;
      std::vector<std::vector<int64_t>> before;
      for (std::string& id : *r.mutable_session_ids()) {
        id = world->Resolve(id);
        before.push_back(world->Lengths(id));
      }
      auto decoded = world->handler->Decode(r);
      for (int i = 0; i < r.session_ids_size(); ++i) {
        const bool item_failed = !decoded.ok() || decoded->status(i).code() != 0;
        const bool repeated = std::count(r.session_ids().begin(), r.session_ids().begin() + i, r.session_ids(i)) > 0;
        if (item_failed && !repeated && world->Lengths(r.session_ids(i)) != before[i]) abort();
      }
      return 0;
    }
    default: {
      world->store->ExpireIdle(absl::Now());
      return 0;
    }
  }
}
