#!/usr/bin/env bash
# Runs on a GPU machine from a bundle made by scripts/gpu-bundle.sh, in about
# five minutes on an H200: the CUDA kernel tests; the service tests on the
# GPU (every test parameterized by device, its cuda_0 instances; the GPU and
# the CPU side by side; the device choice); then the benchmarks: codecs,
# attention of 1 and 32 sessions x 16K tokens and 8 x 128K (turbo3 against
# the same kernels on f16, and a device copy), a Decode stream through the
# daemon, and Nsight Compute's DRAM throughput of the split kernel where ncu
# runs. Logs go to $OUT when it is set (the device tool brings them back).
set -uo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
here="$(mktemp -d)"
tar -C "$here" -xJf "$bundle/bundle.tar.xz" || { echo "gpu-run: cannot unpack $bundle/bundle.tar.xz"; exit 2; }
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TURBOKVD="$here/bin/turbokvd"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
echo "built with CUDA runtime $(cat "$bundle/cuda-version" 2>/dev/null || echo unknown) (a driver must support it)"
failed=0
run_tests() {  # binary, gtest filter
  local log="$out/tests.log"
  echo "== $1 --gtest_filter=$2" >> "$log"
  timeout 300 "$here/bin/$1" --gtest_filter="$2" >> "$log" 2>&1
  local rc=$?
  echo "$1: exit $rc" | tee -a "$log"
  [ "$rc" -eq 0 ] || failed=1
}
: > "$out/tests.log"
run_tests cuda_kernels_test '*'
for t in handler_test decode_test layer_codecs_test spill_test server_test turbokvd_test; do
  run_tests "$t" '*cuda_0*'
done
run_tests backend_test '*'
run_tests cross_device_test '*'
run_tests turbokvd_test 'TurbokvdTest.TheGpuServesOrTheDaemonSaysWhyNot'
grep -E "FAILED|Failure" "$out/tests.log" | head -40
# Every test here is for the GPU: a skip means it did not reach one (a
# driver older than the CUDA runtime of the build, say), not a pass.
skipped=$(grep -c -E '^\[  SKIPPED \] [A-Za-z].* \([0-9]+ ms\)$' "$out/tests.log")  # once a test, not the summary
if [ "$skipped" -gt 0 ]; then
  echo "gpu-run: $skipped GPU tests SKIPPED, so nothing of theirs ran on the GPU; the first reasons:"
  grep -A1 -E '(Skipped|skipped)$' "$out/tests.log" | grep -v -E '^(--|.*Skipped)$' | sort | uniq -c | head -5
  failed=1
fi
{
  bench="$here/bin/turbokv-bench"
  "$bench" codec --codec all --head-dim 128 --vectors 1000000 --impl cuda
  for shape in "1 16384" "32 16384" "8 131072"; do
    set -- $shape
    "$bench" attend --k-codec turbo3 --v-codec turbo3 --tokens "$2" --sessions "$1" --kv-heads 8 --q-heads 32 \
      --head-dim 128 --page-tokens 64 --impl cuda
  done
  timeout 240 "$bench" e2e --device cuda:0 --batch 32 --layers 4 --tokens 16384 --steps 3 --threads 8
  "$bench" attend --k-codec turbo3 --v-codec turbo3 --tokens 16384 --sessions 32 --kv-heads 8 --q-heads 32 \
    --head-dim 128 --page-tokens 64 --impl cuda --json
} 2>&1 | tee "$out/bench.log"
if command -v ncu > /dev/null; then
  timeout 180 ncu --clock-control none --kernel-name regex:SplitKernel --launch-count 3 \
    --metrics dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$here/bin/turbokv-bench" attend --k-codec turbo3 --v-codec turbo3 --tokens 16384 --sessions 32 --kv-heads 8 \
    --q-heads 32 --head-dim 128 --page-tokens 64 --impl cuda > "$out/ncu.log" 2>&1
  grep -E "SplitKernel|dram__|gpu__time|registers|warps_active" "$out/ncu.log" | head -20
fi
echo "gpu-run: tests $([ "$failed" -eq 0 ] && echo passed || echo FAILED); logs in $out"
exit "$failed"
