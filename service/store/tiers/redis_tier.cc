#include "service/store/tiers/redis_tier.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "service/byte_size.h"
#include "service/log.h"
#include "service/records/session_id.h"

namespace turbokv {
namespace {

constexpr char kPageMagic[4] = {'T', 'K', 'V', 'P'};
constexpr char kManifestMagic[4] = {'T', 'K', 'V', 'M'};
// 2: a manifest's session header holds the key transform, value centering
// and sink tokens, and each layer's entry its transform and sink page;
// manifests of version 1 are still read (pages are unchanged); 3: it also
// lists the blocks the session named for reuse (written only then, so that
// a turbokvd of before reads the others); 4: as 3, and a layer's sink page
// may hold tokens past the sinks (held exact until its transform is fitted).
constexpr uint16_t kVersion = 4;
constexpr uint16_t kVersionNamed = 3;
constexpr uint16_t kVersionUnnamed = 2;
constexpr uint16_t kOldestVersion = 1;
constexpr size_t kEpochOffset = 8;         // in a page and in a manifest: after magic, version, 0
constexpr size_t kPageHeaderBytes = 48;    // magic .. payload CRC
constexpr int64_t kTombstoneEpochMs = 86400000;
constexpr size_t kReadBatch = 32;  // pages per round trip of a promotion  // a deleted session's epoch stays a day: its pages' deletes still check it

// Every write first checks that KEYS[1], the session's epoch, is ARGV[1].
// A daemon whose session was claimed by another (a larger epoch, or one
// that is not a number) gets "STALE <epoch now>"; one whose epoch is gone or
// smaller gets "LOST <epoch now>": Redis lost data (a restart without its
// append-only file, or from an older one), and nobody claimed the session
// since, since a claim raises the epoch above this daemon's.
#define TURBOKV_FENCE                                                                                  \
  "local e = redis.call('GET', KEYS[1]) "                                                              \
  "if e ~= ARGV[1] then "                                                                              \
  "  local n = tonumber(e) "                                                                           \
  "  if e and not (n and n < tonumber(ARGV[1])) then return redis.error_reply('STALE ' .. e) end "    \
  "  return redis.error_reply('LOST ' .. (e or 'none')) "                                             \
  "end "

// Every key of a session expires --redis-orphan-ttl after it was last
// written or refreshed: the owner refreshes them all every quarter of it
// (RedisTier::Refresh), a claim at once. Scripts take the TTL in ms as
// their last ARGV.
//
// KEYS: lease, epoch, manifest. ARGV: owner, lease ms, whether the manifest
// must exist, TTL, the epoch it must have ('' for any). {0}: no manifest;
// {-3, epoch}: not the epoch asked for (checked before the lease: a copy
// of a session another daemon claimed since is told so even while that
// daemon holds it); {-1, holder, ms left}: leased by another; {-2}: a
// manifest without its epoch (Redis lost data: the epoch cannot be told, so
// nobody claims it; its owner, if alive, restores it); {epoch[, manifest]}.
// A lease this owner holds already (a claim whose answer timed out, sent
// again) is its own. Every write and renewal
// refreshes the epoch's expiry with its own keys', so that the epoch
// outlives what it fences.
constexpr char kAcquire[] =
    "local m = false "
    "if ARGV[3] == '1' then m = redis.call('GET', KEYS[3]) if not m then return {0} end end "
    "local holder = redis.call('GET', KEYS[1]) "
    "if holder and string.sub(holder, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then "
    "  local mine = tonumber(string.sub(holder, #ARGV[1] + 2)) "
    "  if m then return {mine, m} end "
    "  return {mine} "
    "end "
    "local was = redis.call('GET', KEYS[2]) "
    "if ARGV[5] ~= '' and was ~= ARGV[5] then return {-3, was or 'none'} end "
    "if holder then return {-1, holder, redis.call('PTTL', KEYS[1])} end "
    "if m and not was then return {-2} end "
    "local e = redis.call('INCR', KEYS[2]) "
    "redis.call('PEXPIRE', KEYS[2], ARGV[4]) "
    "redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. e, 'PX', ARGV[2]) "
    "if m then return {e, m} end "
    "return {e}";
// KEYS: epoch, page, sealed pages, the layer's new slots. ARGV: epoch,
// value, field ('' for a tail), entry, TTL, the page's index. A sealed page
// holds what the new slots of its layer said when they are of it (or of a
// page before it, cut back since): they go; those of a later page (a
// session written again after Redis lost it) stay.
constexpr char kWritePage[] = TURBOKV_FENCE
    "redis.call('PEXPIRE', KEYS[1], ARGV[5]) "
    "redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[5]) "
    "if ARGV[3] ~= '' then "
    "  redis.call('HSET', KEYS[3], ARGV[3], ARGV[4]) redis.call('PEXPIRE', KEYS[3], ARGV[5]) "
    "  local first = redis.call('GETRANGE', KEYS[4], 0, 3) "
    "  if #first == 4 and struct.unpack('<i4', first) <= tonumber(ARGV[6]) then redis.call('DEL', KEYS[4]) end "
    "end "
    "return 1";
// KEYS: epoch, then the new slots of some layers. ARGV: epoch, an entry
// for each of them, TTL.
constexpr char kWriteTails[] = TURBOKV_FENCE
    "redis.call('PEXPIRE', KEYS[1], ARGV[#ARGV]) "
    "for i = 2, #KEYS do redis.call('APPEND', KEYS[i], ARGV[i]) redis.call('PEXPIRE', KEYS[i], ARGV[#ARGV]) end "
    "return 1";
// KEYS: epoch, manifest, sealed pages, the new slots of the layers it
// holds whole. ARGV: epoch, value, TTL. The manifest lists every page up to
// now: the sealed pages written before it go, and so do the new slots of
// every layer whose tail it holds.
constexpr char kWriteManifest[] = TURBOKV_FENCE
    "redis.call('PEXPIRE', KEYS[1], ARGV[3]) "
    "redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3]) "
    "redis.call('DEL', KEYS[3]) "
    "for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end "
    "return 1";
// KEYS: epoch, destination. ARGV: epoch, the page's value (read from the
// source first: in a cluster the two are in different slots), TTL.
constexpr char kCopy[] = TURBOKV_FENCE
    "redis.call('PEXPIRE', KEYS[1], ARGV[3]) "
    "redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3]) "
    "return 1";
// KEYS: epoch, page. ARGV: epoch.
constexpr char kDelete[] = TURBOKV_FENCE "redis.call('DEL', KEYS[2]) return 1";
// KEYS: epoch, lease, manifest, sealed pages, each layer's new slots.
// ARGV: epoch, epoch's expiry ms.
constexpr char kTombstone[] = TURBOKV_FENCE
    "redis.call('DEL', unpack(KEYS, 2)) "
    "redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
    "return 1";
// KEYS: lease, epoch. ARGV: lease value, ms, epoch, whether the epoch may
// be restored, TTL. 1: the lease is this daemon's for ms more (taken again
// if it lapsed while the epoch stayed this daemon's). 2: the epoch was gone
// or smaller (Redis lost data, and nobody claimed the session since):
// restored, with the lease; the session's records must be written again.
// A daemon that has not renewed for longer than the TTL may not restore it
// (its keys may have expired as an orphan's, or the session was deleted):
// "STALE none".
constexpr char kRenew[] =
    "local e = redis.call('GET', KEYS[2]) "
    "local h = redis.call('GET', KEYS[1]) "
    "if h and h ~= ARGV[1] then return redis.error_reply('STALE ' .. (e or 'none')) end "
    "if e == ARGV[3] then "
    "  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
    "  redis.call('PEXPIRE', KEYS[2], ARGV[5]) "
    "  return 1 "
    "end "
    "local n = tonumber(e) "
    "if (e and not (n and n < tonumber(ARGV[3]))) or ARGV[4] ~= '1' then "
    "  return redis.error_reply('STALE ' .. (e or 'none')) "
    "end "
    "redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[5]) "
    "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
    "return 2";
// KEYS: lease. ARGV: lease value.
constexpr char kRelease[] =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

#undef TURBOKV_FENCE

std::string MakeOwner() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  // Six characters of a fresh session id: two daemons of one host and pid
  // (a restart in a new container) still differ.
  return absl::StrCat(host, ".", getpid(), ".", NewSessionId().substr(0, 6));
}

// What the tier needs to know of Redis itself, from INFO server, memory and
// persistence (three commands: Redis before 7 takes one section at a time).
// An EVAL that does nothing checks that the user may run scripts (every
// write is one).
struct RedisFacts {
  std::string node;    // host:port (or socket path)
  std::string where;   // "Redis at URL", and the node of a cluster
  std::string run_id;  // another after a restart
  std::string policy;  // maxmemory-policy
  int64_t maxmemory = 0;
  bool aof = true;     // appendonly
};
std::vector<std::vector<std::string>> FactsCommands() {
  return {{"INFO", "server"}, {"INFO", "memory"}, {"INFO", "persistence"}, {"EVAL", "return 1", "0"}};
}
std::string InfoField(const RedisValue& info, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(info.str, absl::ByAnyChar("\r\n"), absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, name) && absl::ConsumePrefix(&line, ":")) return std::string(line);
  }
  return "";
}
// The facts, or why Redis would not tell them: PERMISSION_DENIED when it
// wants a password, FAILED_PRECONDITION for another error reply.
absl::StatusOr<RedisFacts> ReadFacts(const RedisAddress& address, const std::string& where,
                                     const std::vector<RedisValue>& replies) {
  for (size_t i = 0; i < 4; ++i) {
    if (replies[i].type != RedisValue::kError) continue;
    if (absl::StartsWith(replies[i].str, "NOAUTH")) {
      return absl::PermissionDeniedError(absl::StrCat(where,
                                                      " needs a password (--redis-password-file or "
                                                      "$TURBOKV_REDIS_PASSWORD): ",
                                                      replies[i].str));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        where, " refused ", i < 3 ? "INFO" : "EVAL", " (user '", address.user.empty() ? "default" : address.user,
        "' needs INFO, EVAL and the commands its scripts run: GET, SET, HSET, DEL, INCR, PEXPIRE, PTTL, APPEND, "
        "GETRANGE; and HGETALL, EXISTS, PING, and CLUSTER SLOTS and ASKING for a cluster): ",
        replies[i].str));
  }
  RedisFacts facts;
  facts.where = where;
  facts.run_id = InfoField(replies[0], "run_id");
  facts.policy = InfoField(replies[1], "maxmemory_policy");
  facts.aof = InfoField(replies[2], "aof_enabled") != "0";
  if (!absl::SimpleAtoi(InfoField(replies[1], "maxmemory"), &facts.maxmemory)) facts.maxmemory = 0;
  return facts;
}
// The facts of every master that answers (a cluster's; standalone, the
// one Redis's, `node` naming it), or the connection's error (UNAVAILABLE:
// no master answered), or the facts' own (ReadFacts). *silent: why a
// master that did not answer did not ("" when all did).
absl::StatusOr<std::vector<RedisFacts>> GatherFacts(RedisConnection& connection, const RedisAddress& address,
                                                    std::string* silent) {
  silent->clear();
  absl::StatusOr<std::vector<RedisConnection::NodeReplies>> nodes = connection.RunOnEveryNode(FactsCommands());
  if (!nodes.ok()) return nodes.status();
  std::vector<RedisFacts> all;
  for (const RedisConnection::NodeReplies& node : *nodes) {
    if (!node.replies.ok()) {
      // Failing over, or down: with Redis's default full coverage the
      // cluster refuses every slot meanwhile, and the tier is down.
      *silent = absl::StrCat("Redis Cluster at ", address.url, ": master ", node.node, " does not answer (",
                             node.replies.status().message(), ")");
      continue;
    }
    const std::string where = connection.cluster()
                                  ? absl::StrCat("Redis Cluster at ", address.url, " (node ", node.node, ")")
                                  : absl::StrCat("Redis at ", address.url);
    absl::StatusOr<RedisFacts> facts = ReadFacts(address, where, *node.replies);
    if (!facts.ok()) return facts.status();
    facts->node = node.node;
    all.push_back(*std::move(facts));
  }
  return all;
}
// Why a Redis that evicts keys under memory pressure is refused (empty
// when no node does): a session's pages, manifest or epoch would vanish.
std::string EvictionRefusal(const std::vector<RedisFacts>& nodes) {
  for (const RedisFacts& facts : nodes) {
    if (facts.policy.empty() || facts.policy == "noeviction") continue;
    return absl::StrCat(facts.where, " evicts keys under memory pressure (maxmemory-policy ", facts.policy,
                        "): sessions' pages and epochs would vanish from it; turbokvd writes to it only with "
                        "maxmemory-policy noeviction");
  }
  return "";
}
// Redis without a memory limit, or with one below this daemon's own budget
// in it (a cluster's masters' summed): a warning (other daemons may share
// it, so neither is refused).
void WarnOfMemory(const std::vector<RedisFacts>& nodes, size_t budget) {
  int64_t total = 0;
  for (const RedisFacts& facts : nodes) {
    if (facts.maxmemory == 0) {
      Logf(LogLevel::kWarning,
           "%s has no maxmemory: it grows until the machine or its container runs out of memory; set maxmemory "
           "with room for every daemon's --redis-budget",
           facts.where.c_str());
      return;
    }
    total += facts.maxmemory;
  }
  if (!nodes.empty() && static_cast<size_t>(total) < budget) {
    Logf(LogLevel::kWarning, "%s has maxmemory %s%s, below this daemon's --redis-budget %s alone",
         nodes.size() == 1 ? nodes[0].where.c_str() : "Redis Cluster", FormatByteSize(static_cast<size_t>(total)).c_str(),
         nodes.size() == 1 ? "" : " over its masters", FormatByteSize(budget).c_str());
  }
}

