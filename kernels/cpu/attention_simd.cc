// Highway SIMD scan of the CPU attention (compiled once per target, dispatched
// at run time). Tiles of up to 32 tokens: each key record is decoded once for
// all query rows of its GQA group and scored, then the tile's softmax update
// runs vectorized over tokens, then each value record is decoded once and
// accumulated into every row.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include "kernels/block_math.h"
#include "kernels/codebooks.h"
#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/turbo_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace turbokv {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kTile = 32;

// Decodes one record into the kernel's domain (see DecodeRow in attention.cc);
// `out` is aligned.
void DecodeRowSimd(const CodecLayout& layout, const float* centroids, const uint8_t* in,
                   float* HWY_RESTRICT out) {
  const int bits = TurboBits(layout.kind);
  if (bits != 0) {
    for (int b = 0; b < layout.blocks; ++b) {
      const uint8_t* block = in + static_cast<size_t>(b) * layout.block_bytes;
      float* w = out + b * layout.block_values;
      if (layout.block_values == 128) {
        if (bits == 2) DecodeTurboBlockRotated<128, 2>(block, centroids, w);
        if (bits == 3) DecodeTurboBlockRotated<128, 3>(block, centroids, w);
        if (bits == 4) DecodeTurboBlockRotated<128, 4>(block, centroids, w);
      } else {
        if (bits == 2) DecodeTurboBlockRotated<64, 2>(block, centroids, w);
        if (bits == 3) DecodeTurboBlockRotated<64, 3>(block, centroids, w);
        if (bits == 4) DecodeTurboBlockRotated<64, 4>(block, centroids, w);
      }
    }
    return;
  }
  switch (layout.kind) {
    case CodecKind::kF16: {
      int i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
      const hn::ScalableTag<float> d;
      const hn::Rebind<hwy::float16_t, decltype(d)> dh;
      const auto* h = reinterpret_cast<const hwy::float16_t*>(in);
      const int lanes = static_cast<int>(hn::Lanes(d));
      for (; i + lanes <= layout.head_dim; i += lanes) hn::Store(hn::PromoteTo(d, hn::LoadU(dh, h + i)), d, out + i);
#endif
      for (; i < layout.head_dim; ++i) out[i] = HalfBitsToFloat(LoadHalfBits(in + 2 * i));
      return;
    }
    case CodecKind::kQ8_0:
      for (int b = 0; b < layout.blocks; ++b) DecodeQ8Block(in + b * kQ8BlockBytes, out + b * kGgmlBlockValues);
      return;
    default:
      for (int b = 0; b < layout.blocks; ++b) DecodeQ4Block(in + b * kQ4BlockBytes, out + b * kGgmlBlockValues);
      return;
  }
}

