#include "kernels/mma_emulation.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels/codebooks.h"
#include "kernels/rotation.h"

namespace turbokv::mma {
namespace {

// The unit table of a codec's codes (its codebook's, for turbo).
UnitTable TableOf(const CodecLayout& layout) {
  UnitTable table{};
  const int bits = TurboBits(layout.kind);
  for (const Codebook& cb : kCodebooks) {
    if (bits != 0 && cb.block_values == layout.block_values && cb.bits == bits) MakeUnitTable(cb.centroids, 1 << bits, &table);
  }
  return table;
}

// One side's token group of head `head` holding `token`.
template <CodecKind K, int D>
Group<K, D> GroupOf(const PagedKvCache& cache, bool values, int head, int64_t token) {
  const SlotShape shape = cache.slots();
  const int64_t slot = token % cache.page_tokens;
  const CodecLayout& layout = values ? cache.value_layout : cache.key_layout;
  const size_t region = values ? shape.values_offset(head) : shape.keys_offset(head);
  return Group<K, D>{cache.pages[token / cache.page_tokens] + region +
                         static_cast<size_t>(slot / kTile) * kTile * layout.code_size(),
                     layout};
}

template <int D, int NT, CodecKind K, CodecKind V>
void Emulate(const PagedKvCache& cache, const AttentionParams& params, const AttentionQueries& queries,
             const AttentionOutput& output, const EmulatedLaunch& launch) {
  const int group = params.q_heads / cache.kv_heads;
  const int chunk_rows = 8 * NT;
  const float scale = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(D));
  const UnitTable key_table = TableOf(cache.key_layout), value_table = TableOf(cache.value_layout);
  const bool turbo_keys = TurboBits(cache.key_layout.kind) != 0;
  const bool turbo_values = TurboBits(cache.value_layout.kind) != 0;
  // The rotations of turbo keys (the queries into their domain) and values
  // (the outputs back).
  std::unique_ptr<HadamardRotation> key_rotation, value_rotation;
  if (turbo_keys) key_rotation = std::make_unique<HadamardRotation>(D, cache.key_layout.block_values, cache.key_seed);
  if (turbo_values) {
    value_rotation = std::make_unique<HadamardRotation>(D, cache.value_layout.block_values, cache.value_seed);
  }
  HostWarp w;
  auto qs = std::make_unique<QuerySide<D, NT>>();
  auto state = std::make_unique<HostWarp::R<WarpRows<D, NT>>>();
  constexpr size_t kStride = D + 2;
  std::vector<float> q_rot(static_cast<size_t>(params.q_heads) * D);
  for (int64_t n = 0; n < queries.n; ++n) {
    const int64_t position = queries.positions[n];
    const int64_t window_first = params.window > 0 ? std::max<int64_t>(0, position - params.window + 1) : 0;
    const int64_t first = std::max(window_first, cache.first_token);
    const int64_t last = std::min(position, cache.tokens - 1);
    std::copy_n(queries.q + n * params.q_heads * D, q_rot.size(), q_rot.begin());
    if (turbo_keys) {
      for (int h = 0; h < params.q_heads; ++h) {
        for (int b = 0; b < cache.key_layout.blocks; ++b) {
          key_rotation->Forward(b, q_rot.data() + h * D + b * cache.key_layout.block_values);
        }
      }
    }
    for (int head = 0; head < cache.kv_heads; ++head) {
      for (int r0 = 0; r0 < group; r0 += chunk_rows) {
        const int rows = std::min(chunk_rows, group - r0);
        const int q0 = head * group + r0;  // the chunk's first query head
        qs->rows = rows;
        for (int r = 0; r < chunk_rows; ++r) {
          qs->offset[r] = r < rows && queries.logit_offset != nullptr ? queries.logit_offset[n * params.q_heads + q0 + r] : 0.0f;
        }
        for (int k = 0; k < D / 16; ++k) {
          for (int j = 0; j < NT; ++j) {
            for (int lane = 0; lane < 32; ++lane) {
              uint32_t* f = qs->frag[k][j][lane];
              QueryFragment(cache.key_layout, q_rot.data() + q0 * D, rows, D, lane, k, j, f, f + 2);
            }
          }
        }
        // Every split's partial state of each row.
        std::vector<float> partials;
        for (int64_t begin = 0; begin < std::max<int64_t>(cache.tokens, 1); begin += launch.split_tokens) {
          const int64_t end = std::min(begin + launch.split_tokens, cache.tokens);
          std::vector<float> warp_rows(static_cast<size_t>(launch.warps) * chunk_rows * kStride, -INFINITY);
          for (int wi = 0; wi < launch.warps; ++wi) {
            for (int lane = 0; lane < 32; ++lane) ResetRows((*state)[lane]);
            for (int64_t g = begin / kTile + wi; g * kTile < end; g += launch.warps) {
              const int64_t t0 = g * kTile;
              if (t0 + kTile - 1 < first || t0 > last) continue;
              const TileArgs<K, V, D> args{GroupOf<K, D>(cache, false, head, t0), GroupOf<V, D>(cache, true, head, t0),
                                           &key_table, &value_table, t0, first, last, scale, params.softcap,
                                           nullptr, 0};
              AttendGroup<HostWarp, D, NT, K, V>(w, *qs, args, *state);
            }
            FinishRows<HostWarp, D, NT>(w, *state);
            float* out = warp_rows.data() + static_cast<size_t>(wi) * chunk_rows * kStride;
            for (int lane = 0; lane < 32; ++lane) StoreRows((*state)[lane], cache.value_layout, lane, rows, out);
          }
          for (int r = 0; r < rows; ++r) {
            for (int i = 0; i < static_cast<int>(kStride); ++i) {
              partials.push_back(CombineRowSlot(warp_rows.data() + r * kStride, launch.warps, chunk_rows * kStride, i));
            }
          }
        }
        // The merge kernel's work: splits combined, normalized, rotated back.
        const size_t splits = partials.size() / (rows * kStride);
        for (int r = 0; r < rows; ++r) {
          float m = -INFINITY;
          for (size_t s = 0; s < splits; ++s) m = std::max(m, partials[(s * rows + r) * kStride]);
          float sum = 0.0f;
          std::vector<float> acc(D, 0.0f);
          for (size_t s = 0; s < splits; ++s) {
            const float* part = partials.data() + (s * rows + r) * kStride;
            if (part[0] == -INFINITY) continue;
            const float weight = std::exp(part[0] - m);
            sum += part[1] * weight;
            for (int i = 0; i < D; ++i) acc[i] += part[2 + i] * weight;
          }
          const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
          for (float& a : acc) a *= inv;
          if (turbo_values) {
            for (int b = 0; b < cache.value_layout.blocks; ++b) {
              value_rotation->Inverse(b, acc.data() + b * cache.value_layout.block_values);
            }
          }
          const int64_t row = n * params.q_heads + q0 + r;
          std::copy(acc.begin(), acc.end(), output.out + row * D);
          output.lse[row] = sum > 0.0f ? m + std::log(sum) : -INFINITY;
        }
      }
    }
  }
}

template <int D, int NT>
void EmulatePair(const PagedKvCache& cache, const AttentionParams& params, const AttentionQueries& queries,
                 const AttentionOutput& output, const EmulatedLaunch& launch) {
  const CodecKind k = cache.key_layout.kind, v = cache.value_layout.kind;
  if (!launch.fast_paths) return Emulate<D, NT, kAnyCodec, kAnyCodec>(cache, params, queries, output, launch);
  if (k == CodecKind::kTurbo4 && v == CodecKind::kTurbo4) {
    return Emulate<D, NT, CodecKind::kTurbo4, CodecKind::kTurbo4>(cache, params, queries, output, launch);
  }
  if (k == CodecKind::kTurbo3 && v == CodecKind::kTurbo3) {
    return Emulate<D, NT, CodecKind::kTurbo3, CodecKind::kTurbo3>(cache, params, queries, output, launch);
  }
  if (k == CodecKind::kF16 && v == CodecKind::kF16) {
    return Emulate<D, NT, CodecKind::kF16, CodecKind::kF16>(cache, params, queries, output, launch);
  }
  return Emulate<D, NT, kAnyCodec, kAnyCodec>(cache, params, queries, output, launch);
}

}  // namespace

void EmulateTensorCoreAttention(const PagedKvCache& cache, const AttentionParams& params,
                                const AttentionQueries& queries, const AttentionOutput& output,
                                const EmulatedLaunch& launch) {
  const int d = cache.key_layout.head_dim;
  const bool two_tiles = params.q_heads / cache.kv_heads > 8 && d <= 128;
  switch (d) {
    case 64:
      return two_tiles ? EmulatePair<64, 2>(cache, params, queries, output, launch)
                       : EmulatePair<64, 1>(cache, params, queries, output, launch);
    case 128:
      return two_tiles ? EmulatePair<128, 2>(cache, params, queries, output, launch)
                       : EmulatePair<128, 1>(cache, params, queries, output, launch);
    default:
      return EmulatePair<256, 1>(cache, params, queries, output, launch);
  }
}

}  // namespace turbokv::mma