void WarnWithoutPersistence(const std::vector<RedisFacts>& nodes) {
  for (const RedisFacts& facts : nodes) {
    if (facts.aof) continue;
    Logf(LogLevel::kWarning,
         "%s runs without its append-only file (appendonly no): a restart of Redis loses what it held since its last "
         "snapshot; this daemon then writes the sessions it holds in memory again, but sessions held only in Redis "
         "are lost",
         facts.where.c_str());
  }
}

// An error reply that Redis gives only for now: loading its file, busy
// with a script, a replica, full, or (a cluster) a slot being moved or
// not served.
bool TransientRefusal(absl::string_view error) {
  for (absl::string_view transient : {"LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN", "OOM", "CLUSTERDOWN"}) {
    if (absl::StartsWith(error, transient)) return true;
  }
  return false;
}

// The commands the tier's scripts run, each tried once in a script on keys
// of their own (turbokv:{acl-probe}:*, gone within 10 s): an ACL user that
// may not run one would have every write refused. FAILED_PRECONDITION
// naming those it may not run; OK when Redis does not answer (the tier is
// down then, and says so).
absl::Status CheckCommands(RedisConnection& connection, const RedisAddress& address) {
  static constexpr char kProbe[] =
      "local refused = {} "
      "local function try(name, ...) "
      "  local r = redis.pcall(name, ...) "
      "  if type(r) == 'table' and r.err and (string.find(r.err, 'NOPERM', 1, true) or "
      "      string.find(r.err, \"can't run this command\", 1, true)) then refused[#refused + 1] = name end "
      "end "
      "try('SET', KEYS[1], 'x', 'PX', '10000') try('GET', KEYS[1]) try('APPEND', KEYS[1], 'y') "
      "try('GETRANGE', KEYS[1], 0, 1) try('EXISTS', KEYS[1]) try('PTTL', KEYS[1]) try('PEXPIRE', KEYS[1], 10000) "
      "try('HSET', KEYS[2], 'f', 'v') try('HGETALL', KEYS[2]) try('PEXPIRE', KEYS[2], 10000) "
      "try('INCR', KEYS[3]) try('PEXPIRE', KEYS[3], 10000) try('DEL', KEYS[1], KEYS[2], KEYS[3]) "
      "return refused";
  absl::StatusOr<RedisValue> refused = connection.Run(
      {"EVAL", kProbe, "3", "turbokv:{acl-probe}:k", "turbokv:{acl-probe}:h", "turbokv:{acl-probe}:c"});
  if (refused.ok() && refused->type == RedisValue::kError && !TransientRefusal(refused->str)) {
    return absl::FailedPreconditionError(
        absl::StrCat("Redis at ", address.url, " refused the script that checks turbokvd's commands: ", refused->str));
  }
  if (!refused.ok() || refused->type != RedisValue::kArray || refused->elements.empty()) return absl::OkStatus();
  std::vector<std::string> names;
  for (const RedisValue& name : refused->elements) names.push_back(name.str);
  return absl::FailedPreconditionError(absl::StrCat(
      "Redis at ", address.url, ": user '", address.user.empty() ? "default" : address.user, "' may not run ",
      absl::StrJoin(names, ", "), " (turbokvd's scripts run GET, SET, APPEND, GETRANGE, EXISTS, PTTL, PEXPIRE, HSET, "
      "HGETALL, INCR and DEL on keys turbokv:*)"));
}

std::string Field(int layer, int index) { return absl::StrCat(layer, ":", index); }
std::string TailsSuffix(int layer) { return absl::StrCat("d:", layer); }

// Why a page record's value is not the page of `bytes` bytes it should be
// (empty when it is): its payload starts at kPageHeaderBytes.
std::string PageProblem(const std::string& value, size_t bytes) {
  if (value.size() < kPageHeaderBytes || std::memcmp(value.data(), kPageMagic, sizeof(kPageMagic)) != 0) {
    return "is not a turbokv page";
  }
  Reader in(absl::string_view(value).substr(40, 8));
  const uint32_t payload = in.Get<uint32_t>();
  const uint32_t crc = in.Get<uint32_t>();
  if (payload != bytes || value.size() != kPageHeaderBytes + payload) {
    return absl::StrCat("holds ", payload, " bytes, not the ", bytes, " of this page");
  }
  if (Crc32c(absl::string_view(value).substr(kPageHeaderBytes)) != crc) return "fails its CRC";
  return "";
}

// A layer's new slots in Redis (d:LAYER): entries of i32 page index, from,
// to, heads, page_tokens, key bytes, value bytes, u32 CRC-32C of the slots,
// then the slots (CopySlots). Applied in order on top of page `index` as a
// claim finds it (`page`, `slots` filled; empty: none yet), each one that
// starts within what is there: a write sent again, or one whose call failed
// and was sent again, lands on the same slots. DATA_LOSS naming the
// problem for a malformed entry.
absl::Status ReplayTails(absl::string_view log, int32_t index, int32_t page_tokens, const SessionConfig& config,
                         std::string* page, int32_t* slots, bool* changed) {
  // A slot's code is at most a float per value and a few of header.
  const int32_t most_bytes = 4 * config.head_dim + 64;
  Reader in(log);
  while (in.left() > 0) {
    const int32_t at = in.Get<int32_t>();
    const int32_t from = in.Get<int32_t>();
    const int32_t to = in.Get<int32_t>();
    SlotShape shape;
    shape.heads = in.Get<int32_t>();
    shape.page_tokens = in.Get<int32_t>();
    shape.key_bytes = in.Get<int32_t>();
    shape.value_bytes = in.Get<int32_t>();
    const uint32_t crc = in.Get<uint32_t>();
    if (in.short_read() || shape.page_tokens != page_tokens || from < 0 || to < from || to >= page_tokens ||
        shape.heads != config.kv_heads || shape.key_bytes <= 0 || shape.key_bytes > most_bytes ||
        shape.value_bytes <= 0 || shape.value_bytes > most_bytes) {
      return absl::DataLossError("holds a malformed entry");
    }
    const absl::string_view written = in.Take(shape.slots_bytes(from, to));
    if (in.short_read()) return absl::DataLossError("is cut short");
    if (at != index || from > *slots) continue;
    if (Crc32c(written) != crc) return absl::DataLossError("holds an entry that fails its CRC");
    if (page->empty()) page->assign(shape.page_bytes(), '\0');
    if (page->size() != shape.page_bytes()) return absl::DataLossError("holds slots of another page size");
    PlaceSlots(written, shape, from, to, reinterpret_cast<uint8_t*>(page->data()));
    *slots = to;
    *changed = true;
  }
  return absl::OkStatus();
}

