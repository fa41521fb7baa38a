#!/usr/bin/env bash
# Packs what the GPU run needs into .gpu/ (git-ignored; carry it to a GPU
# machine that lacks this machine's Debian packages): the CUDA kernel tests,
# the service tests that run once per device (their cuda_0 instances and the
# CPU-against-GPU comparison), turbokvd for the binary tests, turbokv-bench,
# and every shared library they need (grpc, protobuf, absl, Highway, ...),
# stripped, in one xz tarball (about 9 MB; 75 MB unpacked, past the device
# tool's 64 MiB). Run there: .gpu/run.sh (scripts/gpu-run.sh).
# Usage: scripts/gpu-bundle.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
tests=(cuda_kernels_test handler_test decode_test layer_codecs_test spill_test server_test turbokvd_test
       backend_test cross_device_test)
bins=("$build/service/turbokvd" "$build/bench/turbokv-bench")
for t in "${tests[@]}"; do bins+=("$build/tests/$t"); done
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "gpu-bundle: $b is missing; build with CUDA first (make build)" >&2; exit 1; }
done
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin" "$staging/lib"
cp "${bins[@]}" "$staging/bin/"
ldd "${bins[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so' |
  xargs -r cp -L -t "$staging/lib/"
strip --strip-unneeded "$staging"/bin/* "$staging"/lib/*
rm -rf .gpu && mkdir .gpu
tar -C "$staging" -cf - bin lib | xz -9 -T2 > .gpu/bundle.tar.xz
cp scripts/gpu-run.sh .gpu/run.sh
"${CUDACXX:-/usr/local/cuda/bin/nvcc}" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p' > .gpu/cuda-version
echo "gpu-bundle: .gpu/bundle.tar.xz, $(du -h .gpu/bundle.tar.xz | cut -f1) ($(du -sh "$staging" | cut -f1) unpacked)"
