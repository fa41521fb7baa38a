// The tensor-core split kernel: kernels/mma_tile.h's arithmetic on CUDA
// threads, over caches in the token-group order. A block is a unit of the
// plan (problem, query, row chunk of 8 or 16 query heads, kv head, split);
// its warps take the split's token groups in turn, each through a pipeline
// of cp.async stages in shared memory of its own (no block-wide barrier
// between groups), then the warps' states are combined into the unit's
// partial state, which the merge kernel of attention_kernels.cu finishes.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/attention_launch.cuh"
#include "kernels/cuda/codebooks.cuh"
#include "kernels/mma_tile.h"

namespace turbokv::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// A warp of CUDA threads for mma_tile.h: a lane's values in its registers.
struct DeviceWarp {
  template <class T>
  struct R {
    T v;
    __device__ __forceinline__ T& operator[](int) { return v; }
    __device__ __forceinline__ const T& operator[](int) const { return v; }
  };

  int lane;

  template <class F>
  __device__ __forceinline__ void Lanes(F f) {
    f(lane);
  }

  template <class C, class A, class B>
  __device__ __forceinline__ void Mma(C c, A a, B b) {
    float* d = c(lane);
    const uint32_t* x = a(lane);
    const uint32_t* y = b(lane);
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));
  }

  template <class X>
  __device__ __forceinline__ void Transpose(X x, int n) {
    uint32_t* words = x(lane);
    TURBOKV_UNROLL
    for (int i = 0; i < n; ++i) asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(words[i]) : "r"(words[i]));
  }

  template <class X>
  __device__ __forceinline__ void MaxOverGroups(X x, int n) {
    OverGroups(x, n, [](float a, float b) { return fmaxf(a, b); });
  }
  template <class X>
  __device__ __forceinline__ void SumOverGroups(X x, int n) {
    OverGroups(x, n, [](float a, float b) { return a + b; });
  }
  // Each of the lane's n values combined with `op` over the 8 groups (the
  // lanes of its quad position).
  template <class X, class Op>
  __device__ __forceinline__ void OverGroups(X x, int n, Op op) {
    float* v = x(lane);
    TURBOKV_UNROLL
    for (int i = 0; i < n; ++i) {
      TURBOKV_UNROLL
      for (int step = 4; step < 32; step *= 2) v[i] = op(v[i], __shfl_xor_sync(kFullMask, v[i], step));
    }
  }

  __device__ __forceinline__ float Exp2(float x) const {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
};

__device__ __forceinline__ void CopyAsync16(uint8_t* shared, const uint8_t* global) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

using mma::kAnyCodec;

template <int D, int NT>
__host__ __device__ constexpr size_t HeaderBytes() {
  return (sizeof(mma::QuerySide<D, NT>) + 2 * sizeof(mma::UnitTable) + 15) / 16 * 16;
}