void PatchEpoch(std::string* value, int64_t epoch) {
  std::memcpy(value->data() + kEpochOffset, &epoch, sizeof(epoch));
}

}  // namespace

struct RedisTier::SessionState {
  std::string id;
  std::string tenant;
  std::string base;  // turbokv:{ID}:TENANT_HEX
  // Under the tier's mutex:
  int64_t epoch = 0;  // 0: not claimed yet (the writer claims a new session before its first write)
  bool disowned = false;
  bool let_go = false;  // claimed, then let go (LetGo): its pages stay when their handles go
  bool tombstoned = false;
  bool lost = false;  // Redis lost its records: in lost_, until the store takes them
  absl::Time confirmed = absl::InfinitePast();  // when Redis last confirmed the epoch (a claim, a renewal)
  std::set<std::string> pages;  // the keys of its page records (refreshed with the session's own)
  int layers = 0;               // its d:LAYER keys are those of layers below it
  // Copies into this session's keys of pages of other sessions (forks)
  // that its manifests listed, by the page's record.
  std::map<const TierRecord*, std::weak_ptr<Record>> copies;

  std::string Key(absl::string_view suffix) const { return absl::StrCat(base, ":", suffix); }
  std::string LeaseValue(const std::string& owner) const { return absl::StrCat(owner, " ", epoch); }
};

class RedisTier::Record final : public TierRecord {
 public:
  Record(RedisTier* tier, uint64_t lsn, size_t bytes, std::shared_ptr<SessionState> state, std::string key, bool page)
      : TierRecord(lsn, bytes, page ? key : ""), key(std::move(key)), page(page), state(std::move(state)), tier_(tier) {}
  ~Record() override {
    tier_->Forget(this);
    std::lock_guard<std::mutex> lock(tier_->mutex_);
    tier_->Release(this);
  }

  const std::string key;
  const bool page;  // else a manifest, new slots, or a tail a claim rebuilt
  const std::shared_ptr<SessionState> state;  // whose keys it is in
  // A tail a claim rebuilt from new slots: its bytes, here only (in Redis
  // they are the manifest's tail and d:LAYER until the new owner writes).
  std::string payload;
  // Under the tier's mutex:
  bool done = false;
  bool counted = false;  // in live_bytes_
  absl::Status status;
  // A manifest's pages (its copies of other sessions' pages among them):
  // in Redis while it is the session's latest manifest.
  std::vector<std::shared_ptr<Record>> listed;

 private:
  RedisTier* const tier_;
};

struct RedisTier::Job {
  enum Kind { kPage, kManifest, kCopy, kDelete, kTombstone, kTails } kind = kPage;
  std::weak_ptr<Record> record;  // expired: nobody needs it any more (pages, manifests, copies)
  std::shared_ptr<SessionState> state;
  std::string key;     // the page, manifest or copy written; the page deleted
  std::string source;  // kCopy: the page copied
  std::string value;   // kPage, kManifest (its epoch patched when sent)
  std::string field;   // kPage: in the sealed pages (empty for a tail)
  std::string entry;
  std::string layer_tails;  // kPage: its layer's new slots (d:LAYER)
  std::string index;        // kPage: its index in the layer
  std::vector<std::string> tail_keys, tail_entries;  // kTails; kManifest: the new slots it supersedes (keys only)
  size_t bytes = 0;    // queued

  static Job Of(Kind kind, std::shared_ptr<SessionState> state, std::string key,
                const std::shared_ptr<Record>& record = nullptr) {
    Job job;
    job.kind = kind;
    job.state = std::move(state);
    job.key = std::move(key);
    job.record = record;
    return job;
  }
};

struct RedisTier::Borrowed {
  RedisTier* tier;
  std::unique_ptr<RedisConnection> connection;
  Borrowed(RedisTier* t, std::unique_ptr<RedisConnection> c) : tier(t), connection(std::move(c)) {}
  Borrowed(Borrowed&&) = default;
  ~Borrowed() {
    if (connection == nullptr) return;
    std::lock_guard<std::mutex> lock(tier->readers_mutex_);
    tier->readers_.push_back(std::move(connection));
  }
  RedisConnection* operator->() { return connection.get(); }
};

RedisTier::RedisTier(const RedisTierOptions& options)
    : options_(options), owner_(MakeOwner()), writer_connection_(options.address, options.timeout) {}

absl::StatusOr<std::unique_ptr<RedisTier>> RedisTier::Open(const RedisTierOptions& options) {
  std::unique_ptr<RedisTier> tier(new RedisTier(options));
  {
    RedisConnection probe(options.address, options.timeout);
    std::string silent;
    absl::StatusOr<std::vector<RedisFacts>> facts = GatherFacts(probe, options.address, &silent);
    if (!facts.ok() && probe.misconfigured()) return absl::FailedPreconditionError(facts.status().message());
    if (absl::IsUnavailable(facts.status()) || !silent.empty()) {
      tier->up_ = false;
      tier->down_reason_ = facts.ok() ? silent : std::string(facts.status().message());
    } else {
      // Redis answers, but not as turbokvd needs: no start.
      if (!facts.ok()) return facts.status();
      if (std::string refusal = EvictionRefusal(*facts); !refusal.empty()) {
        return absl::FailedPreconditionError(refusal);
      }
      if (absl::Status allowed = CheckCommands(probe, options.address); !allowed.ok()) return allowed;
      WarnWithoutPersistence(*facts);
      WarnOfMemory(*facts, options.budget_bytes);
      for (const RedisFacts& node : *facts) tier->run_ids_[node.node] = node.run_id;
    }
  }
  tier->writer_ = std::thread([t = tier.get()] { t->WriterLoop(); });
  return tier;
}

RedisTier::~RedisTier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  if (writer_.joinable()) writer_.join();
}

RedisTier::Borrowed RedisTier::Borrow() {
  std::lock_guard<std::mutex> lock(readers_mutex_);
  if (readers_.empty()) return Borrowed(this, std::make_unique<RedisConnection>(options_.address, options_.timeout));
  std::unique_ptr<RedisConnection> connection = std::move(readers_.back());
  readers_.pop_back();
  return Borrowed(this, std::move(connection));
}

std::shared_ptr<RedisTier::SessionState> RedisTier::StateOf(const std::string& id, const std::string& tenant) {
  std::shared_ptr<SessionState>& state = sessions_[TenantSessionKey(tenant, id)];
  if (state == nullptr) {
    state = std::make_shared<SessionState>();
    state->id = id;
    state->tenant = tenant;
    state->base = absl::StrCat("turbokv:{", id, "}:", absl::BytesToHexString(tenant));
  }
  return state;
}

std::shared_ptr<RedisTier::Record> RedisTier::NewPage(const std::shared_ptr<SessionState>& state, size_t bytes) {
  const uint64_t lsn = next_lsn_++;
  std::string key = state->Key(absl::StrCat("p:", owner_, ":", lsn));
  state->pages.insert(key);
  return std::make_shared<Record>(this, lsn, bytes, state, std::move(key), true);
}

absl::StatusOr<TierScanReport> RedisTier::Scan() {
  // Sessions in Redis are claimed when a call names them, not at start:
  // they may be another daemon's.
  return TierScanReport();
}

void RedisTier::Enqueue(Job job) {
  queued_bytes_ += static_cast<int64_t>(job.bytes);
  queue_.push_back(std::move(job));
  work_.notify_one();
}

absl::StatusOr<std::shared_ptr<TierRecord>> RedisTier::PutPage(const PageKey& key, absl::string_view page, bool force) {
  std::string value(kPageMagic, sizeof(kPageMagic));
  Put<uint16_t>(&value, kVersionUnnamed);  // pages are the same in every version
  Put<uint16_t>(&value, 0);
  Put<int64_t>(&value, 0);  // the epoch, when sent
  Put<int32_t>(&value, key.layer);
  Put<int32_t>(&value, key.index);
  Put<int32_t>(&value, key.tokens);
  Put<uint8_t>(&value, static_cast<uint8_t>(key.key_codec));
  Put<uint8_t>(&value, static_cast<uint8_t>(key.value_codec));
  Put<uint16_t>(&value, 0);
  Put<uint64_t>(&value, key.rotation_seed);
  Put<uint32_t>(&value, static_cast<uint32_t>(page.size()));
  Put<uint32_t>(&value, Crc32c(page));
  value.append(page.data(), page.size());
  const size_t bytes = value.size();
  std::unique_lock<std::mutex> lock(mutex_);
  if (!force) WaitForRoom(lock, bytes);
  if (static_cast<size_t>(live_bytes_ + queued_bytes_) + bytes > options_.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Redis tier budget exceeded: ", FormatByteSize(static_cast<size_t>(live_bytes_ + queued_bytes_)),
        " in Redis or queued, ", FormatByteSize(bytes), " needed, --redis-budget ", FormatByteSize(options_.budget_bytes)));
  }
  const size_t limit = force ? 2 * options_.max_queued_bytes : options_.max_queued_bytes;
  if (queued_bytes_ > 0 && static_cast<size_t>(queued_bytes_) + bytes > limit) {
    return absl::UnavailableError(absl::StrCat("the Redis writer has ", FormatByteSize(static_cast<size_t>(queued_bytes_)),
                                               " queued", up_ ? "" : absl::StrCat(" (", down_reason_, ")")));
  }
  std::shared_ptr<SessionState> state = StateOf(key.session, key.tenant);
  std::shared_ptr<Record> record = NewPage(state, bytes);
  Job job = Job::Of(Job::kPage, state, record->key, record);
  job.value = std::move(value);
  job.layer_tails = state->Key(TailsSuffix(key.layer));
  job.index = std::to_string(key.index);
  if (key.tokens == options_.page_tokens && !key.for_manifest) {
    job.field = Field(key.layer, key.index);
    PutString(&job.entry, record->key);
    Put<uint32_t>(&job.entry, static_cast<uint32_t>(bytes));
  }
  job.bytes = bytes;
  Enqueue(std::move(job));
  return std::shared_ptr<TierRecord>(std::move(record));
}

