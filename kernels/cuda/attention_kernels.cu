// Flash-decoding attention over a batch of compressed paged caches. Records
// are decoded with the host/device helpers of block_math.h (DecodeValueAt,
// TurboBlock128Dots, TurboBlock128LaneValues), which the CPU tests check
// against the codecs; turbo keys are scored in the rotated domain against
// queries rotated once here, turbo values accumulate rotated and are rotated
// back once per output row in the merge kernel. Blocks find their problem
// and coordinates through the plan's lookups (attention_plan.h). The dot
// products and value sums use explicit fused multiply-adds (the build
// contracts nothing, for the codecs' bytes): attention matches the CPU
// within float tolerance, not to the bit, and an FMA is one instruction of
// the kernel's compute-bound inner loops, not two.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/block_math.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/attention_launch.cuh"
#include "kernels/cuda/codebooks.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/rotation.h"

namespace turbokv::cuda {
namespace {

constexpr int kWarps = kAttentionWarps;

// The codebook centroids of a turbo layout (16 slots; zeros for the others).
__device__ void LoadCentroids(const CodecLayout& layout, float* out, int i) {
  const int bits = TurboBits(layout.kind);
  out[i] = bits != 0 && i < (1 << bits) ? DeviceCodebook(layout.block_values, bits).centroids[i] : 0.0f;
}

// Rotates each query head into the key domain (H * S_k per block) when keys
// are turbo; copies it otherwise. One warp per output row.
template <int V>
__global__ void RotateQueriesKernel(Launch l) {
  const int lane = threadIdx.x;
  const int64_t row = blockIdx.x;
  const DeviceProblem& p = l.problems[ProblemOfRow(l.problems, l.count, row)];
  const int64_t local = row - p.first_row;
  const CodecLayout& layout = p.cache.key_layout;
  const int d = layout.head_dim;
  const float* q = p.q + local * d;
  float* q_rot = l.q_rot + row * d;
  if (TurboBits(layout.kind) == 0) {
    for (int i = lane; i < d; i += 32) q_rot[i] = q[i];
    return;
  }
  for (int b = 0; b < layout.blocks; ++b) {
    float v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int i = b * 32 * V + lane * V + k;
      v[k] = q[i] * (RotationSignNegative(p.cache.key_seed, i) ? -1.0f : 1.0f);
    }
    WarpFwht<V>(v, lane);
#pragma unroll
    for (int k = 0; k < V; ++k) q_rot[b * 32 * V + lane * V + k] = v[k];
  }
}

// sum_i q[r][i] * k[i] over one record for `rows` query rows held in shared
// memory ([rows][d]); turbo keys sum q * c per block and scale once by s / B.
// f16_wide: f16 keys whose records are 16-byte aligned, read eight values a
// load (the fp16 baseline's keys at the bandwidth they allow).
template <bool kHead128>
__device__ __forceinline__ void KeyDots(const CodecLayout& layout, const uint8_t* record, const float* q, int rows,
                                        const float* centroids, bool f16_wide, float (&dot)[kRowsPerBlock]) {
  const int d = kHead128 ? 128 : layout.head_dim;
  const int bits = TurboBits(layout.kind);
  if (f16_wide) {
    F16Dots<kRowsPerBlock>(record, d, q, d, rows, dot);
    return;
  }
  if (bits == 0) {
    for (int i = 0; i < d; ++i) {
      const float k = DecodeValueAt(layout, record, i, centroids);
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) {
        if (r < rows) dot[r] = fmaf(q[r * d + i], k, dot[r]);
      }
    }
    return;
  }
  const int bv = layout.block_values;
  if (bv == 128) {
    // kHead128: one block (a constant trip count keeps the loop's registers).
    const int blocks = kHead128 ? 1 : layout.blocks;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* block = record + static_cast<size_t>(b) * layout.block_bytes;
      if (bits == 2) TurboBlock128Dots<2, kRowsPerBlock>(block, q + b * 128, d, rows, centroids, dot);
      if (bits == 3) TurboBlock128Dots<3, kRowsPerBlock>(block, q + b * 128, d, rows, centroids, dot);
      if (bits == 4) TurboBlock128Dots<4, kRowsPerBlock>(block, q + b * 128, d, rows, centroids, dot);
    }
    return;
  }
  for (int b = 0; b < layout.blocks; ++b) {
    const uint8_t* block = record + static_cast<size_t>(b) * layout.block_bytes;
    float part[kRowsPerBlock] = {};
    for (int j = 0; j < bv; ++j) {
      const float c = centroids[TurboIndex(block + kTurboScaleBytes, bv, bits, j)];
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) {
        if (r < rows) part[r] = fmaf(q[r * d + b * bv + j], c, part[r]);
      }
    }
    const float f = TurboDecodeFactor(block, bv);
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) dot[r] += f * part[r];
  }
}

