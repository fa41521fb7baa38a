// Flash-decoding attention on the compressed paged cache. Records are decoded
// with the host/device helpers of block_math.h (DecodeValueAt,
// TurboBlock128Dots, TurboBlock128LaneValues), which the CPU tests check
// against the codecs; turbo keys are scored in the rotated domain against
// queries rotated once here, turbo values accumulate rotated and are rotated
// back once per output in the merge kernel.
#include <algorithm>
#include <cmath>

#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/warp.cuh"
#include "kernels/rotation.h"

namespace turbokv::cuda {
namespace {

constexpr int kWarps = 4;    // per block of the split kernel
constexpr int kRowsPerBlock = 4;

struct Problem {
  PagedKvCache cache;
  float key_centroids[16];
  float value_centroids[16];
  int q_heads;
  int group;
  int row_chunks;   // ceil(group / kRowsPerBlock)
  int splits;
  int64_t chunk;    // tokens per split
  float scale;
  float softcap;
  int64_t window;
  int64_t first_query;  // blockIdx.z counts queries from here
  const int64_t* positions;
  const float* q_rot;  // [n][q_heads][d], in the key domain
  float* partials;     // [n][q_heads][splits][d + 2]: m, l, acc
};

// Rotates each query head into the key domain (H * S_k per block) when keys
// are turbo; copies it otherwise. One warp per (query, q head).
template <int V>
__global__ void RotateQueriesKernel(Problem p, const float* __restrict__ q, float* __restrict__ q_rot) {
  const int lane = threadIdx.x;
  const size_t row = blockIdx.x;
  const CodecLayout& layout = p.cache.key_layout;
  const int d = layout.head_dim;
  const bool turbo = TurboBits(layout.kind) != 0;
  if (!turbo) {
    for (int i = lane; i < d; i += 32) q_rot[row * d + i] = q[row * d + i];
    return;
  }
  for (int b = 0; b < layout.blocks; ++b) {
    float v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int i = b * 32 * V + lane * V + k;
      v[k] = q[row * d + i] * (RotationSignNegative(p.cache.key_seed, i) ? -1.0f : 1.0f);
    }
    WarpFwht<V>(v, lane);
#pragma unroll
    for (int k = 0; k < V; ++k) q_rot[row * d + b * 32 * V + lane * V + k] = v[k];
  }
}

// sum_i q[r][i] * k[i] over one record for `rows` query rows held in shared
// memory ([rows][d]); turbo keys sum q * c per block and scale once by s / B.
__device__ __forceinline__ void KeyDots(const CodecLayout& layout, const uint8_t* record,
                                        const float* q, int rows, const float* centroids,
                                        float (&dot)[kRowsPerBlock]) {
  const int d = layout.head_dim;
  const int bits = TurboBits(layout.kind);
  if (bits == 0) {
    for (int i = 0; i < d; ++i) {
      const float k = DecodeValueAt(layout, record, i, centroids);
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) {
        if (r < rows) dot[r] += q[r * d + i] * k;
      }
    }
    return;
  }
  const int bv = layout.block_values;
  if (bv == 128) {
    for (int b = 0; b < layout.blocks; ++b) {
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
        if (r < rows) part[r] += q[r * d + b * bv + j] * c;
      }
    }
    const float f = TurboDecodeFactor(block, bv);
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) dot[r] += f * part[r];
  }
}

