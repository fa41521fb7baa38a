// The codebooks in constant memory, for the kernels of one .cu file (each
// file that includes this has its own copy).
#pragma once

#include "kernels/codebooks.h"

namespace turbokv::cuda {
namespace {

__constant__ Codebook c_codebooks[] = {
#include "kernels/codebooks.inc"
};
constexpr int kCodebookCount = sizeof(kCodebooks) / sizeof(kCodebooks[0]);

// The codebook of `bits`-bit indices for blocks of `block_values`.
__device__ const Codebook& DeviceCodebook(int block_values, int bits) {
  int i = 0;
  while (i + 1 < kCodebookCount &&
         !(c_codebooks[i].block_values == block_values && c_codebooks[i].bits == bits)) {
    ++i;
  }
  return c_codebooks[i];
}

}  // namespace
}  // namespace turbokv::cuda