// One unit (attention_plan.h). Each warp takes tiles of 32 tokens of the
// split's range: lane j scores token j of the tile against every row (and,
// with top_k, writes its logits), the tile's softmax update runs across the
// warp, then the lanes switch to dimensions and accumulate the tile's
// values. Warps keep m, l per row, and acc in registers when head_dim is 128
// (kHead128: lane holds dimensions lane + 32 k) or in shared memory
// otherwise; the warps are combined through shared memory at the end into
// the split's partial state of each row.
template <bool kHead128>
__device__ void RunUnit(const Launch& l, const DeviceProblem& p, const Unit& u, float* shared) {
  // What the token loop reads of the descriptor, in registers: the logits
  // written below could alias the problem array for all the compiler knows,
  // and the rest of the descriptor would only hold registers.
  const CodecLayout key_layout = p.cache.key_layout;
  const CodecLayout value_layout = p.cache.value_layout;
  const uint8_t* const* pages = p.cache.pages;
  const int64_t page_tokens = p.cache.page_tokens;
  const int64_t tokens = p.cache.tokens;
  const size_t key_head = p.cache.key_offset(u.head, 0);  // the unit's kv head in a page
  const size_t value_head = p.cache.value_offset(u.head, 0);
  const size_t key_bytes = key_layout.code_size(), value_bytes = value_layout.code_size();
  // (head_dim is a multiple of 64: an f16 record is whole 16-byte words.)
  const bool f16_wide = key_layout.kind == CodecKind::kF16 && (key_head | key_bytes) % 16 == 0;
  const int d = kHead128 ? 128 : l.head_dim;  // a constant where it can be
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g0 = u.row_chunk * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, l.group - g0);
  const int64_t local_row0 = u.query * l.q_heads + u.head * l.group + g0;  // the problem's row of r = 0
  float* q_s = shared;                                     // [rows][d]
  float* acc_s = shared + kRowsPerBlock * d;               // [warps][rows][d]
  float* ml_s = acc_s + kWarps * kRowsPerBlock * d;        // [warps][rows][2]
  float* centroids_s = ml_s + kWarps * kRowsPerBlock * 2;  // key [16], value [16]

  for (int x = threadIdx.x; x < rows * d; x += blockDim.x) {
    q_s[x] = l.q_rot[(p.first_row + local_row0) * d + x];
  }
  if (threadIdx.x < 16) {
    LoadCentroids(key_layout, centroids_s, threadIdx.x);
    LoadCentroids(value_layout, centroids_s + 16, threadIdx.x);
  }
  float* acc = acc_s + warp * kRowsPerBlock * d;
  for (int x = lane; x < rows * d; x += 32) acc[x] = 0.0f;
  float acc_r[kRowsPerBlock][4] = {};  // kHead128: dimension lane + 32 k of row r
  const bool turbo_values_128 = TurboBits(value_layout.kind) != 0 && value_layout.block_values == 128;
  float* logits = l.top_k > 0 ? l.logits + p.first_logit + local_row0 * tokens : nullptr;
  __syncthreads();

  const VisibleTokens visible = Visible(p.positions[u.query], l.window, p.cache);
  float offset[kRowsPerBlock];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    offset[r] = p.logit_offset != nullptr && r < rows ? p.logit_offset[local_row0 + r] : 0.0f;
  }
  const int64_t begin = max(visible.first, u.split * p.chunk);
  const int64_t end = min(visible.last + 1, (u.split + 1) * p.chunk);
  float m[kRowsPerBlock], s[kRowsPerBlock];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    m[r] = -INFINITY;
    s[r] = 0.0f;
  }
  for (int64_t t0 = begin + 32 * warp; t0 < end; t0 += 32 * kWarps) {
    const int64_t t = t0 + lane;
    const bool valid = t < end;
    float logit[kRowsPerBlock];
    const uint8_t* value = nullptr;
    {
      float dot[kRowsPerBlock] = {};
      if (valid) {
        const int64_t page = t / page_tokens;  // one division per token
        const int64_t slot = t - page * page_tokens;
        const uint8_t* base = pages[page];
        KeyDots<kHead128>(key_layout, base + key_head + slot * key_bytes, q_s, rows, centroids_s, f16_wide, dot);
        value = base + value_head + slot * value_bytes;
      }
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) {
        float x = fmaf(dot[r], l.scale, offset[r]);
        if (l.softcap > 0.0f) x = l.softcap * tanhf(x / l.softcap);
        logit[r] = valid && r < rows ? x : -INFINITY;
        if (logits != nullptr && valid && r < rows) logits[r * tokens + t] = x;
      }
    }
    float weight[kRowsPerBlock] = {};
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      if (r >= rows) continue;
      const float m_new = fmaxf(m[r], WarpMax(logit[r]));
      const float correction = __expf(m[r] - m_new);
      weight[r] = valid ? __expf(logit[r] - m_new) : 0.0f;
      s[r] = s[r] * correction + WarpSum(weight[r]);
      m[r] = m_new;
      if (correction != 1.0f) {
        if (kHead128) {
#pragma unroll
          for (int k = 0; k < 4; ++k) acc_r[r][k] *= correction;
        } else {
          for (int i = lane; i < d; i += 32) acc[r * d + i] *= correction;
        }
      }
    }
    const int count = static_cast<int>(min(int64_t{32}, end - t0));
    for (int j = 0; j < count; ++j) {
      const uint8_t* record = reinterpret_cast<const uint8_t*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(value), j));
      float w[kRowsPerBlock];
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) w[r] = __shfl_sync(kFullMask, weight[r], j);
      if (kHead128) {
        float v[4];
        if (turbo_values_128) {
          TurboBlock128LaneValues(record, TurboBits(value_layout.kind), lane, centroids_s + 16, v);
        } else {
          PlainLaneValues128(value_layout.kind, record, lane, v);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
#pragma unroll
          for (int k = 0; k < 4; ++k) acc_r[r][k] = fmaf(w[r], v[k], acc_r[r][k]);
        }
      } else {
        for (int i = lane; i < d; i += 32) {
          const float v = DecodeValueAt(value_layout, record, i, centroids_s + 16);
#pragma unroll
          for (int r = 0; r < kRowsPerBlock; ++r) {
            if (r < rows) acc[r * d + i] = fmaf(w[r], v, acc[r * d + i]);
          }
        }
      }
    }
  }
  // Register arrays are indexed by constants only (unrolled, rows as a
  // predicate): a runtime index would move them to local memory.
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    if (r >= rows) continue;
    if (kHead128) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[r * d + lane + 32 * k] = acc_r[r][k];
    }
    if (lane == 0) {
      ml_s[(warp * kRowsPerBlock + r) * 2] = m[r];
      ml_s[(warp * kRowsPerBlock + r) * 2 + 1] = s[r];
    }
  }
  __syncthreads();

  // Combine the warps' states into this split's partial of each row.
  for (int r = 0; r < rows; ++r) {
    float m_all = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, ml_s[(w * kRowsPerBlock + r) * 2]);
    float* out = l.partials + (p.first_partial + (local_row0 + r) * p.splits + u.split) * static_cast<size_t>(d + 2);
    float s_all = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml_s[(w * kRowsPerBlock + r) * 2];
      if (mw != -INFINITY) s_all += ml_s[(w * kRowsPerBlock + r) * 2 + 1] * __expf(mw - m_all);
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      float a = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        const float mw = ml_s[(w * kRowsPerBlock + r) * 2];
        if (mw != -INFINITY) a += acc_s[(w * kRowsPerBlock + r) * d + i] * __expf(mw - m_all);
      }
      out[2 + i] = a;
    }
    if (threadIdx.x == 0) {
      out[0] = m_all;
      out[1] = s_all;
    }
  }
  __syncthreads();  // the next unit of this block reuses the shared memory
}

