// The tiers below memory, built from the daemon's options as MakeBackend
// builds a backend: the disk (--spill-dir), Redis (--redis-url), or the
// disk stacked over Redis when both are given. Validates the combinations
// of options that only the tiers use, naming the flags.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/store/tiers/tier.h"

namespace turbokv {

class RedisTier;

struct TierChainOptions {
  // The disk tier (empty: none): sealed pages are written through to
  // segment files here, idle sessions are demoted here instead of evicted,
  // and a restart brings back what it holds. At most spill_budget bytes of
  // live records.
  std::string spill_dir;
  size_t spill_budget = size_t{64} << 30;
  // The Redis tier (empty: none; under the disk tier when both are given):
  // sealed pages are written through to Redis, idle sessions demoted there,
  // sessions this daemon does not hold taken over from it, and the drain
  // hands every session over. At most redis_budget bytes; leases of
  // redis_lease; each command within redis_timeout.
  std::string redis_url;
  // AUTH on every connection when the password is set (never logged).
  std::string redis_user;
  std::string redis_password;
  // With a rediss:// URL: the CA file (empty: the system's), and a client
  // certificate and key (PEM files; both or neither).
  std::string redis_tls_ca;
  std::string redis_tls_cert;
  std::string redis_tls_key;
  size_t redis_budget = size_t{64} << 30;
  absl::Duration redis_lease = absl::Seconds(10);
  absl::Duration redis_timeout = absl::Seconds(1);
  absl::Duration redis_orphan_ttl = absl::Hours(24 * 7);
  bool redis_acknowledge_written = true;  // --redis-acknowledge
  size_t redis_queue = size_t{64} << 20;  // --redis-queue
};

struct TierChain {
  std::unique_ptr<Tier> top;          // null when no tier is asked for
  const RedisTier* redis = nullptr;   // in top, with a Redis URL
  std::vector<std::string> names;     // of top's parts, top first ("disk", "redis")
};

// INVALID_ARGUMENT naming the flag for options that do not go together, or
// the error of opening a tier.
absl::StatusOr<TierChain> MakeTierChain(const TierChainOptions& options, int page_tokens);

}  // namespace turbokv
