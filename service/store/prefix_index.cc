#include "service/store/prefix_index.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "service/store/record_io.h"

namespace turbokv {

std::string PrefixScope(const std::string& tenant, const SessionConfig& config) {
  std::string scope;
  PutString(&scope, tenant);
  Put<int32_t>(&scope, config.layers);
  Put<int32_t>(&scope, config.kv_heads);
  Put<int32_t>(&scope, config.q_heads);  // a transform may be fitted with the queries
  Put<int32_t>(&scope, config.head_dim);
  for (int l = 0; l < config.layers; ++l) {
    Put<uint8_t>(&scope, static_cast<uint8_t>(config.KeyCodec(l)));
    Put<uint8_t>(&scope, static_cast<uint8_t>(config.ValueCodec(l)));
  }
  Put<uint8_t>(&scope, static_cast<uint8_t>(config.key_transform));
  Put<uint8_t>(&scope, config.center_values ? 1 : 0);
  Put<int32_t>(&scope, config.sink_tokens);
  Put<uint8_t>(&scope, static_cast<uint8_t>(config.sink_codec));
  return scope;
}

std::string PrefixIndex::Key(const std::string& scope, size_t block, const std::string& hash) {
  std::string key = scope;
  Put<uint64_t>(&key, block);
  key += hash;
  return key;
}

PrefixIndex::Holding PrefixIndex::Get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = holdings_.find(id);
  return it == holdings_.end() ? Holding() : it->second;
}

size_t PrefixIndex::named(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = holdings_.find(id);
  return it == holdings_.end() ? 0 : it->second.hashes.size();
}

namespace {

std::string HeldKey(const std::string& medium, const std::string& hash) {
  std::string key = medium;
  key += '\0';
  key += hash;
  return key;
}

}  // namespace

void PrefixIndex::Link(const std::string& id, const Holding& holding, size_t from, size_t to,
                       std::vector<BlockEvent>* events) {
  size_t run_end = 0;  // one past the last block of the open BlockStored event
  for (size_t i = from; i < to; ++i) {
    holders_[Key(holding.scope, i, holding.hashes[i])].push_back(id);
    if (++held_[HeldKey(holding.medium, holding.hashes[i])] != 1) continue;
    if (events->empty() || events->back().kind != BlockEvent::kStored || run_end != i) {
      BlockEvent stored;
      stored.medium = holding.medium;
      stored.has_parent = i > 0;
      if (i > 0) stored.parent = holding.hashes[i - 1];
      events->push_back(std::move(stored));
    }
    events->back().hashes.push_back(holding.hashes[i]);
    run_end = i + 1;
  }
}

void PrefixIndex::Unlink(const std::string& id, const Holding& holding, size_t from, size_t to,
                         std::vector<BlockEvent>* events) {
  BlockEvent removed;
  removed.kind = BlockEvent::kRemoved;
  removed.medium = holding.medium;
  for (size_t i = from; i < to; ++i) {
    auto it = holders_.find(Key(holding.scope, i, holding.hashes[i]));
    if (it != holders_.end()) {
      std::vector<std::string>& ids = it->second;
      ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
      if (ids.empty()) holders_.erase(it);
    }
    auto held = held_.find(HeldKey(holding.medium, holding.hashes[i]));
    if (held != held_.end() && --held->second == 0) {
      held_.erase(held);
      removed.hashes.push_back(holding.hashes[i]);
    }
  }
  if (!removed.hashes.empty()) events->push_back(std::move(removed));
}

void PrefixIndex::Set(const std::string& id, Holding holding) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BlockEvent> events;
  auto it = holdings_.find(id);
  size_t kept = 0;  // blocks held already, as the new holding holds them
  if (it != holdings_.end()) {
    const Holding& old = it->second;
    if (old.scope == holding.scope && old.medium == holding.medium && old.seed == holding.seed &&
        old.hashes.size() <= holding.hashes.size() &&
        std::equal(old.hashes.begin(), old.hashes.end(), holding.hashes.begin())) {
      kept = old.hashes.size();
    } else {
      Unlink(id, old, 0, old.hashes.size(), &events);
    }
    holdings_.erase(it);
  }
  if (!holding.hashes.empty()) {
    Link(id, holding, kept, holding.hashes.size(), &events);
    holdings_.emplace(id, std::move(holding));
  }
  Emit(std::move(events));
}

void PrefixIndex::Truncate(const std::string& id, size_t blocks, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = holdings_.find(id);
  if (it == holdings_.end()) return;
  if (tokens < it->second.reuse_from_tokens) it->second.reuse_from_tokens = kNeverReused;
  if (it->second.hashes.size() <= blocks) return;
  std::vector<BlockEvent> events;
  Unlink(id, it->second, blocks, it->second.hashes.size(), &events);
  if (blocks == 0) {
    holdings_.erase(it);
  } else {
    it->second.hashes.resize(blocks);
  }
  Emit(std::move(events));
}

void PrefixIndex::Move(const std::string& id, const std::string& medium) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = holdings_.find(id);
  if (it == holdings_.end() || it->second.medium == medium) return;
  std::vector<BlockEvent> events;
  Holding& holding = it->second;
  Unlink(id, holding, 0, holding.hashes.size(), &events);
  holding.medium = medium;
  Link(id, holding, 0, holding.hashes.size(), &events);
  Emit(std::move(events));
}

void PrefixIndex::Snapshot(const std::function<void(std::vector<BlockEvent>)>& fill) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BlockEvent> events(1);
  events[0].kind = BlockEvent::kCleared;
  std::unordered_map<std::string, size_t> by_medium;  // its BlockStored event in `events`
  for (const auto& [key, count] : held_) {
    const size_t nul = key.find('\0');
    const std::string medium = key.substr(0, nul);
    auto [at, added] = by_medium.emplace(medium, events.size());
    if (added) {
      events.emplace_back();
      events.back().medium = medium;
    }
    events[at->second].hashes.push_back(key.substr(nul + 1));
  }
  fill(std::move(events));
}

std::vector<PrefixIndex::Match> PrefixIndex::Find(const std::string& scope, const uint64_t* seed,
                                                  absl::Span<const std::string> hashes, int page_tokens) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Walks the blocks in order keeping the sessions that hold every block so
  // far: a session found at block i holds the whole prefix up to it.
  std::vector<std::string> alive;
  std::vector<Match> found;  // by increasing blocks
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto it = holders_.find(Key(scope, i, hashes[i]));
    if (it == holders_.end()) break;
    std::vector<std::string> next;
    for (const std::string& id : it->second) {
      if (i > 0 && std::find(alive.begin(), alive.end(), id) == alive.end()) continue;
      const Holding& holding = holdings_.at(id);
      if (seed != nullptr && holding.seed != *seed) continue;
      next.push_back(id);
      if (static_cast<int64_t>(i + 1) * page_tokens >= holding.reuse_from_tokens) found.push_back({id, i + 1});
    }
    if (next.empty()) break;
    alive = std::move(next);
  }
  std::vector<Match> longest_first;
  std::unordered_set<std::string> seen;
  for (auto match = found.rbegin(); match != found.rend(); ++match) {
    if (seen.insert(match->session_id).second) longest_first.push_back(*match);
  }
  return longest_first;
}

size_t PrefixIndex::blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return holders_.size();
}

}  // namespace turbokv