// (The codecs as ints: nvcc's host stubs cannot spell kAnyCodec, an enum
// value without a name.)
template <int D, int NT, int kWarps, int kStages, int kKey, int kValue>
__global__ void __launch_bounds__(32 * kWarps, 2) TensorCoreSplitKernel(Launch l, int64_t units, int stage_bytes) {
  constexpr CodecKind K = static_cast<CodecKind>(kKey), V = static_cast<CodecKind>(kValue);
  extern __shared__ __align__(16) uint8_t smem[];
  auto& qs = *reinterpret_cast<mma::QuerySide<D, NT>*>(smem);
  mma::UnitTable* tables = reinterpret_cast<mma::UnitTable*>(smem + sizeof(mma::QuerySide<D, NT>));
  uint8_t* work = smem + HeaderBytes<D, NT>();  // the warps' stages; after the groups, their rows
  constexpr int kStride = D + 2;
  constexpr int kRows = 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  DeviceWarp w{lane};
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const DeviceProblem& p = l.problems[ProblemOfUnit(l.problems, l.count, unit)];
    const Unit u = UnitOf(p, unit, l.row_chunks);
    const CodecLayout kl = K == kAnyCodec ? p.cache.key_layout : MakeCodecLayout(K, D);
    const CodecLayout vl = V == kAnyCodec ? p.cache.value_layout : MakeCodecLayout(V, D);
    const int g0 = u.row_chunk * kRows;
    const int rows = min(kRows, l.group - g0);
    const int64_t local_row0 = u.query * l.q_heads + u.head * l.group + g0;
    const float* q = l.q_rot + (p.first_row + local_row0) * D;
    for (int i = threadIdx.x; i < (D / 16) * NT * 32; i += blockDim.x) {
      const int ln = i & 31, j = (i >> 5) % NT, k = (i >> 5) / NT;
      uint32_t* f = qs.frag[k][j][ln];
      mma::QueryFragment(kl, q, rows, D, ln, k, j, f, f + 2);
    }
    if (threadIdx.x < kRows) {
      qs.offset[threadIdx.x] =
          p.logit_offset != nullptr && static_cast<int>(threadIdx.x) < rows ? p.logit_offset[local_row0 + threadIdx.x] : 0.0f;
    }
    if (threadIdx.x == 0) qs.rows = rows;
    if (threadIdx.x < 2) {
      const int bits = TurboBits(threadIdx.x == 0 ? kl.kind : vl.kind);
      const int block_values = threadIdx.x == 0 ? kl.block_values : vl.block_values;
      if (bits != 0) mma::MakeUnitTable(DeviceCodebook(block_values, bits).centroids, 1 << bits, &tables[threadIdx.x]);
    }
    __syncthreads();

    const VisibleTokens visible = Visible(p.positions[u.query], l.window, p.cache);
    const int64_t begin = max(visible.first, u.split * p.chunk);
    const int64_t end = min(visible.last + 1, (u.split + 1) * p.chunk);
    const int64_t first_group = begin / mma::kTile;
    const int64_t groups = end > begin ? (end + mma::kTile - 1) / mma::kTile - first_group : 0;
    const int mine = groups > warp ? static_cast<int>((groups - warp + kWarps - 1) / kWarps) : 0;  // this warp's: warp, warp + kWarps, ...
    const SlotShape shape{p.cache.kv_heads, p.cache.page_tokens, static_cast<int32_t>(kl.code_size()),
                          static_cast<int32_t>(vl.code_size())};
    const int key_group_bytes = mma::kTile * shape.key_bytes, value_group_bytes = mma::kTile * shape.value_bytes;
    // A group's place: its page, and its place in the page's head regions
    // (32-bit: a cache holds fewer than 2^31 groups).
    const size_t keys_at = shape.keys_offset(u.head), values_at = shape.values_offset(u.head);
    const uint32_t groups_a_page = static_cast<uint32_t>(shape.page_tokens / mma::kTile);
    uint8_t* stages = work + static_cast<size_t>(warp) * kStages * stage_bytes;
    auto fetch = [&](int i) {
      const uint32_t group = static_cast<uint32_t>(first_group + warp + i * kWarps);
      const uint32_t page = group / groups_a_page, in_page = group - page * groups_a_page;
      const uint8_t* base = p.cache.pages[page];
      uint8_t* stage = stages + (i % kStages) * stage_bytes;
      const uint8_t* keys = base + keys_at + in_page * key_group_bytes;
      const uint8_t* values = base + values_at + in_page * value_group_bytes;
      for (int at = 16 * lane; at < key_group_bytes; at += 16 * 32) CopyAsync16(stage + at, keys + at);
      for (int at = 16 * lane; at < value_group_bytes; at += 16 * 32) CopyAsync16(stage + key_group_bytes + at, values + at);
    };
    float* logits = l.top_k > 0 ? l.logits + p.first_logit + local_row0 * p.cache.tokens : nullptr;
    DeviceWarp::R<mma::WarpRows<D, NT>> state;
    mma::ResetRows(state[lane]);
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < mine) fetch(s);
      CopyAsyncCommit();
    }
    for (int i = 0; i < mine; ++i) {
      CopyAsyncWait<kStages - 2>();
      __syncwarp();
      if (i + kStages - 1 < mine) fetch(i + kStages - 1);
      CopyAsyncCommit();
      const uint8_t* stage = stages + (i % kStages) * stage_bytes;
      const mma::TileArgs<K, V, D> args{mma::Group<K, D>{stage, kl},
                                        mma::Group<V, D>{stage + key_group_bytes, vl},
                               &tables[0],
                               &tables[1],
                               (first_group + warp + i * kWarps) * mma::kTile,
                               visible.first,
                               visible.last,
                               l.scale,
                               l.softcap,
                               logits,
                               p.cache.tokens};
      mma::AttendGroup<DeviceWarp, D, NT, K, V>(w, qs, args, state);
      __syncwarp();  // before the next fetch refills this stage
    }
    CopyAsyncWait<0>();
    mma::FinishRows<DeviceWarp, D, NT>(w, state);
    __syncthreads();  // every warp is done with its stages: they become the warps' rows
    float* rows_out = reinterpret_cast<float*>(work);
    mma::StoreRows<D, NT>(state[lane], vl, lane, rows, rows_out + warp * kRows * kStride);
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kStride; i += blockDim.x) {
      const int r = i / kStride, slot = i - r * kStride;
      float* out = l.partials + (p.first_partial + (local_row0 + r) * p.splits + u.split) * static_cast<size_t>(kStride);
      out[slot] = mma::CombineRowSlot(rows_out + r * kStride, kWarps, kRows * kStride, slot);
    }
    __syncthreads();  // the next unit rebuilds the query side and reuses the stages
  }
}