void Scan(const ScanTask& task, ScanState* state) {
  const PagedKvCache& c = *task.cache;
  const int dim = c.key_layout.head_dim;
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const Codebook* key_cb = TurboBits(c.key_layout.kind)
                               ? FindCodebook(c.key_layout.block_values, TurboBits(c.key_layout.kind))
                               : nullptr;
  const Codebook* value_cb =
      TurboBits(c.value_layout.kind)
          ? FindCodebook(c.value_layout.block_values, TurboBits(c.value_layout.kind))
          : nullptr;
  const float* key_table = key_cb ? key_cb->centroids : nullptr;
  const float* value_table = value_cb ? value_cb->centroids : nullptr;

  auto row_buffer = hwy::AllocateAligned<float>(dim);
  auto logits = hwy::AllocateAligned<float>(static_cast<size_t>(task.rows) * kTile);
  float* k = row_buffer.get();
  float* v = row_buffer.get();

  for (int64_t t0 = task.begin; t0 < task.end;) {
    // A tile never crosses a page.
    const int64_t page_end = (t0 / c.page_tokens + 1) * c.page_tokens;
    const int n = static_cast<int>(std::min<int64_t>({kTile, task.end - t0, page_end - t0}));

    // Scores: decode each key once, dot it with every row.
    for (int j = 0; j < n; ++j) {
      DecodeRowSimd(c.key_layout, key_table, c.key_record(task.head, t0 + j), k);
      for (int r = 0; r < task.rows; ++r) {
        const float* q = task.q + static_cast<size_t>(r) * dim;
        auto acc0 = hn::Zero(d), acc1 = hn::Zero(d);
        for (int i = 0; i < dim; i += 2 * lanes) {
          acc0 = hn::MulAdd(hn::LoadU(d, q + i), hn::Load(d, k + i), acc0);
          acc1 = hn::MulAdd(hn::LoadU(d, q + i + lanes), hn::Load(d, k + i + lanes), acc1);
        }
        logits[r * kTile + j] = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
      }
    }

    // Softmax update per row, vectorized over the tile.
    const auto scale = hn::Set(d, task.scale);
    const auto cap = hn::Set(d, task.softcap);
    const auto inv_cap = hn::Set(d, task.softcap > 0.0f ? 1.0f / task.softcap : 0.0f);
    for (int r = 0; r < task.rows; ++r) {
      float* lr = logits.get() + r * kTile;
      const int query = r / task.group;
      const int64_t lo = std::max<int64_t>(task.first[query] - t0, 0);
      const int64_t hi = std::min<int64_t>(task.last[query] - t0 + 1, n);  // visible: [lo, hi)
      if (lo >= hi) {  // nothing visible: no weight on any token of the tile
        for (int j = 0; j < kTile; ++j) lr[j] = 0.0f;
        continue;
      }
      float tile_max = -INFINITY;
      for (int j = 0; j < kTile; j += lanes) {
        auto x = hn::Mul(hn::Load(d, lr + j), scale);
        if (task.softcap > 0.0f) x = hn::Mul(cap, hn::Tanh(d, hn::Mul(x, inv_cap)));
        hn::Store(x, d, lr + j);
      }
      for (int j = 0; j < kTile; ++j) {
        if (j < lo || j >= hi) {
          lr[j] = -INFINITY;
        } else {
          tile_max = std::max(tile_max, lr[j]);
          if (task.top_k > 0) state->top[r].Push(lr[j], t0 + j);
        }
      }
      const float m_old = state->m[r];
      const float m_new = std::max(m_old, tile_max);
      const float correction = std::exp(m_old - m_new);
      const auto m = hn::Set(d, m_new);
      const auto floor = hn::Set(d, -100.0f);
      auto sum = hn::Zero(d);
      for (int j = 0; j < kTile; j += lanes) {
        const auto x = hn::Load(d, lr + j);
        const auto visible = hn::Gt(x, hn::Set(d, -INFINITY));
        const auto p = hn::IfThenElseZero(visible, hn::Exp(d, hn::Max(hn::Sub(x, m), floor)));
        hn::Store(p, d, lr + j);
        sum = hn::Add(sum, p);
      }
      if (correction != 1.0f) {
        float* acc = state->acc.data() + static_cast<size_t>(r) * dim;
        const auto corr = hn::Set(d, correction);
        for (int i = 0; i < dim; i += lanes) hn::StoreU(hn::Mul(hn::LoadU(d, acc + i), corr), d, acc + i);
      }
      state->l[r] = state->l[r] * correction + hn::GetLane(hn::SumOfLanes(d, sum));
      state->m[r] = m_new;
    }

    // Values: decode each once, accumulate into every row it has weight in.
    for (int j = 0; j < n; ++j) {
      DecodeRowSimd(c.value_layout, value_table, c.value_record(task.head, t0 + j), v);
      for (int r = 0; r < task.rows; ++r) {
        const float weight = logits[r * kTile + j];
        if (weight == 0.0f) continue;
        const auto p = hn::Set(d, weight);
        float* acc = state->acc.data() + static_cast<size_t>(r) * dim;
        for (int i = 0; i < dim; i += lanes) {
          hn::StoreU(hn::MulAdd(p, hn::Load(d, v + i), hn::LoadU(d, acc + i)), d, acc + i);
        }
      }
    }
    t0 += n;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace turbokv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace turbokv {

HWY_EXPORT(Scan);

void ScanSimd(const ScanTask& task, ScanState* state) { HWY_DYNAMIC_DISPATCH(Scan)(task, state); }

}  // namespace turbokv
#endif  // HWY_ONCE
