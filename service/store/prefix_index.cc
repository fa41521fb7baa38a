#include "service/store/prefix_index.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "service/records/record_io.h"

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

std::string PrefixIndex::ChildKey(const std::string& scope, int64_t parent, const std::string& hash) {
  std::string key;
  Put<int64_t>(&key, parent);
  if (parent == 0) PutString(&key, scope);
  key += hash;
  return key;
}

PrefixIndex::Holding PrefixIndex::Get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  return it == entries_.end() ? Holding() : it->second.holding;
}

size_t PrefixIndex::named(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  return it == entries_.end() ? 0 : it->second.holding.hashes.size();
}

namespace {

std::string HeldKey(const std::string& medium, const std::string& hash) {
  std::string key = medium;
  key += '\0';
  key += hash;
  return key;
}

}  // namespace

void PrefixIndex::Link(const std::string& id, Entry* entry) {
  const Holding& holding = entry->holding;
  for (size_t i = entry->path.size(); i < holding.hashes.size(); ++i) {
    const int64_t parent = i == 0 ? 0 : entry->path[i - 1];
    auto [child, added] = children_.try_emplace(ChildKey(holding.scope, parent, holding.hashes[i]), next_node_);
    if (added) nodes_[next_node_++].key = child->first;
    nodes_[child->second].holders.insert(id);
    entry->path.push_back(child->second);
  }
}

void PrefixIndex::Unlink(const std::string& id, Entry* entry, size_t from) {
  for (size_t i = entry->path.size(); i-- > from;) {
    auto node = nodes_.find(entry->path[i]);
    node->second.holders.erase(id);
    if (node->second.holders.empty()) {  // nor any deeper prefix: every holder of one holds this
      children_.erase(node->second.key);
      nodes_.erase(node);
    }
  }
  entry->path.resize(std::min(from, entry->path.size()));
}

void PrefixIndex::Count(const Holding& holding, size_t from, size_t to, std::vector<BlockEvent>* events) {
  size_t run_end = 0;  // one past the last block of the open BlockStored event
  for (size_t i = from; i < to; ++i) {
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

void PrefixIndex::Uncount(const Holding& holding, size_t from, size_t to, std::vector<BlockEvent>* events) {
  BlockEvent removed;
  removed.kind = BlockEvent::kRemoved;
  removed.medium = holding.medium;
  for (size_t i = from; i < to; ++i) {
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
  Entry entry;
  size_t kept = 0;  // blocks held already, as the new holding holds them
  if (auto it = entries_.find(id); it != entries_.end()) {
    entry = std::move(it->second);
    entries_.erase(it);
    const Holding& old = entry.holding;
    if (old.scope == holding.scope && old.medium == holding.medium && old.seed == holding.seed &&
        old.hashes.size() <= holding.hashes.size() &&
        std::equal(old.hashes.begin(), old.hashes.end(), holding.hashes.begin())) {
      kept = old.hashes.size();
    } else {
      Unlink(id, &entry, 0);
      Uncount(old, 0, old.hashes.size(), &events);
    }
  }
  if (!holding.hashes.empty()) {
    entry.holding = std::move(holding);
    Link(id, &entry);
    Count(entry.holding, kept, entry.holding.hashes.size(), &events);
    entries_.emplace(id, std::move(entry));
  }
  Emit(std::move(events));
}

void PrefixIndex::Truncate(const std::string& id, size_t blocks, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Holding& holding = it->second.holding;
  if (tokens < holding.reuse_from_tokens) holding.reuse_from_tokens = kNeverReused;
  if (holding.hashes.size() <= blocks) return;
  std::vector<BlockEvent> events;
  Unlink(id, &it->second, blocks);
  Uncount(holding, blocks, holding.hashes.size(), &events);
  if (blocks == 0) {
    entries_.erase(it);
  } else {
    holding.hashes.resize(blocks);
  }
  Emit(std::move(events));
}

void PrefixIndex::Move(const std::string& id, const std::string& medium) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.holding.medium == medium) return;
  std::vector<BlockEvent> events;
  Holding& holding = it->second.holding;
  Uncount(holding, 0, holding.hashes.size(), &events);
  holding.medium = medium;
  Count(holding, 0, holding.hashes.size(), &events);
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
  // Down the tree: the nodes of the longest held prefix of `hashes` (every
  // holder of node i holds blocks 0..i as asked).
  std::vector<const Node*> path;
  int64_t parent = 0;
  for (const std::string& hash : hashes) {
    auto child = children_.find(ChildKey(scope, parent, hash));
    if (child == children_.end()) break;
    parent = child->second;
    path.push_back(&nodes_.at(parent));
  }
  // Back up it: the holders that may share each prefix, longest first.
  std::vector<Match> found;
  std::unordered_set<std::string> seen;
  for (size_t blocks = path.size(); blocks > 0 && found.size() < kMaxMatches; --blocks) {
    size_t examined = 0;
    for (const std::string& id : path[blocks - 1]->holders) {
      if (++examined > kExaminedPerBlock || found.size() == kMaxMatches) break;
      if (seen.count(id) != 0) continue;
      const Holding& holding = entries_.at(id).holding;
      if (seed != nullptr && holding.seed != *seed) continue;
      if (static_cast<int64_t>(blocks) * page_tokens < holding.reuse_from_tokens) continue;
      seen.insert(id);
      found.push_back({id, blocks});
    }
  }
  return found;
}

size_t PrefixIndex::blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nodes_.size();
}

}  // namespace turbokv