// Blocks a multiprocessor keeps resident: on sm_90 four (16 warps), which
// ptxas fits in 128 registers a thread without spilling (five would spill;
// scripts/cuda-resources.sh); sm_80's code needs a few more, so three.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kSplitBlocksPerSm = 3;
#else
constexpr int kSplitBlocksPerSm = 4;
#endif

template <bool kHead128>
__global__ void __launch_bounds__(32 * kWarps, kSplitBlocksPerSm) SplitKernel(Launch l, int64_t units) {
  extern __shared__ __align__(16) float shared[];  // q rows read as float4
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const DeviceProblem& p = l.problems[ProblemOfUnit(l.problems, l.count, unit)];
    RunUnit<kHead128>(l, p, UnitOf(p, unit, l.row_chunks), shared);
  }
}

constexpr int kMergeThreads = 128;

// Block reduction over kMergeThreads threads (max or sum), returned to all.
template <bool kMax>
__device__ float BlockReduce(float x, float* scratch) {
  x = kMax ? WarpMax(x) : WarpSum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kMergeThreads / 32; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// One block per output row: combines the splits through their max and sum,
// normalizes, rotates turbo values back (S_v * H per block, warp 0) and
// writes out and lse.
template <int V>
__global__ void __launch_bounds__(kMergeThreads) MergeKernel(Launch l) {
  extern __shared__ float shared[];
  float* row_s = shared;                     // [d]
  float* weight = shared + kMaxCudaHeadDim;  // [splits]: exp(m_s - m)
  float* scratch = weight + kMaxSplits;      // [warps]
  const int64_t row = blockIdx.x;
  const DeviceProblem& p = l.problems[ProblemOfRow(l.problems, l.count, row)];
  const int64_t local = row - p.first_row;
  const CodecLayout& layout = p.cache.value_layout;
  const int d = layout.head_dim;
  const size_t stride = d + 2;
  const float* part = l.partials + (p.first_partial + local * p.splits) * stride;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < p.splits; s += kMergeThreads) m = fmaxf(m, part[s * stride]);
  m = BlockReduce<true>(m, scratch);
  float sum = 0.0f;
  for (int s = threadIdx.x; s < p.splits; s += kMergeThreads) {
    const float ms = part[s * stride];
    weight[s] = ms == -INFINITY ? 0.0f : __expf(ms - m);
    sum += part[s * stride + 1] * weight[s];
  }
  sum = BlockReduce<false>(sum, scratch);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int i = threadIdx.x; i < d; i += kMergeThreads) {
    float a = 0.0f;
    for (int s = 0; s < p.splits; ++s) a += part[s * stride + 2 + i] * weight[s];
    row_s[i] = a * inv;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  if (TurboBits(layout.kind) != 0) {
    for (int b = 0; b < layout.blocks; ++b) {
      float v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = row_s[b * 32 * V + lane * V + k];
      WarpFwht<V>(v, lane);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int i = b * 32 * V + lane * V + k;
        row_s[i] = v[k] * (RotationSignNegative(p.cache.value_seed, i) ? -1.0f : 1.0f);
      }
    }
    __syncwarp();
  }
  for (int i = lane; i < d; i += 32) p.out[local * d + i] = row_s[i];
  if (lane == 0) p.lse[local] = sum > 0.0f ? m + logf(sum) : -INFINITY;
}

