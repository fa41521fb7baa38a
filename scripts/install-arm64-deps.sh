#!/usr/bin/env bash
# Installs what cross-building the kernels and their tests for arm64 needs
# (cmake/aarch64-linux-gnu.cmake): the cross compiler, qemu-user, and the
# arm64 builds of the kernel libraries, only those that are missing.
# Non-interactive; adds the arm64 architecture and runs `apt-get update` only
# when something must be installed. The arm64 -dev packages are Multi-Arch:
# same, so they sit beside the amd64 ones (apt keeps both at one version).
set -euo pipefail

packages=(
  g++-aarch64-linux-gnu qemu-user-static
  libabsl-dev:arm64 libhwy-dev:arm64 libgtest-dev:arm64
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "arm64 deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  echo "arm64 deps: adding the arm64 architecture"
  $sudo dpkg --add-architecture arm64
fi
echo "arm64 deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
