#!/usr/bin/env bash
# Installs the Debian packages turbokv needs, only those that are missing.
# Non-interactive; runs `apt-get update` first only when something must be installed.
#   scripts/install-deps.sh          what building and testing on this machine needs (make deps)
#   scripts/install-deps.sh --real-model  the text of bench/real_model.py (make real-model-deps)
#   scripts/install-deps.sh --arm64  what make test-arm64 needs: the cross compiler, qemu-user
#                                    and the arm64 builds of the kernels' libraries (Multi-Arch:
#                                    same, beside the amd64 ones; apt keeps both at one version)
set -euo pipefail

name="deps"
foreign=""
packages=(
  build-essential cmake pkg-config ccache
  libabsl-dev libhwy-dev libgtest-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc openssl libssl-dev
  prometheus-cpp-dev prometheus clang-14 libclang-rt-14-dev libhiredis-dev redis-server
  libzmq3-dev python3-zmq python3-msgpack
  python3-grpcio python3-protobuf python3-numpy python3-yaml python3-pip python3-venv python3-torch python3-jsonschema
)
if [ "${1:-}" = "--real-model" ]; then
  name="real-model deps"
  packages=(debian-reference-en)  # bench/real_model.py's text
elif [ "${1:-}" = "--arm64" ]; then
  name="arm64 deps"
  foreign="arm64"
  packages=(g++-aarch64-linux-gnu qemu-user-static libabsl-dev:arm64 libhwy-dev:arm64 libgtest-dev:arm64)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "$name: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
if [ -n "$foreign" ] && ! dpkg --print-foreign-architectures | grep -qx "$foreign"; then
  echo "$name: adding the $foreign architecture"
  $sudo dpkg --add-architecture "$foreign"
fi
echo "$name: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
