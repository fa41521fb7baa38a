#!/usr/bin/env bash
# Runs on a GPU machine from a bundle made by scripts/gpu-bundle.sh: the CUDA
# test suite, then the GPU codec and attention benchmarks. Logs go to $OUT
# when it is set.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$here/bin/cuda_kernels_test" --gtest_brief=1 > "$out/cuda_kernels_test.log" 2>&1
test_rc=$?
grep -E "FAILED|Failure|error" "$out/cuda_kernels_test.log" | head -20
tail -3 "$out/cuda_kernels_test.log"
echo "cuda_kernels_test exit code: $test_rc"
{
  "$here/bin/turbokv-bench" codec --codec all --head-dim 128 --vectors 100000 --impl cuda
  for tokens in 16384 65536 131072; do
    "$here/bin/turbokv-bench" attend --k-codec turbo3 --v-codec turbo3 --tokens "$tokens" \
      --kv-heads 8 --q-heads 32 --head-dim 128 --impl cuda
  done
} 2>&1 | tee "$out/bench.log"
exit $test_rc