// Block (kv head, split, query x row chunk). Each warp takes tiles of 32
// tokens of the split's range: lane j scores token j of the tile against
// every row, the tile's softmax update runs across the warp, then the lanes
// switch to dimensions and accumulate the tile's values. Warps keep m, l per
// row, and acc in registers when head_dim is 128 (kHead128: lane holds
// dimensions lane + 32 k) or in shared memory otherwise; the warps are
// combined through shared memory at the end.
template <bool kHead128>
__global__ void __launch_bounds__(32 * kWarps) SplitKernel(Problem p) {
  extern __shared__ float shared[];
  const int d = p.cache.key_layout.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t query = p.first_query + blockIdx.z / p.row_chunks;
  const int g0 = (blockIdx.z % p.row_chunks) * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, p.group - g0);
  float* q_s = shared;                                         // [rows][d]
  float* acc_s = shared + kRowsPerBlock * d;                   // [warps][rows][d]
  float* ml_s = acc_s + kWarps * kRowsPerBlock * d;            // [warps][rows][2]
  float* centroids_s = ml_s + kWarps * kRowsPerBlock * 2;      // key [16], value [16]

  for (int x = threadIdx.x; x < rows * d; x += blockDim.x) {
    const int r = x / d, i = x % d;
    q_s[x] = p.q_rot[(query * p.q_heads + head * p.group + g0 + r) * static_cast<size_t>(d) + i];
  }
  if (threadIdx.x < 16) {
    centroids_s[threadIdx.x] = p.key_centroids[threadIdx.x];
    centroids_s[16 + threadIdx.x] = p.value_centroids[threadIdx.x];
  }
  float* acc = acc_s + warp * kRowsPerBlock * d;
  for (int x = lane; x < rows * d; x += 32) acc[x] = 0.0f;
  float acc_r[kRowsPerBlock][4] = {};  // kHead128: dimension lane + 32 k of row r
  const bool turbo_values_128 =
      TurboBits(p.cache.value_layout.kind) != 0 && p.cache.value_layout.block_values == 128;
  __syncthreads();

  const int64_t last = p.positions[query];
  const int64_t first = p.window > 0 ? max(int64_t{0}, last - p.window + 1) : 0;
  const int64_t begin = max(first, split * p.chunk);
  const int64_t end = min(last + 1, (split + 1) * p.chunk);
  float m[kRowsPerBlock], l[kRowsPerBlock];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int64_t t0 = begin + 32 * warp; t0 < end; t0 += 32 * kWarps) {
    const int64_t t = t0 + lane;
    const bool valid = t < end;
    float logit[kRowsPerBlock];
    const uint8_t* value = nullptr;
    {
      float dot[kRowsPerBlock] = {};
      if (valid) {
        const int64_t page = t / p.cache.page_tokens;  // one 64-bit division per token
        const int64_t slot = t - page * p.cache.page_tokens;
        const uint8_t* base = p.cache.pages[page];
        KeyDots(p.cache.key_layout, base + p.cache.key_offset(head, slot), q_s, rows, centroids_s, dot);
        value = base + p.cache.value_offset(head, slot);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) {
        float x = dot[r] * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
        logit[r] = valid && r < rows ? x : -INFINITY;
      }
    }
    float weight[kRowsPerBlock] = {};
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      if (r >= rows) continue;
      const float m_new = fmaxf(m[r], WarpMax(logit[r]));
      const float correction = __expf(m[r] - m_new);
      weight[r] = valid ? __expf(logit[r] - m_new) : 0.0f;
      l[r] = l[r] * correction + WarpSum(weight[r]);
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
          TurboBlock128LaneValues(record, TurboBits(p.cache.value_layout.kind), lane, centroids_s + 16, v);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) v[k] = DecodeValueAt(p.cache.value_layout, record, lane + 32 * k, centroids_s + 16);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
