#!/usr/bin/env bash
# What ptxas gives each CUDA kernel, per GPU architecture of the build:
# registers a thread, spill bytes, static shared memory (the split and merge
# kernels size theirs at launch). Then, from the sm_90 code, the tensor-core
# split kernels' loop over a token group in SASS: its instructions a byte of
# cache against an H100's and an H200's issue budget (scripts/sass-loop.py;
# nvdisasm from PyPI, pinned in constraints.txt, installed into .venv when
# missing). Needs nvcc, not a GPU; about four minutes on two cores.
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
cubins="$(mktemp -d)"
trap 'rm -rf "$cubins"' EXIT
printf '%-4s %-44s %5s %7s %7s\n' arch kernel regs spill smem
for arch in ${archs[*]}; do
  for cu in "$root"/kernels/cuda/*.cu; do
    (cd "$build/kernels/cuda" && "$nvcc" -O3 -DNDEBUG -std=c++17 --fmad=false --options-file "$rsp" \
      --generate-code="arch=compute_$arch,code=sm_$arch" -Xptxas -v -cubin "$cu" \
      -o "$cubins/sm_$arch-$(basename "$cu" .cu).cubin" 2>&1) |
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
cubin="$cubins/sm_90-attention_tc.cubin"
[ -f "$cubin" ] || { echo "cuda-resources: no sm_90 code asked for; the SASS loop table reads sm_90's"; exit 0; }
venv="$root/.venv"
find_nvdisasm() { compgen -G "$venv/lib/python3*/site-packages/nvidia/cu*/bin/nvdisasm" | head -1 || true; }
nvdisasm="$(find_nvdisasm)"
if [ -z "$nvdisasm" ]; then
  [ -x "$venv/bin/pip" ] || { echo "cuda-resources: no $venv (make deps makes it) for nvdisasm" >&2; exit 2; }
  "$venv/bin/pip" install -q -c "$root/constraints.txt" nvidia-cuda-nvdisasm
  nvdisasm="$(find_nvdisasm)"
  [ -n "$nvdisasm" ] || { echo "cuda-resources: nvidia-cuda-nvdisasm installed no nvdisasm" >&2; exit 2; }
fi
bench="$build/bench/turbokv-bench"
[ -x "$bench" ] || { echo "cuda-resources: no $bench (make build) for the codecs' record sizes" >&2; exit 2; }
# A record's bytes per codec and head dim: bits a value x head_dim / 8.
for d in 64 128 256; do
  "$bench" codec --codec all --head-dim "$d" --vectors 16 --impl scalar --json
done | python3 -c '
import json, sys
sizes = {}
for line in sys.stdin:
    r = json.loads(line)
    sizes.setdefault(str(r["head_dim"]), {})[r["codec"]] = round(r["bits_per_value"] * r["head_dim"] / 8)
json.dump(sizes, open(sys.argv[1], "w"))' "$cubins/code-bytes.json"
echo
echo "sm_90 tensor-core split kernels: the loop over one token group (16 tokens) in SASS"
"$nvdisasm" -c "$cubin" > "$cubins/attention_tc.sass"
python3 "$root/scripts/sass-loop.py" "$cubins/attention_tc.sass" "$cubins/code-bytes.json"
