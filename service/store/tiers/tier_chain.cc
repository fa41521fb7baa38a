#include "service/store/tiers/tier_chain.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "service/store/tiers/disk_tier.h"
#include "service/store/tiers/redis_tier.h"
#include "service/store/tiers/stacked_tier.h"

namespace turbokv {
namespace {

absl::StatusOr<RedisTierOptions> RedisOptions(const TierChainOptions& options, int page_tokens) {
  absl::StatusOr<RedisAddress> address = ParseRedisUrl(options.redis_url);
  if (!address.ok()) return address.status();
  RedisTierOptions redis;
  redis.address = *std::move(address);
  redis.address.user = options.redis_user;
  redis.address.password = options.redis_password;
  if (!redis.address.tls && !(options.redis_tls_ca + options.redis_tls_cert + options.redis_tls_key).empty()) {
    return absl::InvalidArgumentError("--redis-tls-ca, --redis-tls-cert and --redis-tls-key need a rediss:// URL");
  }
  if (options.redis_tls_cert.empty() != options.redis_tls_key.empty()) {
    return absl::InvalidArgumentError("--redis-tls-cert and --redis-tls-key go together");
  }
  redis.address.tls_ca = options.redis_tls_ca;
  redis.address.tls_cert = options.redis_tls_cert;
  redis.address.tls_key = options.redis_tls_key;
  redis.budget_bytes = options.redis_budget;
  redis.page_tokens = page_tokens;
  redis.lease = options.redis_lease;
  redis.timeout = options.redis_timeout;
  if (options.redis_timeout * 3 >= options.redis_lease) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--redis-timeout ", absl::FormatDuration(options.redis_timeout), " is not under a third of --redis-lease (",
        absl::FormatDuration(options.redis_lease),
        "): one slow reply would cost this daemon its leases, since they are renewed every third of it"));
  }
  if (options.redis_orphan_ttl < 3 * options.redis_lease) {
    return absl::InvalidArgumentError(absl::StrCat("--redis-orphan-ttl ", absl::FormatDuration(options.redis_orphan_ttl),
                                                   " is shorter than 3 x --redis-lease (",
                                                   absl::FormatDuration(3 * options.redis_lease), ")"));
  }
  redis.orphan_ttl = options.redis_orphan_ttl;
  redis.acknowledge_written = options.redis_acknowledge_written;
  redis.max_queued_bytes = options.redis_queue;
  return redis;
}

}  // namespace

absl::StatusOr<TierChain> MakeTierChain(const TierChainOptions& options, int page_tokens) {
  TierChain chain;
  std::unique_ptr<SharedTier> shared;
  if (!options.redis_url.empty()) {
    absl::StatusOr<RedisTierOptions> redis = RedisOptions(options, page_tokens);
    if (!redis.ok()) return redis.status();
    absl::StatusOr<std::unique_ptr<RedisTier>> opened = RedisTier::Open(*redis);
    if (!opened.ok()) return opened.status();
    chain.redis = opened->get();
    shared = *std::move(opened);
  }
  if (!options.spill_dir.empty()) {
    DiskTierOptions disk;
    disk.dir = options.spill_dir;
    disk.budget_bytes = options.spill_budget;
    disk.page_tokens = page_tokens;
    absl::StatusOr<std::unique_ptr<DiskTier>> opened = DiskTier::Open(disk);
    if (!opened.ok()) return opened.status();
    // With Redis too, the disk sits between memory and Redis: promotion
    // reads it first, Redis holds the truth.
    if (shared == nullptr) {
      chain.top = *std::move(opened);
    } else {
      chain.top = std::make_unique<StackedTier>(*std::move(opened), std::move(shared));
    }
  } else {
    chain.top = std::move(shared);
  }
  if (chain.top != nullptr) {
    for (const Tier* part : chain.top->Parts()) chain.names.push_back(part->name());
  }
  return chain;
}

}  // namespace turbokv
