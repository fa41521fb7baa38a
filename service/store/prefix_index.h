// The prefix index: which sessions hold which content-named blocks, so that a
// new session can start with the longest stored prefix of its tokens,
// sharing the pages (SessionStore::Attach).
//
// A block is the tokens [i x page_tokens, (i + 1) x page_tokens) of every
// layer of a session. The client names it with a hash it computes, chained
// over the token ids of the block and of every block before it (as vLLM's
// prefix cache does): the daemon never sees tokens and trusts the hash to
// name the content. Blocks are looked up only within a scope: the tenant and
// everything that decides the bytes of the pages (shape, codecs per layer,
// key transform, sinks) except the rotation seed, which a holder carries and
// a lookup may leave open. So a tenant never reuses another's blocks, even
// with equal hashes, and a block stored with other codecs or shape is never
// found.
//
// An entry lives as long as a session holds it: the session's removal
// (delete, eviction, expiry, another daemon's claim) and truncation drop it.
// A demoted session still holds its blocks (an attach promotes it).
//
// Each holding is in one medium: "memory" while its session is resident,
// else the tier it was demoted to. The index says when a block hash comes to
// be held in a medium (by any session of any scope) and when the last holder
// there lets go: the events a router consumes (service/kv_events.h).
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/types/span.h"
#include "service/records/session_config.h"

namespace turbokv {

// A change in the blocks held in a medium, as routers' KV events name them.
struct BlockEvent {
  enum Kind { kStored, kRemoved, kCleared } kind = kStored;
  std::string medium;
  // kStored: consecutive blocks of one chain, `parent` the hash of the
  // block before the first (has_parent false for block 0); kRemoved: any.
  std::vector<std::string> hashes;
  std::string parent;
  bool has_parent = false;
};
// Receives each call's events, in order, under the index's lock: it must
// not call back into the index.
using BlockEventSink = std::function<void(std::vector<BlockEvent>)>;

constexpr char kMemoryMedium[] = "memory";

// The scope of a session's blocks: its tenant and the storage its config
// decides, without the rotation seed.
std::string PrefixScope(const std::string& tenant, const SessionConfig& config);

class PrefixIndex {
 public:
  explicit PrefixIndex(BlockEventSink sink = nullptr) : sink_(std::move(sink)) {}

  // What a session holds: blocks 0 .. hashes.size() - 1.
  struct Holding {
    std::string scope;
    std::string medium = kMemoryMedium;
    uint64_t seed = 0;
    std::vector<std::string> hashes;
    // A prefix of this session can be reused only when it reaches this many
    // tokens: the end of the chunk each layer's key transform was fitted on
    // (the pages before it depend on the tokens up to it).
    int64_t reuse_from_tokens = 0;
  };
  // A session holding the first `blocks` blocks of a lookup.
  struct Match {
    std::string session_id;
    size_t blocks = 0;
  };

  // The blocks session `id` holds (none: an empty holding).
  Holding Get(const std::string& id) const;
  size_t named(const std::string& id) const;
  // Replaces what session `id` holds.
  void Set(const std::string& id, Holding holding);
  // Keeps the first `blocks` blocks session `id` holds, the session cut at
  // `tokens` (past them: nothing changes): cut within the chunk its
  // transforms were fitted on, it is never reused from then on.
  void Truncate(const std::string& id, size_t blocks, int64_t tokens);
  void Remove(const std::string& id) { Truncate(id, 0, 0); }
  // Moves what session `id` holds to `medium`.
  void Move(const std::string& id, const std::string& medium);
  // Calls fill(events) under the index's lock with the blocks held now, as
  // events that build them from nothing (a cleared state first).
  void Snapshot(const std::function<void(std::vector<BlockEvent>)>& fill) const;

  // Sessions of `scope` (and `seed`, when given) holding a prefix of
  // `hashes` that they may share, longest first, each session once: at
  // most kMaxMatches, looking at most at kExaminedPerBlock holders of each
  // block. Linear in the blocks of `hashes`, however many sessions hold
  // them (a walk down the tree of held prefixes, then back up it).
  std::vector<Match> Find(const std::string& scope, const uint64_t* seed, absl::Span<const std::string> hashes,
                          int page_tokens) const;
  static constexpr size_t kMaxMatches = 8;
  static constexpr size_t kExaminedPerBlock = 32;

  // Distinct prefixes held (a block several sessions hold, after the same
  // blocks, counts once).
  size_t blocks() const;

 private:
  // A held prefix: the blocks 0..i of some holding, one node of a tree per
  // scope, with the sessions holding at least that prefix.
  struct Node {
    std::string key;  // in children_
    std::unordered_set<std::string> holders;
  };
  // A holding and the nodes of its blocks.
  struct Entry {
    Holding holding;
    std::vector<int64_t> path;
  };
  // The key of the node of `hash` after node `parent` (0: block 0 of `scope`).
  static std::string ChildKey(const std::string& scope, int64_t parent, const std::string& hash);
  // Under mutex_: adds `id` as a holder of its blocks from path.size() to
  // the holding's end / removes it from its blocks from `from` on.
  void Link(const std::string& id, Entry* entry);
  void Unlink(const std::string& id, Entry* entry, size_t from);
  // Under mutex_: counts the holding's blocks [from, to) in its medium, or
  // stops counting them, adding the events of the blocks that come to be
  // held in the medium or stop being.
  void Count(const Holding& holding, size_t from, size_t to, std::vector<BlockEvent>* events);
  void Uncount(const Holding& holding, size_t from, size_t to, std::vector<BlockEvent>* events);
  void Emit(std::vector<BlockEvent> events) const {
    if (sink_ != nullptr && !events.empty()) sink_(std::move(events));
  }

  const BlockEventSink sink_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;       // by session id
  std::unordered_map<std::string, int64_t> children_;    // by ChildKey(): node id
  std::unordered_map<int64_t, Node> nodes_;
  int64_t next_node_ = 1;
  // Holdings of each hash in each medium (medium, NUL, hash), over scopes.
  std::unordered_map<std::string, int> held_;
};

}  // namespace turbokv
