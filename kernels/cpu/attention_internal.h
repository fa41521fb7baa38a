// Pieces of the CPU attention shared by the driver (attention.cc), the scalar
// scan and the SIMD scan. Internal to kernels/.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention.h"

namespace turbokv {

// Tokens per tile of the SIMD scan: its logits are laid out
// [rows][kScanTile]; a tile never crosses a page.
constexpr int kScanTile = 64;

// A logit and the token it belongs to, for top-k.
struct TopEntry {
  float logit;
  int64_t token;
};

// Higher logit first; the earlier token among equal logits.
inline bool Ranks(const TopEntry& a, const TopEntry& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
}

// Keeps the k largest logits of one query head in a min-heap.
class TopK {
 public:
  explicit TopK(int k = 0) : k_(k) { heap_.reserve(k); }
  void Push(float logit, int64_t token);
  const std::vector<TopEntry>& entries() const { return heap_; }

 private:
  int k_;
  std::vector<TopEntry> heap_;
};

// One work item: kv head `head`, tokens [begin, end), every query row of that
// head (row r = query (r / group), q head head * group + r % group).
struct ScanTask {
  const PagedKvCache* cache = nullptr;
  int head = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int rows = 0;
  int group = 0;
  const float* q = nullptr;        // [rows][head_dim], in the key domain (rotated for turbo keys)
  const int64_t* first = nullptr;  // [queries] first visible token of each query
  const int64_t* last = nullptr;   // [queries] last visible token
  const float* offset = nullptr;   // [rows] added to every logit of the row, or nullptr
  float scale = 1.0f;
  float softcap = 0.0f;
  int top_k = 0;
  bool integer_dot_products = true;
};

// Running softmax state of every row over the tokens scanned so far: the
// maximum logit m, the sum l of exp(logit - m), and acc, the exp-weighted sum
// of values in the value domain (rotated for turbo values).
struct ScanState {
  ScanState(int rows, int head_dim, int top_k) { Reset(rows, head_dim, top_k); }
  // As constructed, keeping the memory it has (a thread's state for its
  // work items).
  void Reset(int rows, int head_dim, int top_k) {
    m.assign(rows, -INFINITY);
    l.assign(rows, 0.0f);
    acc.assign(static_cast<size_t>(rows) * head_dim, 0.0f);
    top.assign(rows, TopK(top_k));
  }
  std::vector<float> m;
  std::vector<float> l;
  std::vector<float> acc;
  std::vector<TopK> top;
};

// The logit of a raw score: scaled and offset, then soft-capped when softcap > 0.
inline float Logit(float score, float scale, float offset, float softcap) {
  const float x = score * scale + offset;
  return softcap > 0.0f ? softcap * std::tanh(x / softcap) : x;
}

void ScanScalar(const ScanTask& task, ScanState* state);
void ScanSimd(const ScanTask& task, ScanState* state);

}  // namespace turbokv