#pragma unroll
          for (int k = 0; k < 4; ++k) acc_r[r][k] += w[r] * v[k];
        }
      } else {
        for (int i = lane; i < d; i += 32) {
          const float v = DecodeValueAt(p.cache.value_layout, record, i, centroids_s + 16);
#pragma unroll
          for (int r = 0; r < kRowsPerBlock; ++r) {
            if (r < rows) acc[r * d + i] += w[r] * v;
          }
        }
      }
    }
  }
  if (kHead128) {
    for (int r = 0; r < rows; ++r) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[r * d + lane + 32 * k] = acc_r[r][k];
    }
  }
  if (lane == 0) {
    for (int r = 0; r < rows; ++r) {
      ml_s[(warp * kRowsPerBlock + r) * 2] = m[r];
      ml_s[(warp * kRowsPerBlock + r) * 2 + 1] = l[r];
    }
  }
  __syncthreads();

  // Combine the warps' states into this split's partial of each row.
  for (int r = 0; r < rows; ++r) {
    float m_all = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, ml_s[(w * kRowsPerBlock + r) * 2]);
    float* out = p.partials +
                 ((query * p.q_heads + head * p.group + g0 + r) * p.splits + split) * static_cast<size_t>(d + 2);
    float l_all = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml_s[(w * kRowsPerBlock + r) * 2];
      if (mw != -INFINITY) l_all += ml_s[(w * kRowsPerBlock + r) * 2 + 1] * __expf(mw - m_all);
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
      out[1] = l_all;
    }
  }
}

constexpr int kMergeThreads = 128;
constexpr int kMaxSplits = 256;

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

// One block per (query, q head): combines the splits through their max and
// sum, normalizes, rotates turbo values back (S_v * H per block, warp 0) and
// writes out and lse.
template <int V>
__global__ void __launch_bounds__(kMergeThreads) MergeKernel(Problem p, float* __restrict__ out,
                                                             float* __restrict__ lse) {
  extern __shared__ float shared[];
  float* row = shared;                    // [d]
  float* weight = shared + kMaxCudaHeadDim;  // [splits]: exp(m_s - m) / l
  float* scratch = weight + kMaxSplits;   // [warps]
  const size_t o = blockIdx.x;
  const CodecLayout& layout = p.cache.value_layout;
  const int d = layout.head_dim;
  const size_t stride = d + 2;
  const float* part = p.partials + o * p.splits * stride;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < p.splits; s += kMergeThreads) m = fmaxf(m, part[s * stride]);
  m = BlockReduce<true>(m, scratch);
  float l = 0.0f;
  for (int s = threadIdx.x; s < p.splits; s += kMergeThreads) {
    const float ms = part[s * stride];
    weight[s] = ms == -INFINITY ? 0.0f : __expf(ms - m);
    l += part[s * stride + 1] * weight[s];
  }
  l = BlockReduce<false>(l, scratch);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int i = threadIdx.x; i < d; i += kMergeThreads) {
    float a = 0.0f;
    for (int s = 0; s < p.splits; ++s) a += part[s * stride + 2 + i] * weight[s];
    row[i] = a * inv;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  if (TurboBits(layout.kind) != 0) {
    for (int b = 0; b < layout.blocks; ++b) {
      float v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = row[b * 32 * V + lane * V + k];
      WarpFwht<V>(v, lane);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int i = b * 32 * V + lane * V + k;
        row[i] = v[k] * (RotationSignNegative(p.cache.value_seed, i) ? -1.0f : 1.0f);
      }
    }
    __syncwarp();
  }
  for (int i = lane; i < d; i += 32) out[o * d + i] = row[i];
  if (lane == 0) lse[o] = l > 0.0f ? m + logf(l) : -INFINITY;
}

struct Plan {
  int row_chunks;
  int splits;
  int64_t chunk;
};

Plan MakePlan(const PagedKvCache& cache, const AttentionParams& params, int64_t n, int sm_count) {
  Plan plan;
  const int group = params.q_heads / cache.kv_heads;
  plan.row_chunks = (group + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t blocks_without_split = static_cast<int64_t>(cache.kv_heads) * n * plan.row_chunks;
  // Enough blocks to fill the device about eight times, at least one tile per
  // warp each.
  const int64_t wanted = std::max<int64_t>(1, (8 * static_cast<int64_t>(sm_count) + blocks_without_split - 1) /
                                                  blocks_without_split);
  const int64_t most = std::max<int64_t>(1, (cache.tokens + 32 * kWarps - 1) / (32 * kWarps));
  plan.splits = static_cast<int>(std::min<int64_t>({wanted, most, kMaxSplits}));
  plan.chunk = (cache.tokens + plan.splits - 1) / plan.splits;
  return plan;
}

}  // namespace

