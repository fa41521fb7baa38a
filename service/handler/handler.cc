#include "service/handler/handler.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"
#include "service/handler/common.h"
#include "service/status_macros.h"

namespace turbokv {

using google::protobuf::util::TimeUtil;

Handler::Handler(SessionStore* store, const HandlerOptions& options)
    : store_(store), options_(options) {}

absl::Status Handler::GoneStatus(const std::string& id, const std::string& tenant) {
  // Deleted or evicted between the lookup and the lock: the store knows why.
  absl::StatusOr<std::shared_ptr<SessionCache>> again = store_->Find(id, tenant, absl::Now());
  return again.ok() ? absl::NotFoundError(absl::StrCat("no session ", ShowId(id))) : again.status();
}

namespace {
thread_local absl::Time call_deadline = absl::InfiniteFuture();
}  // namespace

CallDeadline::CallDeadline(absl::Time deadline) : previous_(call_deadline) { call_deadline = deadline; }
CallDeadline::~CallDeadline() { call_deadline = previous_; }
absl::Time CallDeadline::Current() { return call_deadline; }

absl::Status Handler::Promote(SessionCache& session, absl::Span<const SessionCache* const> held) {
  if (session.resident()) return absl::OkStatus();
  const absl::Time start = absl::Now();
  const absl::Status status = store_->residency().Promote(session, held, options_.kernel_pool, CallDeadline::Current());
  if (status.ok() && options_.metrics != nullptr) {
    options_.metrics->ObservePromotion(absl::ToDoubleSeconds(absl::Now() - start));
  }
  return status;
}

absl::StatusOr<std::shared_ptr<SessionCache>> Handler::FindLocked(const std::string& id, const std::string& tenant,
                                                                  std::unique_lock<std::mutex>* lock, bool promote) {
  if (id.empty()) return absl::InvalidArgumentError("session_id is empty");
  absl::StatusOr<std::shared_ptr<SessionCache>> session = store_->Find(id, tenant, absl::Now());
  if (!session.ok()) return session.status();
  *lock = std::unique_lock<std::mutex>((*session)->mutex());
  if ((*session)->gone()) {
    lock->unlock();
    return GoneStatus(id, tenant);
  }
  if (promote) {
    const SessionCache* held[] = {session->get()};
    TURBOKV_RETURN_IF_ERROR(Promote(**session, held));
  }
  return session;
}

absl::StatusOr<std::shared_ptr<SessionCache>> Handler::FindLockedLayer(const std::string& id,
                                                                       const std::string& tenant, int layer,
                                                                       std::unique_lock<std::mutex>* lock) {
  TURBOKV_ASSIGN_OR_RETURN(std::shared_ptr<SessionCache> session, FindLocked(id, tenant, lock));
  TURBOKV_RETURN_IF_ERROR(CheckLayer(session->config(), layer, "layer"));
  return session;
}

Handler::LockedBatch Handler::FindLockedBatch(const google::protobuf::RepeatedPtrField<std::string>& ids,
                                              const std::string& tenant) {
  LockedBatch batch;
  const size_t n = static_cast<size_t>(ids.size());
  batch.status.resize(n);
  batch.sessions.resize(n);
  std::unordered_map<std::string, size_t> first;
  for (size_t i = 0; i < n; ++i) {
    const std::string& id = ids[static_cast<int>(i)];
    if (id.empty()) {
      batch.status[i] = absl::InvalidArgumentError(absl::StrCat("session_ids[", i, "] is empty"));
      continue;
    }
    auto [seen, inserted] = first.emplace(id, i);
    if (!inserted) {
      batch.status[i] = absl::InvalidArgumentError(absl::StrCat(
          "session_ids[", i, "] repeats session_ids[", seen->second, "]: a session appears once per message"));
      continue;
    }
    absl::StatusOr<std::shared_ptr<SessionCache>> session = store_->Find(id, tenant, absl::Now());
    if (session.ok()) {
      batch.sessions[i] = *std::move(session);
    } else {
      batch.status[i] = session.status();
    }
  }
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i) {
    if (batch.sessions[i] != nullptr) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return batch.sessions[a]->id() < batch.sessions[b]->id(); });
  for (size_t i : order) {
    std::unique_lock<std::mutex> lock(batch.sessions[i]->mutex());
    if (batch.sessions[i]->gone()) {
      lock.unlock();
      batch.status[i] = GoneStatus(batch.sessions[i]->id(), tenant);
      batch.sessions[i].reset();
      continue;
    }
    batch.held.push_back(batch.sessions[i].get());
    batch.locks.push_back(std::move(lock));
  }
  for (size_t i : order) {
    if (batch.sessions[i] == nullptr) continue;
    if (absl::Status status = Promote(*batch.sessions[i], batch.held); !status.ok()) {
      batch.status[i] = status;
      batch.sessions[i].reset();
    }
  }
  return batch;
}

v1::SessionInfo Handler::Info(const SessionCache& session) const {
  v1::SessionInfo info;
  info.set_session_id(session.id());
  ConfigToProto(session.config(), info.mutable_config());
  const SessionConfig& config = session.config();
  for (int l = 0; l < config.layers; ++l) {
    info.add_layer_tokens(session.layer_tokens(l));
    const v1::Codec key = ToProtoCodec(config.KeyCodec(l)), value = ToProtoCodec(config.ValueCodec(l));
    const int ranges = info.layers_size();
    if (ranges > 0 && info.layers(ranges - 1).key_codec() == key && info.layers(ranges - 1).value_codec() == value) {
      info.mutable_layers(ranges - 1)->set_last_layer(l);
      continue;
    }
    v1::LayerCodecs* layer = info.add_layers();
    layer->set_first_layer(l);
    layer->set_last_layer(l);
    layer->set_key_codec(key);
    layer->set_value_codec(value);
  }
  info.set_bits_per_value(BitsPerValue(config));
  info.set_transformed_layers(session.transformed_layers());
  info.set_named_blocks(static_cast<int64_t>(store_->prefix_index().named(session.id())));
  info.set_block_tokens(store_->options().page_tokens);
  EncodeStats all;
  for (const SessionCache::LayerErrors& layer : session.errors()) {
    info.add_key_errors(layer.keys.mean_error());
    info.add_value_errors(layer.values.mean_error());
    all.Add(layer.keys);
    all.Add(layer.values);
  }
  if (all.fp16_fields > 0) {
    info.set_fp16_saturated_fraction(static_cast<double>(all.saturated) / all.fp16_fields);
    info.set_fp16_underflowed_fraction(static_cast<double>(all.underflowed) / all.fp16_fields);
  }
  info.set_bytes_used(static_cast<int64_t>(session.bytes_used()));
  info.set_residency(!session.resident() ? v1::RESIDENCY_DISK
                     : session.on_tier() ? v1::RESIDENCY_MEMORY_AND_DISK
                                         : v1::RESIDENCY_MEMORY);
  info.set_disk_bytes(static_cast<int64_t>(store_->residency().TierBytes(session)));
  info.set_fp16_bytes(static_cast<int64_t>(session.fp16_bytes()));
  const absl::Time now = absl::Now();
  *info.mutable_age() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(now - session.created()));
  *info.mutable_idle() = TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(now - session.last_used()));
  return info;
}

}  // namespace turbokv