std::shared_ptr<TierRecord> RedisTier::PutManifest(const TierSession& session) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<SessionState> state = StateOf(session.header.id, session.header.tenant);
  state->layers = std::max(state->layers, static_cast<int>(session.layers.size()));
  std::string value(kManifestMagic, sizeof(kManifestMagic));
  const bool named = !session.named.hashes.empty();
  bool holds = false;
  for (const TierLayer& layer : session.layers) {
    holds = holds || HoldsPastSinks(layer.extras, session.header.config.sink_tokens);
  }
  const uint16_t version = holds ? kVersion : named ? kVersionNamed : kVersionUnnamed;
  Put<uint16_t>(&value, version);
  Put<uint16_t>(&value, 0);
  Put<int64_t>(&value, 0);  // the epoch, when sent
  PutSessionHeader(&value, session.header);
  Put<uint8_t>(&value, session.pinned ? 1 : 0);
  Put<uint32_t>(&value, static_cast<uint32_t>(session.layers.size()));
  std::vector<std::shared_ptr<Record>> listed;
  for (const TierLayer& layer : session.layers) {
    Put<int64_t>(&value, layer.tokens);
    Put<uint32_t>(&value, static_cast<uint32_t>(layer.pages.size()));
    for (const std::shared_ptr<TierRecord>& one : layer.pages) {
      std::shared_ptr<Record> page = std::static_pointer_cast<Record>(one);
      if (page->state != state) {
        // A fork's page, in its source's keys: copied into the fork's, so
        // that the fork stands alone in Redis.
        std::shared_ptr<Record> copy = state->copies[page.get()].lock();
        if (copy == nullptr) {
          copy = NewPage(state, page->bytes());
          state->copies[page.get()] = copy;
          Job job = Job::Of(Job::kCopy, state, copy->key, copy);
          job.source = page->key;
          Enqueue(std::move(job));
        }
        page = std::move(copy);
      }
      PutString(&value, page->key);
      Put<uint32_t>(&value, static_cast<uint32_t>(page->bytes()));
      listed.push_back(std::move(page));
    }
    PutLayerExtras(&value, layer.extras);
  }
  if (version >= kVersionNamed) PutNamedBlocks(&value, session.named);
  for (auto it = state->copies.begin(); it != state->copies.end();) {
    it = it->second.expired() ? state->copies.erase(it) : std::next(it);
  }
  auto record = std::make_shared<Record>(this, next_lsn_++, value.size(), state, state->Key("m"), false);
  record->listed = std::move(listed);
  Job job = Job::Of(Job::kManifest, state, record->key, record);
  for (size_t l = 0; l < session.layers.size(); ++l) {
    // A daemon that acknowledges once queued writes no new slots: any left
    // are another owner's, superseded by this manifest.
    if (session.layers[l].whole || !options_.acknowledge_written) {
      job.tail_keys.push_back(state->Key(TailsSuffix(static_cast<int>(l))));
    }
  }
  job.value = std::move(value);
  job.bytes = job.value.size();
  Enqueue(std::move(job));
  return record;
}

void RedisTier::PutTombstone(const std::string& session, const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::shared_ptr<SessionState> state = StateOf(session, tenant);
  state->tombstoned = true;
  Enqueue(Job::Of(Job::kTombstone, std::move(state), ""));
}

void RedisTier::WaitForRoom(std::unique_lock<std::mutex>& lock, size_t bytes) {
  // A call that waits for its writes anyway waits for room in the queue
  // too, while Redis answers (a chunk larger than the queue, or many at
  // once); one that is answered once queued is refused at once instead.
  if (!options_.acknowledge_written) return;
  while (static_cast<size_t>(queued_bytes_) + bytes > options_.max_queued_bytes && queued_bytes_ > 0 && up_ &&
         !stopping_) {
    written_.wait_for(lock, absl::ToChronoMilliseconds(options_.timeout));
  }
}

absl::StatusOr<std::shared_ptr<TierRecord>> RedisTier::PutTails(const std::string& session, const std::string& tenant,
                                                                 std::vector<TailWrite> tails) {
  Job job;
  job.kind = Job::kTails;
  int layers = 0;
  for (const TailWrite& tail : tails) {
    std::string entry;
    for (int32_t field : {tail.index, tail.from, tail.to, tail.shape.heads, tail.shape.page_tokens,
                          tail.shape.key_bytes, tail.shape.value_bytes}) {
      Put<int32_t>(&entry, field);
    }
    Put<uint32_t>(&entry, Crc32c(tail.slots));
    entry.append(tail.slots);
    job.bytes += entry.size();
    job.tail_entries.push_back(std::move(entry));
    layers = std::max(layers, tail.layer + 1);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  WaitForRoom(lock, job.bytes);
  if (queued_bytes_ > 0 && static_cast<size_t>(queued_bytes_) + job.bytes > options_.max_queued_bytes) {
    return absl::UnavailableError(absl::StrCat("the Redis writer has ", FormatByteSize(static_cast<size_t>(queued_bytes_)),
                                               " queued", up_ ? "" : absl::StrCat(" (", down_reason_, ")")));
  }
  std::shared_ptr<SessionState> state = StateOf(session, tenant);
  state->layers = std::max(state->layers, layers);
  for (const TailWrite& tail : tails) job.tail_keys.push_back(state->Key(TailsSuffix(tail.layer)));
  auto record = std::make_shared<Record>(this, next_lsn_++, job.bytes, state, "", false);
  job.state = std::move(state);
  job.record = record;
  Enqueue(std::move(job));
  return std::shared_ptr<TierRecord>(std::move(record));
}

void RedisTier::Release(Record* record) {
  if (record->counted) live_bytes_ -= static_cast<int64_t>(record->bytes());
  if (record->page) record->state->pages.erase(record->key);
  // A page nobody holds any more goes from Redis, unless the daemon is
  // going away (its sessions stay for the next) or the session is another
  // daemon's now (the fence would refuse it anyway).
  if (!record->page || closed_ || !record->done || !record->status.ok() || record->state->disowned ||
      record->state->let_go) {
    return;
  }
  Enqueue(Job::Of(Job::kDelete, record->state, record->key));
}

std::string RedisTier::Disown(SessionState& state, absl::string_view epoch_now) {
  const std::string why = absl::StrCat("session ", state.id, " was claimed by another turbokvd (epoch now ", epoch_now,
                                       "); this daemon's copy (epoch ", state.epoch,
                                       ") is dropped and its writes are refused");
  if (state.disowned) return why;
  Logf(LogLevel::kWarning, "%s", why.c_str());
  state.disowned = true;
  disowned_why_[state.id] = why;
  disowned_.emplace_back(state.id, absl::FailedPreconditionError(why));
  return why;
}

void RedisTier::NoteLost(const std::shared_ptr<SessionState>& state, absl::string_view why) {
  if (state->lost || state->disowned || state->tombstoned) return;
  Logf(LogLevel::kWarning, "session %s: %s; this daemon's epoch %lld is restored and it writes the session again",
       state->id.c_str(), std::string(why).c_str(), static_cast<long long>(state->epoch));
  state->lost = true;
  lost_.push_back(state);
  ++rewrites_;
}

absl::Status RedisTier::ScriptError(SessionState& state, const RedisValue& reply) {
  // The write is sent again when Redis takes it.
  if (TransientRefusal(reply.str)) {
    return absl::UnavailableError(absl::StrCat("Redis at ", options_.address.url, " refused a write of session ",
                                               state.id, " for now: ", reply.str));
  }
  if (absl::StartsWith(reply.str, "STALE ")) {
    std::lock_guard<std::mutex> lock(mutex_);
    return absl::FailedPreconditionError(Disown(state, absl::string_view(reply.str).substr(6)));
  }
  return absl::InternalError(absl::StrCat("Redis refused a write of session ", state.id, ": ", reply.str));
}

absl::Status RedisTier::Execute(Job& job, const Record* record) {
  SessionState& state = *job.state;
  int64_t epoch;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state.disowned) return absl::FailedPreconditionError(disowned_why_[state.id]);
    if (!refusal_.empty()) return absl::UnavailableError(refusal_);
    epoch = state.epoch;
    if (epoch == 0 && (job.kind == Job::kTombstone || job.kind == Job::kDelete)) return absl::OkStatus();  // nothing sent yet
    if (job.kind == Job::kManifest) {
      // The pages it lists were sent before it; one that failed fails it.
      for (const std::shared_ptr<Record>& page : record->listed) {
        if (!page->status.ok()) return page->status;
      }
    }
  }
  if (epoch == 0) {
    // A new session: its first record claims it.
    absl::StatusOr<RedisValue> claimed = writer_connection_.Run(
        {"EVAL", kAcquire, "3", state.Key("l"), state.Key("e"), state.Key("m"), owner_,
         std::to_string(absl::ToInt64Milliseconds(options_.lease)), "0", OrphanTtlMs(), ""});
    if (!claimed.ok()) return claimed.status();
    if (claimed->type == RedisValue::kError) return ScriptError(state, *claimed);
    if (claimed->type != RedisValue::kArray || claimed->elements.empty() ||
        claimed->elements[0].type != RedisValue::kInteger || claimed->elements[0].integer <= 0) {
      return absl::InternalError(absl::StrCat("session ", state.id, " is already in Redis under another daemon"));
    }
    epoch = claimed->elements[0].integer;
    std::lock_guard<std::mutex> lock(mutex_);
    state.epoch = epoch;
    state.confirmed = absl::Now();
  }
  const std::string e = std::to_string(epoch);
  const std::string ttl = OrphanTtlMs();
  std::vector<std::string> command;
  switch (job.kind) {
    case Job::kPage:
      PatchEpoch(&job.value, epoch);
      command = {"EVAL", kWritePage, "4", state.Key("e"), job.key,   state.Key("h"), job.layer_tails,
                 e,      job.value,  job.field, job.entry, ttl,            job.index};
      break;
    case Job::kManifest:
      PatchEpoch(&job.value, epoch);
      command = {"EVAL", kWriteManifest, std::to_string(3 + job.tail_keys.size()), state.Key("e"), job.key,
                 state.Key("h")};
      command.insert(command.end(), job.tail_keys.begin(), job.tail_keys.end());
      command.insert(command.end(), {e, job.value, ttl});
      break;
    case Job::kCopy: {
      absl::StatusOr<RedisValue> source = writer_connection_.Run({"GET", job.source});
      if (!source.ok()) return source.status();
      if (source->type == RedisValue::kError) return ScriptError(state, *source);
      if (source->type != RedisValue::kString) {
        return absl::DataLossError(absl::StrCat("page ", job.source, " of a fork's source is not in Redis any more"));
      }
      command = {"EVAL", kCopy, "2", state.Key("e"), job.key, e, source->str, ttl};
      break;
    }
    case Job::kDelete:
      command = {"EVAL", kDelete, "2", state.Key("e"), job.key, e};
      break;
    case Job::kTombstone: {
      int layers;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        layers = state.layers;
      }
      command = {"EVAL", kTombstone, std::to_string(4 + layers), state.Key("e"), state.Key("l"), state.Key("m"),
                 state.Key("h")};
      for (int l = 0; l < layers; ++l) command.push_back(state.Key(TailsSuffix(l)));
      command.insert(command.end(), {e, std::to_string(kTombstoneEpochMs)});
      break;
    }
    case Job::kTails:
      command = TailsCommand(job, e, ttl);
      break;
  }
  absl::StatusOr<RedisValue> reply = writer_connection_.Run(command);
  if (!reply.ok()) return reply.status();
  if (reply->type == RedisValue::kError && absl::StartsWith(reply->str, "LOST ") && job.kind == Job::kDelete) {
    return absl::OkStatus();  // nothing left to delete
  }
  if (reply->type == RedisValue::kError && absl::StartsWith(reply->str, "LOST ")) {
    // Redis lost the session's epoch (and with it, most likely, its
    // records): the epoch is restored with the lease, the store writes the
    // session again, and this write goes as if nothing happened.
    std::vector<std::string> renew;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      renew = RenewCommand(state);
    }
    const absl::Time sent = absl::Now();
    absl::StatusOr<RedisValue> restored = writer_connection_.Run(std::move(renew));
    if (!restored.ok()) return restored.status();
    if (restored->type == RedisValue::kError) return ScriptError(state, *restored);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state.confirmed = sent;
      // A tombstone goes as it is: the session is being deleted, not kept.
      if (job.kind != Job::kTombstone) {
        NoteLost(job.state, absl::StrCat("Redis lost its epoch (", absl::string_view(reply->str).substr(5), ")"));
      }
    }
    reply = writer_connection_.Run(command);
    if (!reply.ok()) return reply.status();
  }
  if (reply->type == RedisValue::kError) return ScriptError(state, *reply);
  return absl::OkStatus();
}

