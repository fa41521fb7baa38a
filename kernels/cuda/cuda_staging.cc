#include "kernels/cuda/cuda_staging.h"

#include <algorithm>
#include <cstring>

namespace turbokv::cuda {
namespace {

constexpr size_t kAlign = 256;

size_t Align(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Consecutive aligned regions of one buffer: where each piece of a call goes.
class Regions {
 public:
  explicit Regions(size_t start = 0) : size_(start) {}
  size_t Add(size_t bytes) {
    const size_t at = Align(size_);
    size_ = at + bytes;
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_;
};

int64_t PagesOf(const PagedKvCache& cache) { return (cache.tokens + cache.page_tokens - 1) / cache.page_tokens; }

// The page a chunk's first token is in: an encode needs the table from there.
int64_t FirstPage(const EncodeChunk& chunk) { return chunk.first / chunk.cache.page_tokens; }

size_t KeyValueBytes(const EncodeChunk& chunk) {
  return static_cast<size_t>(chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads *
         chunk.cache.key_layout.head_dim * sizeof(float);
}

bool SameLayout(const CodecLayout& a, const CodecLayout& b) { return a.kind == b.kind && a.head_dim == b.head_dim; }

template <class T>
T* At(uint8_t* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

}  // namespace

AttentionStaging::AttentionStaging(const AttentionProblem* problems, size_t count, const AttentionParams& params)
    : problems_(problems),
      count_(count),
      params_(params),
      head_dim_(problems[0].cache.key_layout.head_dim),
      device_(count) {
  const size_t d = static_cast<size_t>(head_dim_);
  // Up: the descriptors, then each problem's page table, queries,
  // positions and logit offsets. Down: each one's outputs. Then the
  // kernels' scratch.
  Regions up;
  problems_at_ = up.Add(count * sizeof(DeviceProblem));
  for (size_t i = 0; i < count; ++i) {
    const AttentionProblem& p = problems[i];
    table_at_.push_back(up.Add(static_cast<size_t>(PagesOf(p.cache)) * sizeof(uint8_t*)));
    q_at_.push_back(up.Add(static_cast<size_t>(p.queries.n) * params.q_heads * d * sizeof(float)));
    positions_at_.push_back(up.Add(static_cast<size_t>(p.queries.n) * sizeof(int64_t)));
    offsets_at_.push_back(p.queries.logit_offset != nullptr
                              ? up.Add(static_cast<size_t>(p.queries.n) * params.q_heads * sizeof(float))
                              : 0);
    device_[i].cache = p.cache;
    device_[i].n = p.queries.n;
  }
  layout_.up = up.size();
  layout_.down_begin = Align(up.size());
  Regions down(layout_.down_begin);
  for (size_t i = 0; i < count; ++i) {
    const size_t rows = static_cast<size_t>(problems[i].queries.n) * params.q_heads;
    out_at_.push_back(down.Add(rows * d * sizeof(float)));
    lse_at_.push_back(down.Add(rows * sizeof(float)));
    tokens_at_.push_back(down.Add(rows * params.top_k * sizeof(int64_t)));
    logits_at_.push_back(down.Add(rows * params.top_k * sizeof(float)));
  }
  layout_.down_end = down.size();
  layout_.host_bytes = down.size();
  plan_ = PlanAttention(device_.data(), static_cast<int64_t>(count), params.q_heads, params.top_k);
  workspace_at_ = Align(down.size());
  layout_.device_bytes = workspace_at_ + plan_.workspace_bytes(head_dim_);
}

const std::vector<DeviceProblem>& AttentionStaging::Fill(uint8_t* host, uint8_t* device) {
  const size_t d = static_cast<size_t>(head_dim_);
  const bool top = params_.top_k > 0;
  for (size_t i = 0; i < count_; ++i) {
    const AttentionProblem& p = problems_[i];
    DeviceProblem& dp = device_[i];
    dp.cache.pages = At<const uint8_t* const>(device, table_at_[i]);
    dp.q = At<const float>(device, q_at_[i]);
    dp.positions = At<const int64_t>(device, positions_at_[i]);
    dp.out = At<float>(device, out_at_[i]);
    dp.lse = At<float>(device, lse_at_[i]);
    dp.topk_tokens = top ? At<int64_t>(device, tokens_at_[i]) : nullptr;
    dp.topk_logits = top ? At<float>(device, logits_at_[i]) : nullptr;
    dp.logit_offset = p.queries.logit_offset != nullptr ? At<const float>(device, offsets_at_[i]) : nullptr;
    std::memcpy(host + table_at_[i], p.cache.pages, static_cast<size_t>(PagesOf(p.cache)) * sizeof(uint8_t*));
    std::memcpy(host + q_at_[i], p.queries.q, static_cast<size_t>(p.queries.n) * params_.q_heads * d * sizeof(float));
    std::memcpy(host + positions_at_[i], p.queries.positions, static_cast<size_t>(p.queries.n) * sizeof(int64_t));
    if (p.queries.logit_offset != nullptr) {
      std::memcpy(host + offsets_at_[i], p.queries.logit_offset,
                  static_cast<size_t>(p.queries.n) * params_.q_heads * sizeof(float));
    }
  }
  std::memcpy(host + problems_at_, device_.data(), count_ * sizeof(DeviceProblem));
  return device_;
}

const DeviceProblem* AttentionStaging::device_problems(uint8_t* device) const {
  return At<const DeviceProblem>(device, problems_at_);
}

void AttentionStaging::Deliver(const uint8_t* host) const {
  const size_t d = static_cast<size_t>(head_dim_);
  for (size_t i = 0; i < count_; ++i) {
    const AttentionOutput& out = problems_[i].output;
    const size_t rows = static_cast<size_t>(problems_[i].queries.n) * params_.q_heads;
    std::memcpy(out.out, host + out_at_[i], rows * d * sizeof(float));
    std::memcpy(out.lse, host + lse_at_[i], rows * sizeof(float));
    if (params_.top_k > 0) {
      std::memcpy(out.topk_tokens, host + tokens_at_[i], rows * params_.top_k * sizeof(int64_t));
      std::memcpy(out.topk_logits, host + logits_at_[i], rows * params_.top_k * sizeof(float));
    }
  }
}

EncodeStaging::EncodeStaging(absl::Span<const EncodeChunk> chunks)
    : chunks_(chunks), table_at_(chunks.size()), keys_at_(chunks.size()), values_at_(chunks.size()) {
  for (size_t c = 0; c < chunks.size(); ++c) {
    const EncodeChunk& chunk = chunks[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    errors_ = errors_ || chunk.key_errors != nullptr || chunk.value_errors != nullptr;
    for (const bool values : {false, true}) {
      const CodecLayout& layout = values ? chunk.cache.value_layout : chunk.cache.key_layout;
      auto group =
          std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return SameLayout(g.layout, layout); });
      if (group == groups_.end()) group = groups_.insert(groups_.end(), Group{layout, {}});
      group->sides.push_back(Side{c, values});
      group->vectors += (chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads;
    }
  }
  // Up: each chunk's page table (from its first page), keys and values; each
  // group's descriptors; the new pages to zero. Down: each group's errors.
  Regions up;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const EncodeChunk& chunk = chunks[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    table_at_[c] = up.Add(static_cast<size_t>(PagesOf(chunk.cache) - FirstPage(chunk)) * sizeof(uint8_t*));
    keys_at_[c] = up.Add(KeyValueBytes(chunk));
    values_at_[c] = up.Add(KeyValueBytes(chunk));
    const PageRange fresh = NewPages(chunk);
    zero_count_ += static_cast<size_t>(fresh.end - fresh.first);
  }
  for (Group& group : groups_) group.chunks_at = up.Add(group.sides.size() * sizeof(VectorChunk));
  zeroes_at_ = up.Add(zero_count_ * sizeof(ZeroedPage));
  layout_.up = up.size();
  layout_.down_begin = Align(up.size());
  Regions down(layout_.down_begin);
  for (Group& group : groups_) {
    if (errors_) {
      group.errors_at = down.Add(static_cast<size_t>(group.vectors) * group.layout.blocks * sizeof(QuantizationError));
    }
  }
  layout_.down_end = down.size();
  layout_.host_bytes = layout_.device_bytes = down.size();
}

void EncodeStaging::Fill(uint8_t* host, uint8_t* device) {
  ZeroedPage* zeroes = At<ZeroedPage>(host, zeroes_at_);
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const EncodeChunk& chunk = chunks_[c];
    if (chunk.first >= chunk.cache.tokens) continue;
    std::memcpy(host + table_at_[c], chunk.cache.pages + FirstPage(chunk),
                static_cast<size_t>(PagesOf(chunk.cache) - FirstPage(chunk)) * sizeof(uint8_t*));
    std::memcpy(host + keys_at_[c], chunk.keys, KeyValueBytes(chunk));
    std::memcpy(host + values_at_[c], chunk.values, KeyValueBytes(chunk));
    const PageRange fresh = NewPages(chunk);
    for (int64_t p = fresh.first; p < fresh.end; ++p) {
      // The chunk's pages are the caller's to write (EncodeChunk).
      *zeroes++ = ZeroedPage{const_cast<uint8_t*>(chunk.cache.pages[p]), chunk.cache.page_bytes()};
    }
  }
  launches_.clear();
  for (const Group& group : groups_) {
    VectorChunk* out = At<VectorChunk>(host, group.chunks_at);
    int64_t first_vector = 0;
    for (size_t i = 0; i < group.sides.size(); ++i) {
      const Side& side = group.sides[i];
      const EncodeChunk& chunk = chunks_[side.chunk];
      const int64_t tokens = chunk.cache.tokens - chunk.first;
      out[i] = MakeVectorChunk(chunk.cache, side.values, chunk.first, tokens,
                               At<float>(device, side.values ? values_at_[side.chunk] : keys_at_[side.chunk]),
                               first_vector, At<const uint8_t* const>(device, table_at_[side.chunk]),
                               FirstPage(chunk));
      first_vector += tokens * chunk.cache.kv_heads;
    }
    launches_.push_back(Launch{group.layout, At<const VectorChunk>(device, group.chunks_at),
                               static_cast<int>(group.sides.size()), static_cast<size_t>(group.vectors),
                               errors_ ? At<QuantizationError>(device, group.errors_at) : nullptr});
  }
}

std::vector<EncodeStaging::PageCopy> EncodeStaging::copies() const {
  std::vector<PageCopy> copies;
  for (const EncodeChunk& chunk : chunks_) {
    if (chunk.first >= chunk.cache.tokens || chunk.copy_from == nullptr) continue;
    // The chunk's pages are the caller's to write (EncodeChunk).
    uint8_t* page = const_cast<uint8_t*>(chunk.cache.pages[chunk.first / chunk.cache.page_tokens]);
    copies.push_back(PageCopy{chunk.copy_from, page, chunk.cache.page_bytes()});
  }
  return copies;
}

void EncodeStaging::Deliver(const uint8_t* host) const {
  if (!errors_) return;
  // A vector's error is the sum of its blocks' (as the CPU encoders add them).
  for (const Group& group : groups_) {
    const auto* blocks = reinterpret_cast<const QuantizationError*>(host + group.errors_at);
    for (const Side& side : group.sides) {
      const EncodeChunk& chunk = chunks_[side.chunk];
      EncodeStats* stats = side.values ? chunk.value_errors : chunk.key_errors;
      const int64_t vectors = (chunk.cache.tokens - chunk.first) * chunk.cache.kv_heads;
      for (int64_t v = 0; v < vectors; ++v, blocks += group.layout.blocks) {
        if (stats == nullptr) continue;
        QuantizationError error;
        for (int b = 0; b < group.layout.blocks; ++b) {
          error.error_sq += blocks[b].error_sq;
          error.norm_sq += blocks[b].norm_sq;
          error.fields += blocks[b].fields;
          error.saturated += blocks[b].saturated;
          error.underflowed += blocks[b].underflowed;
        }
        stats->AddVector(error);
      }
    }
  }
}

DecodeStaging::DecodeStaging(const PagedKvCache& cache, int64_t first, int64_t n, float* keys, float* values)
    : cache_(cache),
      first_(first),
      n_(n),
      first_page_(first / cache.page_tokens),
      keys_(keys),
      values_(values),
      pages_(static_cast<size_t>((first + n - 1) / cache.page_tokens - first_page_ + 1)),
      floats_bytes_(static_cast<size_t>(n) * cache.kv_heads * cache.key_layout.head_dim * sizeof(float)) {
  // Up: the range's pages' table, the two descriptors. Down: the floats.
  Regions up;
  table_at_ = up.Add(pages_ * sizeof(uint8_t*));
  chunks_at_ = up.Add(2 * sizeof(VectorChunk));
  layout_.up = up.size();
  layout_.down_begin = Align(up.size());
  Regions down(layout_.down_begin);
  keys_at_ = down.Add(floats_bytes_);
  values_at_ = down.Add(floats_bytes_);
  layout_.down_end = down.size();
  layout_.host_bytes = layout_.device_bytes = down.size();
}

const VectorChunk* DecodeStaging::Fill(uint8_t* host, uint8_t* device) {
  std::memcpy(host + table_at_, cache_.pages + first_page_, pages_ * sizeof(uint8_t*));
  VectorChunk* chunk = At<VectorChunk>(host, chunks_at_);
  const auto* table = At<const uint8_t* const>(device, table_at_);
  chunk[0] = MakeVectorChunk(cache_, false, first_, n_, At<float>(device, keys_at_), 0, table, first_page_);
  chunk[1] = MakeVectorChunk(cache_, true, first_, n_, At<float>(device, values_at_), 0, table, first_page_);
  return At<const VectorChunk>(device, chunks_at_);
}

void DecodeStaging::Deliver(const uint8_t* host) const {
  std::memcpy(keys_, host + keys_at_, floats_bytes_);
  std::memcpy(values_, host + values_at_, floats_bytes_);
}

}  // namespace turbokv::cuda
