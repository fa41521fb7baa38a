// Marks functions shared by the CPU code and the CUDA kernels. The math that
// must give the same bytes on both (fp16 rounding, signs, quantizer decisions,
// bit packing) lives in such inline functions, so the CPU tests exercise the
// exact code the GPU runs.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TURBOKV_HD __host__ __device__ __forceinline__
#else
#define TURBOKV_HD inline
#endif
// Loops over register arrays unrolled (their indices constants, the arrays
// in registers): nvcc's pragma in device code, nothing on the host.
#if defined(__CUDA_ARCH__)
#define TURBOKV_UNROLL _Pragma("unroll")
#else
#define TURBOKV_UNROLL
#endif

namespace turbokv {

// The last of items[0, count) whose `field` is at most x, for items in
// ascending order of it with items[0].*field <= x: which problem or chunk of
// a batch a block or vector belongs to.
template <class T, class Field>
TURBOKV_HD int64_t LastAtOrBelow(const T* items, int64_t count, Field T::*field, int64_t x) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (items[mid].*field <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace turbokv