std::vector<std::string> RedisTier::TailsCommand(const Job& job, const std::string& epoch, const std::string& ttl) {
  std::vector<std::string> command = {"EVAL", kWriteTails, std::to_string(1 + job.tail_keys.size()),
                                      job.state->Key("e")};
  command.insert(command.end(), job.tail_keys.begin(), job.tail_keys.end());
  command.push_back(epoch);
  command.insert(command.end(), job.tail_entries.begin(), job.tail_entries.end());
  command.push_back(ttl);
  return command;
}

size_t RedisTier::SendTails(std::unique_lock<std::mutex>& lock) {
  // The new slots of calls waiting for them, of sessions claimed already:
  // the run of them at the front of the queue, in one round trip.
  constexpr size_t kMostJobs = 64;
  constexpr size_t kMostBytes = size_t{4} << 20;
  if (!up_ || !refusal_.empty()) return 0;
  std::vector<std::shared_ptr<Record>> records;
  std::vector<std::vector<std::string>> commands;
  const std::string ttl = OrphanTtlMs();
  size_t bytes = 0;
  std::shared_ptr<Record> after;  // the first job not in the batch's record: released unlocked too
  for (size_t i = 0; i < queue_.size() && records.size() < kMostJobs && bytes < kMostBytes; ++i) {
    const Job& job = queue_[i];
    std::shared_ptr<Record> record = job.record.lock();
    if (job.kind != Job::kTails || record == nullptr || job.state->epoch == 0 || job.state->disowned) {
      after = std::move(record);
      break;
    }
    commands.push_back(TailsCommand(job, std::to_string(job.state->epoch), ttl));
    records.push_back(std::move(record));
    bytes += job.bytes;
  }
  if (records.size() < 2) {
    lock.unlock();
    records.clear();  // a release takes the mutex
    after.reset();
    lock.lock();
    return 0;
  }
  lock.unlock();
  after.reset();
  absl::StatusOr<std::vector<RedisValue>> replies = writer_connection_.Run(commands);
  lock.lock();
  size_t sent = 0;
  if (!replies.ok()) {
    // The one-at-a-time path sends them again once Redis answers.
    up_ = false;
    down_reason_ = std::string(replies.status().message());
    written_.notify_all();
  } else {
    // Up to the first that Redis did not take plainly (a stale or lost
    // epoch, a refusal): that one and those after it go one at a time (an
    // entry written twice is harmless, docs/FORMAT.md).
    for (; sent < records.size() && (*replies)[sent].type == RedisValue::kInteger; ++sent) {
      records[sent]->done = true;
      ++records_written_;
      queued_bytes_ -= static_cast<int64_t>(queue_.front().bytes);
      queue_.pop_front();
    }
    written_.notify_all();
  }
  lock.unlock();
  records.clear();
  lock.lock();
  return sent;
}

void RedisTier::Renew() {
  std::vector<std::shared_ptr<SessionState>> held;
  std::vector<std::vector<std::string>> commands;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!released_) {
      for (const auto& [name, state] : sessions_) {
        if (state->epoch > 0 && !state->disowned && !state->tombstoned) held.push_back(state);
      }
    }
    for (const std::shared_ptr<SessionState>& state : held) commands.push_back(RenewCommand(*state));
  }
  const absl::Time sent = absl::Now();
  std::string silent;
  const absl::StatusOr<std::vector<RedisFacts>> facts = GatherFacts(writer_connection_, options_.address, &silent);
  absl::StatusOr<std::vector<RedisValue>> replies =
      absl::IsUnavailable(facts.status()) ? facts.status() : writer_connection_.Run(commands);
  std::lock_guard<std::mutex> lock(mutex_);
  silent_ = replies.ok() ? silent : std::string(replies.status().message());
  if (!replies.ok()) {
    if (up_) Logf(LogLevel::kWarning, "Redis tier unreachable: %s", silent_.c_str());
    up_ = false;
    down_reason_ = silent_;
    written_.notify_all();
    return;
  }
  const std::string refusal = facts.ok() ? EvictionRefusal(*facts) : std::string(facts.status().message());
  if (refusal != refusal_) {
    if (!refusal.empty()) Logf(LogLevel::kError, "%s; writes wait in the queue", refusal.c_str());
    refusal_ = refusal;
  }
  if (!refusal_.empty()) {
    up_ = false;
    down_reason_ = refusal_;
    written_.notify_all();
  } else if (!silent.empty()) {
    // The renewals of the other masters' sessions went; the tier is down
    // until every master answers.
    if (up_) Logf(LogLevel::kWarning, "Redis tier unreachable: %s", silent.c_str());
    up_ = false;
    down_reason_ = silent;
    written_.notify_all();
  } else {
    if (!up_) Logf(LogLevel::kInfo, "Redis tier reachable again");
    up_ = true;
  }
  if (facts.ok()) {
    // Another Redis process (a restart; a cluster's replica promoted, or a
    // master new to the map): whatever it lost since its last append-only
    // write or snapshot, the sessions held in memory that it serves are
    // written again.
    std::vector<std::string> restarted;
    const bool first = run_ids_.empty();  // Redis did not answer at start
    for (const RedisFacts& node : *facts) {
      std::string& known = run_ids_[node.node];
      if (known == node.run_id) continue;
      if (!first) restarted.push_back(node.node);
      known = node.run_id;
    }
    if (!restarted.empty()) {
      for (const std::shared_ptr<SessionState>& state : held) {
        const std::string serves = writer_connection_.NodeOf(state->Key("e"));
        if (std::find(restarted.begin(), restarted.end(), serves) != restarted.end()) {
          NoteLost(state, "Redis restarted");
        }
      }
      WarnWithoutPersistence(*facts);
    }
  }
  for (size_t i = 0; i < held.size(); ++i) {
    const RedisValue& reply = (*replies)[i];
    if (reply.type == RedisValue::kError && absl::StartsWith(reply.str, "STALE ")) {
      Disown(*held[i], absl::string_view(reply.str).substr(6));
      continue;
    }
    if (reply.type != RedisValue::kInteger) continue;
    held[i]->confirmed = sent;
    if (reply.integer == 2) NoteLost(held[i], "Redis lost its epoch");
  }
}

std::string RedisTier::OrphanTtlMs() const { return std::to_string(absl::ToInt64Milliseconds(options_.orphan_ttl)); }

std::vector<std::string> RedisTier::RenewCommand(const SessionState& state) const {
  // A daemon that went longer than the orphan TTL without Redis confirming
  // its epoch may find it expired, or the session deleted since: it does
  // not bring it back.
  const bool may_restore = absl::Now() - state.confirmed < options_.orphan_ttl;
  return {"EVAL", kRenew, "2", state.Key("l"), state.Key("e"), state.LeaseValue(owner_),
          std::to_string(absl::ToInt64Milliseconds(options_.lease)), std::to_string(state.epoch),
          may_restore ? "1" : "0", OrphanTtlMs()};
}

