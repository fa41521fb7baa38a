#!/usr/bin/env bash
# Installs the Debian packages turbokv needs, only those that are missing.
# Non-interactive; runs `apt-get update` first only when something must be installed.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ccache
  libabsl-dev libhwy-dev libgtest-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc openssl libssl-dev
  prometheus-cpp-dev prometheus clang-14 libclang-rt-14-dev
  python3-grpcio python3-protobuf python3-numpy python3-yaml
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
