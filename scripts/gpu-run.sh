#!/usr/bin/env bash
# Runs on a GPU machine from a bundle made by scripts/gpu-bundle.sh, most
# telling first, so that a run cut short still answers the open question
# (docs/BENCHMARKS.md, "To measure the current GPU path"):
#   1. the tensor-core kernel's tests (token-group pages: codecs, attention
#      against the scalar reference, every compiled variant);
#   2. the sweep: attention of 32 sessions x 16K tokens (8 kv / 32 q heads,
#      d 128) on the CUDA-core split kernel and on the tensor-core kernel in
#      each variant, turbo4 and turbo3 pairs, each against the same kernel
#      on f16 and a device copy; then 1 x 16K and 8 x 128K on both kernels;
#   3. the rest of the CUDA kernel tests, the service tests on the GPU (every
#      test parameterized by device: its cuda_0 and cuda_0_tensor_cores
#      instances), the GPU against the CPU, the device choice;
#   4. a Decode stream through the daemon on both kernels, the codecs, and
#      Nsight Compute's DRAM throughput of both split kernels where ncu runs.
# About six minutes on an H100. Logs go to $OUT when it is set (the device
# tool brings them back), a line of progress each step to stdout.
set -uo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
here="$(mktemp -d)"
tar -C "$here" -xJf "$bundle/bundle.tar.xz" || { echo "gpu-run: cannot unpack $bundle/bundle.tar.xz"; exit 2; }
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TURBOKVD="$here/bin/turbokvd"
bench="$here/bin/turbokv-bench"
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
echo "built with CUDA runtime $(cat "$bundle/cuda-version" 2>/dev/null || echo unknown) (a driver must support it)"
failed=0
: > "$out/tests.log"
run_tests() {  # binary, gtest filter, seconds
  echo "== $1 --gtest_filter=$2" >> "$out/tests.log"
  timeout "${3:-300}" "$here/bin/$1" --gtest_filter="$2" >> "$out/tests.log" 2>&1
  local rc=$?
  echo "[$((SECONDS - start)) s] $1 $2: exit $rc" | tee -a "$out/tests.log"
  [ "$rc" -eq 0 ] || failed=1
}
attend() {  # sessions, tokens, codec, then turbokv-bench attend's flags
  local sessions=$1 tokens=$2 codec=$3
  shift 3
  timeout 120 "$bench" attend --k-codec "$codec" --v-codec "$codec" --tokens "$tokens" --sessions "$sessions" \
    --kv-heads 8 --q-heads 32 --head-dim 128 --page-tokens 64 --impl cuda --json "$@" 2>&1 |
    sed "s/^{/{\"tokens\": $tokens, \"codec\": \"$codec\", /" | tee -a "$out/sweep.jsonl"
}

echo "== 1. the tensor-core kernel's tests"
run_tests cuda_kernels_test '*TensorCore*:*token_groups*' 240

echo "== 2. the sweep (JSON lines in sweep.jsonl)"
: > "$out/sweep.jsonl"
for codec in turbo4 turbo3; do
  attend 32 16384 "$codec" --kernel split
  for variant in 4,2 4,3 8,2 2,4; do
    attend 32 16384 "$codec" --kernel tensor-cores --variant "$variant"
  done
done
for shape in "1 16384" "8 131072"; do
  set -- $shape
  attend "$1" "$2" turbo4 --kernel split
  attend "$1" "$2" turbo4 --kernel tensor-cores
done
echo "[$((SECONDS - start)) s] sweep done"

echo "== 3. the other GPU tests"
run_tests cuda_kernels_test '-*TensorCore*:*token_groups*'
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

echo "== 4. the daemon, the codecs, Nsight Compute"
{
  for attention in split tensor-cores; do
    timeout 150 "$bench" e2e --device cuda:0 --cuda-attention "$attention" --batch 32 --layers 4 --tokens 16384 \
      --steps 3 --threads 8
  done
  timeout 60 "$bench" codec --codec all --head-dim 128 --vectors 1000000 --impl cuda
} > "$out/bench.log" 2>&1
grep -E "^\||speed|takes" "$out/bench.log" | head -30
echo "[$((SECONDS - start)) s] benchmarks done"
if command -v ncu > /dev/null; then
  for kernel in split tensor-cores; do
    timeout 90 ncu --clock-control none --kernel-name regex:SplitKernel --launch-count 2 \
      --metrics dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
      "$bench" attend --k-codec turbo4 --v-codec turbo4 --tokens 16384 --sessions 32 --kv-heads 8 \
      --q-heads 32 --head-dim 128 --page-tokens 64 --impl cuda --kernel "$kernel" > "$out/ncu-$kernel.log" 2>&1
    grep -E "SplitKernel|dram__|gpu__time|registers|warps_active|inst_executed" "$out/ncu-$kernel.log" | head -12
  done
fi
echo "gpu-run: tests $([ "$failed" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s; logs in $out"
exit "$failed"
