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
// Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/types/span.h"
#include "service/store/session_config.h"

namespace turbokv {

// The scope of a session's blocks: its tenant and the storage its config
// decides, without the rotation seed.
std::string PrefixScope(const std::string& tenant, const SessionConfig& config);

class PrefixIndex {
 public:
  // What a session holds: blocks 0 .. hashes.size() - 1.
  struct Holding {
    std::string scope;
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
  // Keeps the first `blocks` blocks session `id` holds.
  void Truncate(const std::string& id, size_t blocks);
  void Remove(const std::string& id) { Truncate(id, 0); }

  // The sessions of `scope` (and `seed`, when given) holding a prefix of
  // `hashes` that they may share, longest first; each session once.
  std::vector<Match> Find(const std::string& scope, const uint64_t* seed, absl::Span<const std::string> hashes,
                          int page_tokens) const;

  // Distinct blocks held (a block several sessions hold counts once).
  size_t blocks() const;

 private:
  static std::string Key(const std::string& scope, size_t block, const std::string& hash);
  // Under mutex_: adds / removes `id` as a holder of its blocks [from, to).
  void Link(const std::string& id, const Holding& holding, size_t from, size_t to);
  void Unlink(const std::string& id, const Holding& holding, size_t from, size_t to);

  mutable std::mutex mutex_;
  std::unordered_map<std::string, Holding> holdings_;                // by session id
  std::unordered_map<std::string, std::vector<std::string>> holders_;  // by Key(): session ids
};

}  // namespace turbokv