bool RedisTier::Refresh() {
  std::vector<std::vector<std::string>> commands;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (released_) return true;
    const std::string ttl = OrphanTtlMs();
    for (const auto& [name, state] : sessions_) {
      if (state->epoch == 0 || state->disowned || state->tombstoned) continue;
      for (const char* suffix : {"e", "m", "h"}) commands.push_back({"PEXPIRE", state->Key(suffix), ttl});
      for (int l = 0; l < state->layers; ++l) commands.push_back({"PEXPIRE", state->Key(TailsSuffix(l)), ttl});
      for (const std::string& key : state->pages) commands.push_back({"PEXPIRE", key, ttl});
    }
  }
  constexpr size_t kBatch = 1024;
  bool refreshed = true;
  for (size_t at = 0; at < commands.size(); at += kBatch) {
    const std::vector<std::vector<std::string>> batch(commands.begin() + static_cast<std::ptrdiff_t>(at),
                                                      commands.begin() + static_cast<std::ptrdiff_t>(
                                                                             std::min(commands.size(), at + kBatch)));
    absl::StatusOr<std::vector<RedisValue>> replies = writer_connection_.Run(batch);
    if (!replies.ok()) {
      Logf(LogLevel::kWarning, "Redis tier: the expiry (--redis-orphan-ttl) of %zu keys was not refreshed: %s",
           std::min(kBatch, commands.size() - at), std::string(replies.status().message()).c_str());
      refreshed = false;  // the other batches go all the same
    }
  }
  return refreshed;
}

void RedisTier::WriterLoop() {
  const absl::Duration renew_every = options_.lease / 3;
  absl::Time next_renew = absl::Now() + renew_every;
  const absl::Duration refresh_every = options_.orphan_ttl / 4;
  absl::Time next_refresh = absl::Now() + refresh_every;
  absl::Duration backoff = absl::Milliseconds(50);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (stopping_ && (queue_.empty() || !up_)) return;
    if (absl::Now() >= next_renew || probe_) {
      probe_ = false;
      lock.unlock();
      Renew();
      lock.lock();
      // While Redis is down, its return is noticed within the backoff.
      if (up_) {
        backoff = absl::Milliseconds(50);
        next_renew = absl::Now() + renew_every;
      } else {
        next_renew = absl::Now() + std::min(renew_every, backoff);
        backoff = std::min(backoff * 2, absl::Seconds(1));
      }
      continue;
    }
    if (absl::Now() >= next_refresh) {
      // Also while Redis is refused for its eviction policy; a refresh that
      // fails is tried again soon, never a quarter TTL later.
      lock.unlock();
      const bool refreshed = Refresh();
      lock.lock();
      next_refresh = absl::Now() + (refreshed ? refresh_every : std::min(refresh_every, absl::Seconds(5)));
      continue;
    }
    if (queue_.empty()) {
      work_.wait_until(lock, absl::ToChronoTime(std::min(next_renew, next_refresh)),
                       [this] { return stopping_ || probe_ || !queue_.empty(); });
      continue;
    }
    if (SendTails(lock) > 0) continue;
    Job& job = queue_.front();  // only this thread pops: stays put while unlocked
    std::shared_ptr<Record> record = job.record.lock();
    absl::Status status;
    const bool wanted = record != nullptr || job.kind == Job::kDelete || job.kind == Job::kTombstone;
    if (wanted) {
      lock.unlock();
      status = Execute(job, record.get());
      lock.lock();
    }
    if (absl::IsUnavailable(status)) {
      if (up_) {
        Logf(LogLevel::kWarning, "Redis tier unreachable: %s; %s of writes wait in the queue",
             std::string(status.message()).c_str(), FormatByteSize(static_cast<size_t>(queued_bytes_)).c_str());
      }
      up_ = false;
      down_reason_ = std::string(status.message());
      written_.notify_all();
      work_.wait_for(lock, absl::ToChronoMilliseconds(backoff), [this] { return stopping_; });
      backoff = std::min(backoff * 2, absl::Seconds(1));
      lock.unlock();
      record.reset();  // its release takes the mutex
      lock.lock();
      continue;
    }
    // A write that went does not bring back a tier that did not answer the
    // last renewal (a cluster's other master, not yet failed over): that
    // renewal's view stands until the next one.
    if (!up_ && wanted && silent_.empty()) {
      Logf(LogLevel::kInfo, "Redis tier reachable again; sending the %s queued",
           FormatByteSize(static_cast<size_t>(queued_bytes_)).c_str());
    }
    if (wanted) {
      up_ = silent_.empty();
      backoff = absl::Milliseconds(50);
      // A write refused because another daemon claimed the session is the
      // fencing at work, not a failing tier.
      if (status.ok()) {
        ++records_written_;
      } else if (!absl::IsFailedPrecondition(status)) {
        ++write_errors_;
        Logf(LogLevel::kError, "Redis tier: %s", std::string(status.message()).c_str());
      }
    }
    if (record != nullptr) {
      record->done = true;
      record->status = status;
      if (status.ok() && record->page) {
        record->counted = true;
        live_bytes_ += static_cast<int64_t>(record->bytes());
      }
    }
    if (job.kind == Job::kTombstone && status.ok()) {
      auto it = sessions_.find(TenantSessionKey(job.state->tenant, job.state->id));
      if (it != sessions_.end() && it->second == job.state) sessions_.erase(it);
    }
    queued_bytes_ -= static_cast<int64_t>(job.bytes);
    queue_.pop_front();
    written_.notify_all();
    lock.unlock();
    record.reset();
    lock.lock();
  }
}

absl::Status RedisTier::Wait(const TierRecord& record) {
  const auto& r = static_cast<const Record&>(record);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!r.done) {
    if (!up_) {
      return absl::UnavailableError(down_reason_);
    }
    written_.wait_for(lock, absl::ToChronoMilliseconds(options_.timeout));
  }
  return r.status;
}

absl::Status RedisTier::Sync() {
  // Redis persists by its own configuration (appendonly): here, until the
  // queue is sent.
  std::unique_lock<std::mutex> lock(mutex_);
  while (!queue_.empty()) {
    if (!up_) {
      return absl::UnavailableError(absl::StrCat(down_reason_, "; ", FormatByteSize(static_cast<size_t>(queued_bytes_)),
                                                 " not sent"));
    }
    written_.wait_for(lock, absl::ToChronoMilliseconds(options_.timeout));
  }
  return absl::OkStatus();
}

std::string RedisTier::MarkDown(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  up_ = false;
  down_reason_ = std::string(why.message());
  probe_ = true;  // the writer finds out when Redis is back
  work_.notify_one();
  return down_reason_;
}

absl::StatusOr<RedisValue> RedisTier::Fetch(const Record& record) {
  std::unique_lock<std::mutex> lock(reads_mutex_);
  auto it = ahead_.find(&record);
  if (it == ahead_.end()) {
    lock.unlock();
    absl::StatusOr<RedisValue> reply = Borrow()->Run({"GET", record.key});
    if (!reply.ok()) return absl::UnavailableError(MarkDown(reply.status()));
    return reply;
  }
  if (it->second.stage == Ahead::kNamed) {
    // This page and the next ones named by WillRead that nobody fetches
    // yet, in one round trip; another thread's wait for one of them ends
    // when they are here.
    std::vector<const Record*> batch;
    std::vector<std::vector<std::string>> gets;
    for (const Record* r = &record; r != nullptr && batch.size() < kReadBatch;) {
      Ahead& ahead = ahead_.at(r);
      ahead.stage = Ahead::kFetching;
      batch.push_back(r);
      gets.push_back({"GET", r->key});
      auto next = ahead_.find(ahead.next);
      r = next != ahead_.end() && next->second.stage == Ahead::kNamed ? ahead.next : nullptr;
    }
    lock.unlock();
    absl::StatusOr<std::vector<RedisValue>> replies = Borrow()->Run(gets);
    const absl::Status failed =
        replies.ok() ? absl::OkStatus() : absl::UnavailableError(MarkDown(replies.status()));
    lock.lock();
    for (size_t i = 0; i < batch.size(); ++i) {
      Ahead& ahead = ahead_.at(batch[i]);
      ahead.stage = Ahead::kHere;
      ahead.value = failed.ok() ? absl::StatusOr<RedisValue>(std::move((*replies)[i])) : failed;
    }
    fetched_.notify_all();
  }
  fetched_.wait(lock, [&] { return ahead_.at(&record).stage == Ahead::kHere; });
  auto here = ahead_.find(&record);
  absl::StatusOr<RedisValue> value = std::move(here->second.value);
  ahead_.erase(here);
  return value;
}

absl::Status RedisTier::Read(const TierRecord& record, uint8_t* out, size_t bytes) {
  const auto& r = static_cast<const Record&>(record);
  if (!r.payload.empty()) {
    if (r.payload.size() != bytes) {
      return absl::DataLossError(absl::StrCat("the tail of session ", r.state->id, " rebuilt from Redis holds ",
                                              r.payload.size(), " bytes, not the ", bytes, " of its page"));
    }
    std::memcpy(out, r.payload.data(), bytes);
    return absl::OkStatus();
  }
  {
    // Known down: a promotion fails at once rather than a timeout per page.
    std::lock_guard<std::mutex> lock(mutex_);
    if (!up_) return absl::UnavailableError(down_reason_);
  }
  absl::StatusOr<RedisValue> reply = Fetch(r);
  if (!reply.ok()) return reply.status();
  auto damaged = [&](absl::string_view why) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++crc_failures_;
    return absl::DataLossError(absl::StrCat("page ", r.key, " in Redis ", why));
  };
  if (reply->type != RedisValue::kString) return damaged("is missing");
  if (std::string why = PageProblem(reply->str, bytes); !why.empty()) return damaged(why);
  std::memcpy(out, reply->str.data() + kPageHeaderBytes, bytes);
  return absl::OkStatus();
}

