// The tensor-core decode kernel (kernels/mma_tile.h) run on the host: a
// warp whose 32 lanes take their turns, with the warp-wide steps (mma,
// movmatrix, reductions over a fragment's column) done on arrays, and the
// kernel's whole cut of a problem (splits, warps a split, each warp's token
// groups, the merge) around it. What a lane computes is the GPU's code; the
// mma's sums and exp2 are the host's float arithmetic. The CPU tests hold
// it to the scalar reference over every codec pair and head dim.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/mma_tile.h"

namespace turbokv::mma {

struct HostWarp {
  template <class T>
  using R = std::array<T, 32>;

  template <class F>
  void Lanes(F f) {
    for (int lane = 0; lane < 32; ++lane) f(lane);
  }

  template <class C, class A, class B>
  void Mma(C c, A a, B b) {
    float am[16][16], bm[16][8];
    for (int lane = 0; lane < 32; ++lane) {
      const uint32_t* ar = a(lane);
      for (int e = 0; e < 8; ++e) am[ARow(lane, e)][ACol(lane, e)] = Half(ar[e >> 1], e & 1);
      const uint32_t* br = b(lane);
      for (int e = 0; e < 4; ++e) bm[BRow(lane, e)][BCol(lane)] = Half(br[e >> 1], e & 1);
    }
    for (int lane = 0; lane < 32; ++lane) {
      float* cr = c(lane);
      for (int e = 0; e < 4; ++e) {
        float sum = 0.0f;  // products of fp16 are exact in f32
        for (int k = 0; k < 16; ++k) sum += am[CRow(lane, e)][k] * bm[k][CCol(lane, e)];
        cr[e] += sum;
      }
    }
  }

  template <class X>
  void Transpose(X x, int n) {
    for (int i = 0; i < n; ++i) {
      uint16_t m[8][8];
      for (int lane = 0; lane < 32; ++lane) {
        for (int s = 0; s < 2; ++s) m[lane >> 2][2 * (lane & 3) + s] = static_cast<uint16_t>(x(lane)[i] >> (16 * s));
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int r = lane >> 2, c = 2 * (lane & 3);
        x(lane)[i] = PackHalves(m[c][r], m[c + 1][r]);
      }
    }
  }

  template <class X>
  void MaxOverGroups(X x, int n) {
    OverGroups(x, n, [](float a, float b) { return fmaxf(a, b); });
  }
  template <class X>
  void SumOverGroups(X x, int n) {
    OverGroups(x, n, [](float a, float b) { return a + b; });
  }

  float Exp2(float x) const { return exp2f(x); }

 private:
  static float Half(uint32_t word, int s) { return HalfBitsToFloat(static_cast<uint16_t>(word >> (16 * s))); }

  // The GPU's butterfly over lane bits 2, 3, 4 (xor 4, 8, 16).
  template <class X, class Op>
  void OverGroups(X x, int n, Op op) {
    for (int i = 0; i < n; ++i) {
      for (int step = 4; step < 32; step *= 2) {
        float v[32];
        for (int lane = 0; lane < 32; ++lane) v[lane] = x(lane)[i];
        for (int lane = 0; lane < 32; ++lane) x(lane)[i] = op(v[lane], v[lane ^ step]);
      }
    }
  }
};

// How the kernel cuts a problem: splits of the cache by position (the
// plan's SplitTokens), `warps` warps a split taking its token groups in
// turn, the query heads of a kv head's group in chunks of 8 * NT rows.
struct EmulatedLaunch {
  int warps = 4;
  int64_t split_tokens = 512;
  // The kernels of their own that the GPU runs for turbo4, turbo3 and f16
  // pairs; false: every pair value by value (kAnyCodec).
  bool fast_paths = true;
};

// Attention over one problem of a cache in PageOrder::kTokenGroups, as the
// kernel computes it (params as AttendCpu's; no top-k): outputs and
// log-sum-exps into `output`. The queries are rotated into the key domain
// and the values back as the kernels do. head_dim 64, 128 or 256.
void EmulateTensorCoreAttention(const PagedKvCache& cache, const AttentionParams& params,
                                const AttentionQueries& queries, const AttentionOutput& output,
                                const EmulatedLaunch& launch = {});

}  // namespace turbokv::mma
