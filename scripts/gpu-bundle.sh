#!/usr/bin/env bash
# Packs the GPU test and benchmark binaries with the shared libraries they need
# (absl, Highway) into .gpu/, for a GPU machine that lacks this machine's
# Debian packages. Run there: .gpu/run.sh (prints the test results and numbers).
# Usage: scripts/gpu-bundle.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
bins=("$build/tests/cuda_kernels_test" "$build/bench/turbokv-bench")
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "gpu-bundle: $b is missing; build with CUDA first (make build)" >&2; exit 1; }
done
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp "${bins[@]}" .gpu/bin/
ldd "${bins[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so' |
  xargs -r cp -L -t .gpu/lib/
cp scripts/gpu-run.sh .gpu/run.sh
echo "gpu-bundle: $(du -sh .gpu | cut -f1) in .gpu/"