// What the kernel runs when the caller names no variant: {4, 2} for every
// shape until a GPU's sweep (scripts/gpu-run.sh) fills this in.
constexpr TensorCoreVariant kDefaultVariant{4, 2};

template <int D, int NT, int kWarps, int kStages, CodecKind K, CodecKind V>
cudaError_t Run(const Launch& l, int64_t units, int stage_bytes, cudaStream_t stream) {
  constexpr size_t kRowsBytes = size_t{kWarps} * 8 * NT * (D + 2) * sizeof(float);
  const size_t shared =
      HeaderBytes<D, NT>() + std::max(static_cast<size_t>(kWarps) * kStages * stage_bytes, kRowsBytes);
  auto kernel = TensorCoreSplitKernel<D, NT, kWarps, kStages, static_cast<int>(K), static_cast<int>(V)>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)) !=
      cudaSuccess) {
    return cudaGetLastError();
  }
  constexpr int64_t kMaxGrid = 0x7fffffff;
  kernel<<<static_cast<unsigned>(std::min(units, kMaxGrid)), 32 * kWarps, shared, stream>>>(l, units, stage_bytes);
  return cudaGetLastError();
}

// The pairs with kernels of their own: the presets' and the f16 baseline's.
constexpr bool OwnPair(CodecKind k, CodecKind v) {
  return k == v && (k == CodecKind::kTurbo4 || k == CodecKind::kTurbo3 || k == CodecKind::kF16);
}

// An OwnPair's kernel in a variant.
template <int D, int NT, int W, int S>
cudaError_t RunOwnPair(const Launch& l, CodecKind k, int64_t units, int stage_bytes, cudaStream_t stream) {
  if (k == CodecKind::kTurbo4) return Run<D, NT, W, S, CodecKind::kTurbo4, CodecKind::kTurbo4>(l, units, stage_bytes, stream);
  if (k == CodecKind::kTurbo3) return Run<D, NT, W, S, CodecKind::kTurbo3, CodecKind::kTurbo3>(l, units, stage_bytes, stream);
  return Run<D, NT, W, S, CodecKind::kF16, CodecKind::kF16>(l, units, stage_bytes, stream);
}

// The variants the sweep times besides the default (d = 128, one n-tile,
// the pairs of their own).
constexpr TensorCoreVariant kSweptVariants[] = {{4, 3}, {8, 2}, {2, 4}};

