#!/usr/bin/env bash
# Runs on a GPU machine from a bundle made by scripts/gpu-bundle.sh: the CUDA
# test suite, then the GPU codec benchmark. Logs go to $OUT when it is set.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$here/bin/cuda_kernels_test" --gtest_brief=1 > "$out/cuda_kernels_test.log" 2>&1
test_rc=$?
tail -5 "$out/cuda_kernels_test.log"
echo "cuda_kernels_test exit code: $test_rc"
for codec in f16 q8_0 q4_0 turbo2 turbo3 turbo4; do
  "$here/bin/turbokv-bench" codec --codec "$codec" --head-dim 128 --vectors 100000 --impl cuda
done 2>&1 | tee "$out/bench.log"
exit $test_rc