size_t AttentionWorkspaceBytes(const PagedKvCache& cache, const AttentionParams& params,
                               int64_t n_queries, int sm_count) {
  const Plan plan = MakePlan(cache, params, n_queries, sm_count);
  const size_t d = cache.key_layout.head_dim;
  const size_t rows = static_cast<size_t>(n_queries) * params.q_heads;
  return (rows * d + rows * plan.splits * (d + 2)) * sizeof(float);
}

cudaError_t LaunchAttention(const PagedKvCache& cache, const AttentionParams& params,
                            int64_t n_queries, const float* q, const int64_t* positions, float* out,
                            float* lse, void* workspace, size_t workspace_bytes, int sm_count,
                            cudaStream_t stream) {
  const int d = cache.key_layout.head_dim;
  if (params.top_k > 0 || d > kMaxCudaHeadDim) return cudaErrorNotSupported;
  if (workspace_bytes < AttentionWorkspaceBytes(cache, params, n_queries, sm_count)) {
    return cudaErrorInvalidValue;
  }
  const Plan plan = MakePlan(cache, params, n_queries, sm_count);
  Problem p;
  p.cache = cache;
  for (const auto& [layout, table] : {std::make_pair(&cache.key_layout, p.key_centroids),
                                      std::make_pair(&cache.value_layout, p.value_centroids)}) {
    const float* centroids = LayoutCentroids(*layout);
    for (int i = 0; i < 16; ++i) table[i] = centroids != nullptr ? centroids[i] : 0.0f;
  }
  p.q_heads = params.q_heads;
  p.group = params.q_heads / cache.kv_heads;
  p.row_chunks = plan.row_chunks;
  p.splits = plan.splits;
  p.chunk = plan.chunk;
  p.scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.softcap = params.softcap;
  p.window = params.window;
  p.first_query = 0;
  p.positions = positions;
  float* q_rot = static_cast<float*>(workspace);
  p.q_rot = q_rot;
  p.partials = q_rot + static_cast<size_t>(n_queries) * params.q_heads * d;

  const unsigned rows = static_cast<unsigned>(n_queries * params.q_heads);
  if (cache.key_layout.block_values == 128 || TurboBits(cache.key_layout.kind) == 0) {
    RotateQueriesKernel<4><<<rows, 32, 0, stream>>>(p, q, q_rot);
  } else {
    RotateQueriesKernel<2><<<rows, 32, 0, stream>>>(p, q, q_rot);
  }
  const size_t shared =
      (kRowsPerBlock * d + kWarps * kRowsPerBlock * d + kWarps * kRowsPerBlock * 2 + 32) * sizeof(float);
  // grid.z is at most 65535: long prefills launch in slices of queries.
  const int64_t queries_per_launch = 65535 / plan.row_chunks;
  for (int64_t first = 0; first < n_queries; first += queries_per_launch) {
    p.first_query = first;
    const int64_t count = std::min(queries_per_launch, n_queries - first);
    const dim3 grid(cache.kv_heads, plan.splits, static_cast<unsigned>(count * plan.row_chunks));
    if (d == 128) {
      SplitKernel<true><<<grid, 32 * kWarps, shared, stream>>>(p);
    } else {
      SplitKernel<false><<<grid, 32 * kWarps, shared, stream>>>(p);
    }
  }
  const size_t merge_shared = (kMaxCudaHeadDim + kMaxSplits + kMergeThreads / 32) * sizeof(float);
  if (cache.value_layout.block_values == 128 || TurboBits(cache.value_layout.kind) == 0) {
    MergeKernel<4><<<rows, kMergeThreads, merge_shared, stream>>>(p, out, lse);
  } else {
    MergeKernel<2><<<rows, kMergeThreads, merge_shared, stream>>>(p, out, lse);
  }
  return cudaGetLastError();
}

}  // namespace turbokv::cuda
