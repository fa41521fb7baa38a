// Where the pieces of a CudaStream call go in its buffers, and the host work
// around the launch: the tables, inputs and descriptors written into the
// pinned buffer before it is copied in, and the results taken from it after
// it is copied back. Plain C++ with no CUDA calls: the CPU tests stage calls
// with a host buffer standing in for the device one and check them against
// the CPU's own results.
//
// The pinned host buffer and the device buffer have the same layout: bytes
// [0, up) are the call's inputs (copied in before the launch), [down_begin,
// down_end) its results (copied back after it), and on the device only the
// kernels' scratch follows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/block_math.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/paged_cache.h"
#include "kernels/vector_chunks.h"

namespace turbokv::cuda {

struct StagingLayout {
  size_t up = 0;          // bytes copied in
  size_t down_begin = 0;  // bytes copied back: [down_begin, down_end)
  size_t down_end = 0;
  size_t host_bytes = 0;    // of the pinned buffer
  size_t device_bytes = 0;  // of the device buffer: the same, and the scratch
};

// One attention launch over problems[count] (checked, sharing their shape).
class AttentionStaging {
 public:
  AttentionStaging(const AttentionProblem* problems, size_t count, const AttentionParams& params);

  const StagingLayout& layout() const { return layout_; }
  const AttentionPlan& plan() const { return plan_; }
  // Writes the inputs and the problems' descriptors into `host` (the pinned
  // buffer) for a device buffer at `device`; returns the descriptors, whose
  // pointers are into `device` (LaunchAttention's host_problems).
  const std::vector<DeviceProblem>& Fill(uint8_t* host, uint8_t* device);
  // In the device buffer: the descriptors, and the kernels' scratch.
  const DeviceProblem* device_problems(uint8_t* device) const;
  void* workspace(uint8_t* device) const { return device + workspace_at_; }
  // Copies the results, back in `host`, to the problems' outputs.
  void Deliver(const uint8_t* host) const;

 private:
  const AttentionProblem* problems_;
  size_t count_;
  AttentionParams params_;
  int head_dim_;
  std::vector<DeviceProblem> device_;
  AttentionPlan plan_;
  StagingLayout layout_;
  size_t problems_at_ = 0, workspace_at_ = 0;
  std::vector<size_t> table_at_, q_at_, positions_at_, offsets_at_, out_at_, lse_at_, tokens_at_, logits_at_;
};

// One encode: every chunk with new tokens, its keys and its values, in one
// launch per codec layout among them.
class EncodeStaging {
 public:
  explicit EncodeStaging(absl::Span<const EncodeChunk> chunks);

  const StagingLayout& layout() const { return layout_; }
  // What to launch, after Fill: a layout's chunks, on the device.
  struct Launch {
    CodecLayout layout;
    const VectorChunk* chunks = nullptr;
    int count = 0;
    size_t vectors = 0;
    QuantizationError* errors = nullptr;  // [vectors * layout.blocks], or null
  };
  // A page to copy on the device before the launches (a shared page's bytes
  // into its copy).
  struct PageCopy {
    const uint8_t* from;
    uint8_t* to;
    size_t bytes;
  };
  // Writes the tables, keys, values and chunk descriptors into `host` for a
  // device buffer at `device`.
  void Fill(uint8_t* host, uint8_t* device);
  const std::vector<Launch>& launches() const { return launches_; }
  std::vector<PageCopy> copies() const;
  // The chunks' new pages, to zero before the launches: [zero_count()] in
  // the device buffer once filled.
  const ZeroedPage* zeroes(uint8_t* device) const { return reinterpret_cast<const ZeroedPage*>(device + zeroes_at_); }
  size_t zero_count() const { return zero_count_; }
  // Adds each vector's error, back in `host`, to its chunk's stats.
  void Deliver(const uint8_t* host) const;

 private:
  struct Side {  // the keys or the values of one chunk
    size_t chunk;
    bool values;
  };
  struct Group {  // the sides of one codec layout: one launch
    CodecLayout layout;
    std::vector<Side> sides;
    size_t chunks_at = 0;
    size_t errors_at = 0;
    int64_t vectors = 0;
  };

  absl::Span<const EncodeChunk> chunks_;
  bool errors_ = false;
  std::vector<Group> groups_;
  std::vector<size_t> table_at_, keys_at_, values_at_;
  size_t zeroes_at_ = 0, zero_count_ = 0;
  StagingLayout layout_;
  std::vector<Launch> launches_;
};

// One decode of tokens [first, first + n) of a cache into host keys and
// values [n][kv_heads][head_dim].
class DecodeStaging {
 public:
  DecodeStaging(const PagedKvCache& cache, int64_t first, int64_t n, float* keys, float* values);

  const StagingLayout& layout() const { return layout_; }
  // Writes the range's page table and the two chunk descriptors (keys,
  // values) into `host`; returns the descriptors on the device.
  const VectorChunk* Fill(uint8_t* host, uint8_t* device);
  size_t vectors() const { return static_cast<size_t>(n_) * cache_.kv_heads; }
  // Copies the decoded floats, back in `host`, to keys and values.
  void Deliver(const uint8_t* host) const;

 private:
  PagedKvCache cache_;
  int64_t first_, n_, first_page_;
  float* keys_;
  float* values_;
  size_t pages_, floats_bytes_;
  size_t table_at_ = 0, chunks_at_ = 0, keys_at_ = 0, values_at_ = 0;
  StagingLayout layout_;
};

}  // namespace turbokv::cuda