constexpr int kTopKThreads = 256;

// Float order as unsigned order: a larger float has a larger key, and -0
// the key of +0 (the CPU ranks them equal, the earlier token first).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// Whether (key a, token a) ranks before (key b, token b): the higher logit
// first, the earlier token among equal ones (as the CPU's TopK).
__device__ __forceinline__ bool RanksBefore(uint32_t key_a, int64_t token_a, uint32_t key_b, int64_t token_b) {
  return key_a > key_b || (key_a == key_b && token_a < token_b);
}

// Inclusive prefix sum over the block of one int per thread.
__device__ int BlockInclusiveSum(int x, int* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int step = 1; step < 32; step *= 2) {
    const int y = __shfl_up_sync(kFullMask, x, step);
    if (lane >= step) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  __syncthreads();
  return x + before;
}

// One block per output row: the top_k highest logits of the tokens the row's
// query sees, highest first (the earlier token among equal logits), then -1
// and -inf past the visible count. A radix select over the logits' ordered
// bits finds the k-th highest key; the keys above it and the earliest
// tokens equal to it are gathered and sorted (bitonic) in shared memory.
// (At least two blocks an SM: left to itself, ptxas held the kernel to 32
// registers on sm_80 and spilled once visibility took the cache's bounds.)
__global__ void __launch_bounds__(kTopKThreads, 2) TopKKernel(Launch l) {
  __shared__ unsigned histogram[256];
  __shared__ uint32_t candidate_key[kMaxCudaTopK];
  __shared__ int64_t candidate_token[kMaxCudaTopK];
  __shared__ uint32_t prefix_s;
  __shared__ int remaining_s;
  __shared__ int above_s;
  __shared__ int scratch[kTopKThreads / 32];
  const int64_t row = blockIdx.x;
  const DeviceProblem& p = l.problems[ProblemOfRow(l.problems, l.count, row)];
  const int64_t local = row - p.first_row;
  const float* logits = l.logits + p.first_logit + local * p.cache.tokens;
  const VisibleTokens visible = Visible(p.positions[local / l.q_heads], l.window, p.cache);
  const int64_t n = visible.last - visible.first + 1;
  const int k = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(l.top_k), n)));

  // Radix select, eight bits a pass from the top: after the passes,
  // prefix_s is the k-th highest key, and remaining_s how many tokens with
  // exactly that key belong to the top k.
  if (threadIdx.x == 0) {
    prefix_s = 0;
    remaining_s = k;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kTopKThreads) histogram[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int64_t t = visible.first + threadIdx.x; t <= visible.last; t += kTopKThreads) {
      const uint32_t key = OrderedKey(logits[t]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0 && k > 0) {
      int above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + static_cast<int>(histogram[b]) >= remaining_s) {
          prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
          remaining_s -= above;
          break;
        }
        above += static_cast<int>(histogram[b]);
      }
    }
    mask |= 255u << shift;
    __syncthreads();
  }
  const uint32_t threshold = prefix_s;
  const int ties = remaining_s;  // the earliest `ties` tokens with key == threshold
  if (threadIdx.x == 0) above_s = 0;
  __syncthreads();
  // Keys above the threshold take slots [0, k - ties) in any order; ties take
  // the slots after, in token order.
  int ties_taken = 0;
  for (int64_t base = visible.first; base <= visible.last && k > 0; base += kTopKThreads) {
    const int64_t t = base + threadIdx.x;
    uint32_t key = 0;
    if (t <= visible.last) key = OrderedKey(logits[t]);
    const bool tie = t <= visible.last && key == threshold;
    if (t <= visible.last && key > threshold) {
      const int slot = atomicAdd(&above_s, 1);
      candidate_key[slot] = key;
      candidate_token[slot] = t;
    }
    const int rank = BlockInclusiveSum(tie ? 1 : 0, scratch);  // 1-based among this tile's ties
    if (tie && ties_taken + rank <= ties) {
      const int slot = k - ties + ties_taken + rank - 1;
      candidate_key[slot] = key;
      candidate_token[slot] = t;
    }
    ties_taken += __syncthreads_count(tie);
  }
  // Pad to a power of two and sort, ranking order first.
  int size = 1;
  while (size < k) size *= 2;
  for (int i = k + threadIdx.x; i < size; i += kTopKThreads) {
    candidate_key[i] = 0;  // below every finite float's key
    candidate_token[i] = INT64_MAX;
  }
  __syncthreads();
  for (int span = 2; span <= size; span *= 2) {
    for (int stride = span / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < size; i += kTopKThreads) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const bool ascending = (i & span) == 0;
        const bool swap = ascending ? RanksBefore(candidate_key[j], candidate_token[j], candidate_key[i], candidate_token[i])
                                    : RanksBefore(candidate_key[i], candidate_token[i], candidate_key[j], candidate_token[j]);
        if (swap) {
          const uint32_t key = candidate_key[i];
          const int64_t token = candidate_token[i];
          candidate_key[i] = candidate_key[j];
          candidate_token[i] = candidate_token[j];
          candidate_key[j] = key;
          candidate_token[j] = token;
        }
      }
      __syncthreads();
    }
  }
  int64_t* tokens_out = p.topk_tokens + local * l.top_k;
  float* logits_out = p.topk_logits + local * l.top_k;
  for (int j = threadIdx.x; j < l.top_k; j += kTopKThreads) {
    tokens_out[j] = j < k ? candidate_token[j] : -1;
    logits_out[j] = j < k ? logits[candidate_token[j]] : -INFINITY;
  }
}

}  // namespace