void RedisTier::WillRead(const std::vector<std::shared_ptr<TierRecord>>& records) {
  // Each layer's pages are read in order (by one thread per layer): a read
  // brings the pages after it along. Pages of one session follow each other
  // in `records`, layer after layer.
  std::lock_guard<std::mutex> lock(reads_mutex_);
  for (size_t i = 0; i < records.size(); ++i) {
    const auto* r = static_cast<const Record*>(records[i].get());
    const auto* next = i + 1 < records.size() ? static_cast<const Record*>(records[i + 1].get()) : nullptr;
    Ahead& ahead = ahead_[r];
    ahead = Ahead();
    ahead.next = next != nullptr && next->state == r->state ? next : nullptr;
  }
}

void RedisTier::Forget(const Record* record) {
  std::lock_guard<std::mutex> lock(reads_mutex_);
  ahead_.erase(record);
}

void RedisTier::Close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
}

TierStats RedisTier::Stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TierStats stats;
  stats.bytes = live_bytes_;
  stats.live_bytes = live_bytes_;
  stats.budget_bytes = static_cast<int64_t>(options_.budget_bytes);
  stats.queued_bytes = queued_bytes_;
  stats.records_written = records_written_;
  stats.write_errors = write_errors_;
  stats.crc_failures = crc_failures_;
  stats.rewrites = rewrites_;
  return stats;
}

namespace {

absl::Status ClaimUnavailable(const std::string& id, absl::string_view why) {
  return absl::UnavailableError(absl::StrCat("session ", ShowId(id), " is not in this daemon and taking it over needs ", why));
}

}  // namespace

// What a claim read of a session in Redis, worked out step by step before
// any record is made of it (so that a damaged session leaves nothing).
struct RedisTier::ClaimRead {
  int64_t epoch = 0;          // the one the claim raised the session to
  bool has_manifest = false;  // Redis returned one
  std::string manifest;       // its bytes
  // Sealed pages written since the manifest, by layer and index: key, bytes.
  std::map<std::pair<int, int>, std::pair<std::string, uint32_t>> sealed;
  TierSession session;  // its header, pinned and named blocks
  // Per layer: its pages (key, bytes) in order, its length and extras,
  // whether the manifest's tail is the last of its pages, and then whether
  // new slots changed that last page (rebuilt) and the page they made
  // (empty when the layer was cut back to a page's start).
  std::vector<std::vector<std::pair<std::string, uint32_t>>> pages;
  std::vector<int64_t> lengths;
  std::vector<LayerExtras> extras;
  std::vector<bool> has_tail;
  std::vector<bool> rebuilt;
  std::vector<std::string> tails;
  std::vector<std::string> superseded;  // tails a page sealed since holds: their keys go
};

absl::StatusOr<TierSession> RedisTier::Claim(const std::string& id, const std::string& tenant, int64_t if_epoch) {
  if (!PlausibleSessionId(id)) return absl::NotFoundError("not a session id");
  std::shared_ptr<SessionState> state = std::make_shared<SessionState>();
  state->id = id;
  state->tenant = tenant;
  state->base = absl::StrCat("turbokv:{", id, "}:", absl::BytesToHexString(tenant));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(TenantSessionKey(tenant, id));
    if (it != sessions_.end() && it->second->tombstoned) return absl::NotFoundError("deleted");
    // Known down: no call waits for Redis's timeout again until it answers.
    if (!up_) return ClaimUnavailable(id, down_reason_);
  }
  const absl::Time sent = absl::Now();
  Borrowed connection = Borrow();
  ClaimRead read;
  if (absl::Status acquired = AcquireForClaim(*state, if_epoch, *connection.connection, &read); !acquired.ok()) {
    return acquired;
  }
  state->epoch = read.epoch;
  // A claim that fails from here on raised the epoch: its lease is let go
  // and the error says to what epoch (ClaimedEpoch), so that a copy written
  // under the old one knows that nobody else claimed the session since.
  absl::Status status = ReadManifest(id, tenant, &read);
  if (status.ok()) status = CheckClaimedPages(*state, *connection.connection, &read);
  if (!status.ok()) {
    connection->Run({"EVAL", kRelease, "1", state->Key("l"), state->LeaseValue(owner_)}).IgnoreError();
    return WithClaimedEpoch(std::move(status), read.epoch);
  }
  return RegisterClaimed(std::move(state), std::move(read), sent);
}

absl::Status RedisTier::AcquireForClaim(const SessionState& state, int64_t if_epoch, RedisConnection& connection,
                                        ClaimRead* read) {
  const std::string& id = state.id;
  const std::vector<std::vector<std::string>> commands = {
      {"EVAL", kAcquire, "3", state.Key("l"), state.Key("e"), state.Key("m"), owner_,
       std::to_string(absl::ToInt64Milliseconds(options_.lease)), "1", OrphanTtlMs(),
       if_epoch > 0 ? std::to_string(if_epoch) : ""},
      {"HGETALL", state.Key("h")}};
  absl::StatusOr<std::vector<RedisValue>> replies = connection.Run(commands);
  if (!replies.ok()) return ClaimUnavailable(id, MarkDown(replies.status()));
  const RedisValue& acquired = (*replies)[0];
  if (acquired.type == RedisValue::kError && TransientRefusal(acquired.str)) {
    return ClaimUnavailable(id, absl::StrCat("Redis, which refused it for now: ", acquired.str));
  }
  if (acquired.type != RedisValue::kArray || acquired.elements.empty() ||
      acquired.elements[0].type != RedisValue::kInteger) {
    return absl::InternalError(absl::StrCat("Redis answered the claim of session ", id, " with ",
                                            acquired.type == RedisValue::kError ? acquired.str : "something else"));
  }
  const long long epoch = acquired.elements[0].integer;
  if (epoch == 0) return absl::NotFoundError("not in Redis");
  if (epoch == -3) {
    const std::string now = acquired.elements.size() > 1 ? acquired.elements[1].str : "";
    if (now == "none") {
      return absl::AbortedError(absl::StrCat("session ", id, " in Redis has lost its epoch (", if_epoch,
                                             " when this copy was written): whether another daemon claimed it "
                                             "since cannot be told"));
    }
    return absl::AbortedError(absl::StrCat("session ", id, " was claimed by another turbokvd since (its epoch in Redis is ",
                                           now, ", not ", if_epoch, ")"));
  }
  if (epoch == -2) {
    return absl::DataLossError(absl::StrCat(
        "session ", id, " in Redis has a manifest but no epoch: Redis lost data (evicted, deleted, or restarted "
        "without its append-only file), so whether another daemon holds it cannot be told; it is not taken over "
        "(its owner, if it is alive, restores the epoch within its lease)"));
  }
  if (epoch < 0) {
    const std::string holder = acquired.elements.size() > 1 ? acquired.elements[1].str : "";
    const long long left = acquired.elements.size() > 2 ? acquired.elements[2].integer : 0;
    return absl::FailedPreconditionError(absl::StrCat("session ", id, " is held by turbokvd ", holder,
                                                      " (owner and epoch); its lease lapses in ", left,
                                                      " ms unless that daemon renews it"));
  }
  read->epoch = epoch;
  if (acquired.elements.size() >= 2 && acquired.elements[1].type == RedisValue::kString) {
    read->has_manifest = true;
    read->manifest = acquired.elements[1].str;
  }
  const RedisValue& hash = (*replies)[1];
  for (size_t i = 0; i + 1 < hash.elements.size(); i += 2) {
    std::pair<std::string, std::string> field = absl::StrSplit(hash.elements[i].str, absl::MaxSplits(':', 1));
    int layer = 0, index = 0;
    if (!absl::SimpleAtoi(field.first, &layer) || !absl::SimpleAtoi(field.second, &index)) continue;
    Reader entry(hash.elements[i + 1].str);
    std::string key = entry.GetString();
    const uint32_t bytes = entry.Get<uint32_t>();
    if (!entry.short_read()) read->sealed[{layer, index}] = {std::move(key), bytes};
  }
  return absl::OkStatus();
}

absl::Status RedisTier::ReadManifest(const std::string& id, const std::string& tenant, ClaimRead* read) const {
  const std::string& manifest = read->manifest;
  if (!read->has_manifest) return absl::InternalError("Redis returned no manifest");
  auto damaged = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("session ", id, " in Redis: its manifest ", why));
  };
  if (manifest.size() < 16 || std::memcmp(manifest.data(), kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return damaged("is not a turbokv manifest");
  }
  Reader in(manifest);
  in.Take(sizeof(kManifestMagic));
  const uint16_t version = in.Get<uint16_t>();
  if (version < kOldestVersion || version > kVersion) {
    return damaged(absl::StrCat("is of format version ", version, "; this turbokvd reads ", kOldestVersion, " to ",
                                kVersion));
  }
  in.Get<uint16_t>();
  in.Get<int64_t>();
  absl::StatusOr<SessionHeader> header = GetSessionHeader(in, options_.page_tokens, "the Redis manifest",
                                                          version >= 2 ? kHeaderStorage : kHeaderLayerCodecs);
  if (!header.ok()) return header.status();
  if (header->id != id || header->tenant != tenant) return damaged("names another session");
  TierSession& session = read->session;
  session.header = *std::move(header);
  session.pinned = in.Get<uint8_t>() != 0;
  const uint32_t layers = in.Get<uint32_t>();
  if (in.short_read() || static_cast<int>(layers) != session.header.config.layers) return damaged("is cut short");
  // Each layer's pages (key, bytes), and tails that a page sealed since
  // holds: read in full before any record is made.
  const int64_t pt = options_.page_tokens;
  read->pages.assign(layers, {});
  read->lengths.assign(layers, 0);
  read->extras.assign(layers, LayerExtras());
  read->has_tail.assign(layers, false);
  for (uint32_t l = 0; l < layers; ++l) {
    const int64_t tokens = in.Get<int64_t>();
    const uint32_t count = in.Get<uint32_t>();
    const int64_t full = tokens / pt;
    if (in.short_read() || tokens < 0 || count != static_cast<uint32_t>(full + (tokens % pt != 0 ? 1 : 0))) {
      return damaged(absl::StrCat("lists the pages of layer ", l, " wrongly"));
    }
    std::pair<std::string, uint32_t> tail;
    for (uint32_t i = 0; i < count; ++i) {
      std::string key = in.GetString();
      const uint32_t bytes = in.Get<uint32_t>();
      if (static_cast<int64_t>(i) < full) {
        read->pages[l].emplace_back(std::move(key), bytes);
      } else {
        tail = {std::move(key), bytes};
      }
    }
    if (version >= 2 && !GetLayerExtras(in, "the Redis manifest", &read->extras[l]).ok()) {
      return damaged(absl::StrCat("holds a malformed transform or sinks of layer ", l));
    }
    // Then the pages sealed after the manifest, in order; the first of them
    // holds the tail.
    int64_t next = full;
    for (auto it = read->sealed.find({static_cast<int>(l), static_cast<int>(next)}); it != read->sealed.end();
         it = read->sealed.find({static_cast<int>(l), static_cast<int>(++next)})) {
      read->pages[l].push_back(it->second);
    }
    if (auto after = read->sealed.lower_bound({static_cast<int>(l), static_cast<int>(next)});
        after != read->sealed.end() && after->first.first == static_cast<int>(l)) {
      return absl::DataLossError(absl::StrCat(
          "session ", id, " in Redis: page ", after->first.second, " of layer ", l, " is there but page ", next,
          " before it is not; Redis lost records (evicted, deleted, or restarted without its append-only file)"));
    }
    read->lengths[l] = next * pt;
    if (next == full && !tail.first.empty()) {
      read->pages[l].push_back(std::move(tail));
      read->lengths[l] = tokens;
      read->has_tail[l] = true;
    } else if (!tail.first.empty()) {
      read->superseded.push_back(std::move(tail.first));
    }
  }
  if (version >= kVersionNamed && !GetNamedBlocks(in, "the Redis manifest", &session.named).ok()) {
    return damaged("holds malformed named blocks");
  }
  if (in.short_read()) return damaged("is cut short");
  return absl::OkStatus();
}

