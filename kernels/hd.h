// Marks functions shared by the CPU code and the CUDA kernels. The math that
// must give the same bytes on both (fp16 rounding, signs, quantizer decisions,
// bit packing) lives in such inline functions, so the CPU tests exercise the
// exact code the GPU runs.
#pragma once

#if defined(__CUDACC__)
#define TURBOKV_HD __host__ __device__ __forceinline__
#else
#define TURBOKV_HD inline
#endif