cudaError_t LaunchAttention(const DeviceProblem* host_problems, const DeviceProblem* device_problems, int64_t count,
                            const AttentionPlan& plan, const AttentionParams& params, void* workspace,
                            cudaStream_t stream, TensorCoreVariant variant) {
  if (count == 0 || plan.rows == 0) return cudaSuccess;
  const PagedKvCache& first = host_problems[0].cache;
  const int d = first.key_layout.head_dim;
  if (d > kMaxCudaHeadDim || params.top_k > kMaxCudaTopK) return cudaErrorNotSupported;
  for (int64_t i = 0; i < count; ++i) {
    const PagedKvCache& c = host_problems[i].cache;
    if (c.kv_heads != first.kv_heads || c.key_layout.head_dim != d || c.value_layout.head_dim != d ||
        params.q_heads % c.kv_heads != 0 || c.order != first.order) {
      return cudaErrorInvalidValue;
    }
  }
  Launch l;
  l.problems = device_problems;
  l.count = count;
  l.q_heads = params.q_heads;
  l.group = params.q_heads / first.kv_heads;
  l.row_chunks = plan.row_chunks;
  l.head_dim = d;
  l.scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  l.softcap = params.softcap;
  l.window = params.window;
  l.top_k = params.top_k;
  float* base = static_cast<float*>(workspace);
  l.q_rot = base + plan.q_rot_offset();
  l.partials = base + plan.partials_offset(d);
  l.logits = base + plan.logits_offset(d);

  // One block per row; units past what one grid dimension takes loop
  // inside the blocks. (A call's rows are bounded far below this by the
  // message size.)
  constexpr int64_t kMaxGrid = 0x7fffffff;
  if (plan.rows > kMaxGrid) return cudaErrorInvalidValue;
  const bool block128 = RotationBlockValues(d) == 128;
  cudaGetLastError();  // what cudaGetLastError reports below is these launches'
  if (block128) {
    RotateQueriesKernel<4><<<static_cast<unsigned>(plan.rows), 32, 0, stream>>>(l);
  } else {
    RotateQueriesKernel<2><<<static_cast<unsigned>(plan.rows), 32, 0, stream>>>(l);
  }
  const size_t shared =
      (kRowsPerBlock * d + kWarps * kRowsPerBlock * d + kWarps * kRowsPerBlock * 2 + 32) * sizeof(float);
  const unsigned grid = static_cast<unsigned>(std::min(plan.units, kMaxGrid));
  if (first.order == PageOrder::kTokenGroups) {
    if (const cudaError_t e = LaunchTensorCoreSplit(l, host_problems, plan.units, stream, variant); e != cudaSuccess) {
      return e;
    }
  } else if (d == 128) {
    SplitKernel<true><<<grid, 32 * kWarps, shared, stream>>>(l, plan.units);
  } else {
    SplitKernel<false><<<grid, 32 * kWarps, shared, stream>>>(l, plan.units);
  }
  const size_t merge_shared = (kMaxCudaHeadDim + kMaxSplits + kMergeThreads / 32) * sizeof(float);
  if (block128) {
    MergeKernel<4><<<static_cast<unsigned>(plan.rows), kMergeThreads, merge_shared, stream>>>(l);
  } else {
    MergeKernel<2><<<static_cast<unsigned>(plan.rows), kMergeThreads, merge_shared, stream>>>(l);
  }
  if (params.top_k > 0) TopKKernel<<<static_cast<unsigned>(plan.rows), kTopKThreads, 0, stream>>>(l);
  return cudaGetLastError();
}

}  // namespace turbokv::cuda