constexpr bool Same(TensorCoreVariant a, TensorCoreVariant b) { return a.warps == b.warps && a.stages == b.stages; }

// A shape's kernel in a variant TensorCoreVariantCompiled takes: the
// default for every pair (every other pair runs the kernel that reads
// them all), the swept ones for the pairs of their own.
template <int D, int NT>
cudaError_t RunShape(const Launch& l, CodecKind k, CodecKind v, int64_t units, int stage_bytes, cudaStream_t stream,
                     TensorCoreVariant variant) {
  constexpr int W = kDefaultVariant.warps, S = kDefaultVariant.stages;
  if (variant.warps == 0 || Same(variant, kDefaultVariant)) {
    if (OwnPair(k, v)) return RunOwnPair<D, NT, W, S>(l, k, units, stage_bytes, stream);
    return Run<D, NT, W, S, kAnyCodec, kAnyCodec>(l, units, stage_bytes, stream);
  }
  if constexpr (D == 128 && NT == 1) {
    if (!OwnPair(k, v)) return cudaErrorInvalidValue;
    constexpr TensorCoreVariant a = kSweptVariants[0], b = kSweptVariants[1], c = kSweptVariants[2];
    if (Same(variant, a)) return RunOwnPair<D, NT, a.warps, a.stages>(l, k, units, stage_bytes, stream);
    if (Same(variant, b)) return RunOwnPair<D, NT, b.warps, b.stages>(l, k, units, stage_bytes, stream);
    if (Same(variant, c)) return RunOwnPair<D, NT, c.warps, c.stages>(l, k, units, stage_bytes, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool TensorCoreVariantCompiled(int head_dim, int rows_per_block, CodecKind keys, CodecKind values,
                               TensorCoreVariant variant) {
  if ((variant.warps == 0 && variant.stages == 0) || Same(variant, kDefaultVariant)) return true;
  if (head_dim != 128 || rows_per_block != 8 || !OwnPair(keys, values)) return false;
  for (const TensorCoreVariant& swept : kSweptVariants) {
    if (Same(swept, variant)) return true;
  }
  return false;
}

cudaError_t LaunchTensorCoreSplit(const Launch& l, const DeviceProblem* host_problems, int64_t units,
                                  cudaStream_t stream, TensorCoreVariant variant) {
  if (units == 0) return cudaSuccess;
  // The largest group a stage holds, and the codec pair when every problem
  // has the same one.
  size_t group_bytes = 0;
  CodecKind k = host_problems[0].cache.key_layout.kind, v = host_problems[0].cache.value_layout.kind;
  for (int64_t i = 0; i < l.count; ++i) {
    const PagedKvCache& c = host_problems[i].cache;
    group_bytes = std::max(group_bytes, mma::kTile * (c.key_layout.code_size() + c.value_layout.code_size()));
    if (c.key_layout.kind != k || c.value_layout.kind != v) k = v = kAnyCodec;
  }
  const int stage_bytes = static_cast<int>(group_bytes);
  const int rows_per_block = RowsPerBlock(host_problems[0].cache, l.group);
  if (!TensorCoreVariantCompiled(l.head_dim, rows_per_block, k, v, variant)) return cudaErrorInvalidValue;
  const bool two_tiles = rows_per_block == 16;
  switch (l.head_dim) {
    case 64:
      return two_tiles ? RunShape<64, 2>(l, k, v, units, stage_bytes, stream, variant)
                       : RunShape<64, 1>(l, k, v, units, stage_bytes, stream, variant);
    case 128:
      return two_tiles ? RunShape<128, 2>(l, k, v, units, stage_bytes, stream, variant)
                       : RunShape<128, 1>(l, k, v, units, stage_bytes, stream, variant);
    case 256:
      return RunShape<256, 1>(l, k, v, units, stage_bytes, stream, variant);
    default:
      return cudaErrorNotSupported;
  }
}

}  // namespace turbokv::cuda