absl::Status RedisTier::CheckClaimedPages(const SessionState& state, RedisConnection& connection, ClaimRead* read) {
  const std::string& id = state.id;
  const size_t layers = read->pages.size();
  const int64_t pt = options_.page_tokens;
  // Every page the session is said to have is there (PEXPIRE answers 0 for
  // a key that is not): a claim that would come back with fewer tokens than
  // were written is DATA_LOSS instead. Its keys' expiry starts again.
  const std::string ttl = OrphanTtlMs();
  std::vector<std::vector<std::string>> exists = {{"PEXPIRE", state.Key("m"), ttl}, {"PEXPIRE", state.Key("h"), ttl}};
  const size_t own = exists.size();
  for (const auto& layer : read->pages) {
    for (const auto& page : layer) exists.push_back({"PEXPIRE", page.first, ttl});
  }
  const size_t listed = exists.size();
  // And each layer's new slots since, with the tail they go on.
  for (size_t l = 0; l < layers; ++l) {
    exists.push_back({"GET", state.Key(TailsSuffix(static_cast<int>(l)))});
    exists.push_back({"PEXPIRE", state.Key(TailsSuffix(static_cast<int>(l))), ttl});
    if (read->has_tail[l]) exists.push_back({"GET", read->pages[l].back().first});
  }
  read->rebuilt.assign(layers, false);
  read->tails.assign(layers, "");
  absl::StatusOr<std::vector<RedisValue>> there = connection.Run(exists);
  if (!there.ok()) return ClaimUnavailable(id, MarkDown(there.status()));
  size_t missing = 0;
  std::string first;
  for (size_t i = own; i < listed; ++i) {
    if ((*there)[i].type == RedisValue::kInteger && (*there)[i].integer == 1) continue;
    if (missing++ == 0) first = exists[i][1];
  }
  if (missing > 0) {
    return absl::DataLossError(absl::StrCat(
        "session ", id, " in Redis: ", missing, " of its ", listed - own, " pages are missing (", first,
        " first); Redis lost records (evicted, deleted, or restarted without its append-only file)"));
  }
  size_t at = listed;
  for (size_t l = 0; l < layers; ++l) {
    const RedisValue& log = (*there)[at];
    at += 2;
    std::string page;
    const int32_t index = static_cast<int32_t>(read->lengths[l] / pt);
    int32_t slots = static_cast<int32_t>(read->lengths[l] - index * pt);
    if (read->has_tail[l]) {
      const RedisValue& value = (*there)[at++];
      if (log.type != RedisValue::kString || log.str.empty()) continue;
      // A damaged tail with new slots to replay on it: the layer cannot
      // be rebuilt (left as listed, a copy of the tail elsewhere, on a
      // stacked daemon's disk, would serve it without them).
      if (value.type != RedisValue::kString ||
          !PageProblem(value.str, read->pages[l].back().second - kPageHeaderBytes).empty()) {
        return absl::DataLossError(absl::StrCat(
            "session ", id, " in Redis: the last page of layer ", l, " (", read->pages[l].back().first,
            ") is missing or damaged, and new slots were written on it; Redis lost records (evicted, deleted, or "
            "restarted without its append-only file)"));
      }
      page = value.str.substr(kPageHeaderBytes);
    }
    if (log.type != RedisValue::kString || log.str.empty()) continue;
    bool changed = false;
    if (absl::Status replayed = ReplayTails(log.str, index, static_cast<int32_t>(pt), read->session.header.config,
                                            &page, &slots, &changed);
        !replayed.ok()) {
      return absl::DataLossError(
          absl::StrCat("session ", id, " in Redis: the new slots of layer ", l, " ", replayed.message()));
    }
    if (!changed) continue;
    read->lengths[l] = index * pt + slots;
    read->rebuilt[l] = true;
    if (slots > 0) read->tails[l] = std::move(page);
  }
  return absl::OkStatus();
}

TierSession RedisTier::RegisterClaimed(std::shared_ptr<SessionState> state, ClaimRead read, absl::Time sent) {
  std::lock_guard<std::mutex> lock(mutex_);
  state->confirmed = sent;
  auto record = [&](std::string key, size_t bytes, bool page) {
    if (page) state->pages.insert(key);
    auto r = std::make_shared<Record>(this, next_lsn_++, bytes, state, std::move(key), page);
    r->done = true;
    if (page) {
      r->counted = true;
      live_bytes_ += static_cast<int64_t>(bytes);
    }
    return r;
  };
  TierSession session = std::move(read.session);
  const size_t layers = read.pages.size();
  // The manifest keeps what it lists (the tail, once the pages are in memory).
  auto claimed = record(state->Key("m"), read.manifest.size(), false);
  for (size_t l = 0; l < layers; ++l) {
    TierLayer layer;
    layer.tokens = read.lengths[l];
    layer.extras = std::move(read.extras[l]);
    for (auto& [key, bytes] : read.pages[l]) {
      layer.pages.push_back(record(std::move(key), bytes, true));
      claimed->listed.push_back(std::static_pointer_cast<Record>(layer.pages.back()));
    }
    if (read.rebuilt[l]) {
      // The manifest still lists its tail (kept for it); the layer's last
      // page is the one rebuilt.
      if (read.has_tail[l]) layer.pages.pop_back();
      if (!read.tails[l].empty()) {
        auto tail = std::make_shared<Record>(this, next_lsn_++, read.tails[l].size(), state, "", false);
        tail->done = true;
        tail->payload = std::move(read.tails[l]);
        layer.pages.push_back(std::move(tail));
      }
    }
    session.layers.push_back(std::move(layer));
  }
  state->layers = static_cast<int>(layers);
  session.manifest = std::move(claimed);
  session.shared_epoch = read.epoch;
  for (std::string& key : read.superseded) Enqueue(Job::Of(Job::kDelete, state, std::move(key)));  // its older copy goes
  const std::string id = state->id;
  sessions_[TenantSessionKey(state->tenant, id)] = std::move(state);
  // This daemon's again: the store must not drop it for an older claim.
  disowned_why_.erase(id);
  disowned_.erase(std::remove_if(disowned_.begin(), disowned_.end(), [&](const auto& d) { return d.first == id; }),
                  disowned_.end());
  return session;
}

void RedisTier::LetGo(TierSession image) {
  std::vector<std::string> release;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sessions_.find(TenantSessionKey(image.header.tenant, image.header.id));
    if (it == sessions_.end()) return;
    SessionState& state = *it->second;
    state.let_go = true;
    release = {"EVAL", kRelease, "1", state.Key("l"), state.LeaseValue(owner_)};
    sessions_.erase(it);  // neither renewed nor refreshed any more
  }
  Borrow()->Run(release).IgnoreError();
}

std::vector<std::pair<std::string, absl::Status>> RedisTier::TakeDisowned() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::move(disowned_);
}

std::vector<std::string> RedisTier::TakeLost() {
  // Called with every acknowledgement of an append: the lost ones alone.
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> lost;
  for (const std::shared_ptr<SessionState>& state : lost_) {
    state->lost = false;
    lost.push_back(state->id);
  }
  lost_.clear();
  return lost;
}

int64_t RedisTier::Epoch(const std::string& id, const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sessions_.find(TenantSessionKey(tenant, id));
  return it == sessions_.end() ? 0 : it->second->epoch;
}

absl::Status RedisTier::Owned(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = disowned_why_.find(id);
  return it == disowned_why_.end() ? absl::OkStatus() : absl::FailedPreconditionError(it->second);
}

absl::Status RedisTier::ReleaseAll() {
  std::vector<std::vector<std::string>> commands;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    for (const auto& [name, state] : sessions_) {
      if (state->epoch > 0 && !state->disowned && !state->tombstoned) {
        commands.push_back({"EVAL", kRelease, "1", state->Key("l"), state->LeaseValue(owner_)});
      }
    }
  }
  if (commands.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<RedisValue>> replies = Borrow()->Run(commands);
  if (!replies.ok()) {
    return absl::UnavailableError(absl::StrCat(commands.size(), " lease(s) not released (they lapse after --redis-lease): ",
                                               replies.status().message()));
  }
  return absl::OkStatus();
}

absl::Status RedisTier::Health() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return up_ ? absl::OkStatus() : absl::UnavailableError(down_reason_);
}

}  // namespace turbokv
