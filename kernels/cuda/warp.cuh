// Warp-level building blocks shared by the CUDA kernels.
#pragma once

namespace turbokv::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// In-warp H * v over one block; lane holds values lane * V .. lane * V + V - 1.
template <int V>
__device__ __forceinline__ void WarpFwht(float (&v)[V], int lane) {
  for (int h = 1; h < V; h *= 2) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if ((k & h) == 0) {
        const float a = v[k];
        const float b = v[k + h];
        v[k] = a + b;
        v[k + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int lane_step = 1; lane_step < 32; lane_step *= 2) {
    const bool upper = (lane & lane_step) != 0;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float other = __shfl_xor_sync(kFullMask, v[k], lane_step);
      v[k] = upper ? other - v[k] : v[k] + other;
    }
  }
}

// Sum over the warp, returned to every lane.
template <class T>
__device__ __forceinline__ T WarpSum(T x) {
#pragma unroll
  for (int step = 16; step > 0; step /= 2) x += __shfl_xor_sync(kFullMask, x, step);
  return x;
}

// Maximum over the warp, returned to every lane.
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int step = 16; step > 0; step /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, step));
  return x;
}

}  // namespace turbokv::cuda
