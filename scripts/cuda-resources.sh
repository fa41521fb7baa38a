#!/usr/bin/env bash
# What ptxas gives each CUDA kernel, per GPU architecture of the build:
# registers a thread, spill bytes, static shared memory (the split and merge
# kernels size theirs at launch). Needs nvcc, not a GPU.
# Usage: scripts/cuda-resources.sh [build dir, default build] [arch ...]
# (default 80 90). Kernels at 128 threads a block get 65536 / (128 x
# registers) blocks an SM at most; the build fails on any spill.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
shift || true
archs=("${@:-80 90}")
nvcc="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
rsp="$build/kernels/cuda/CMakeFiles/turbokv_cuda.dir/includes_CUDA.rsp"
[ -f "$rsp" ] || { echo "cuda-resources: no $rsp: configure a CUDA build first (make build)" >&2; exit 2; }
printf '%-4s %-44s %5s %7s %7s\n' arch kernel regs spill smem
for arch in ${archs[*]}; do
  for cu in "$root"/kernels/cuda/*.cu; do
    (cd "$build/kernels/cuda" && "$nvcc" -O3 -DNDEBUG -std=c++17 --fmad=false --options-file "$rsp" \
      --generate-code="arch=compute_$arch,code=sm_$arch" -Xptxas -v -c "$cu" -o /dev/null 2>&1) |
      awk -v arch="$arch" '
        /Compiling entry function/ { name = $0; sub(/.*function .?/, "", name); sub(/. for .*/, "", name)
                                     cmd = "c++filt \"" name "\""; cmd | getline name; close(cmd)
                                     gsub(/turbokv::cuda::\(anonymous namespace\)::/, "", name); sub(/^void /, "", name)
                                     sub(/\(.*/, "", name) }
        /spill stores/ { spill = $5 + $9 }
        /Used [0-9]+ registers/ { regs = $5; smem = 0
                                  if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
                                  printf "sm_%-2s %-44s %5s %7s %7s\n", arch, name, regs, spill, smem }'
  done
done
