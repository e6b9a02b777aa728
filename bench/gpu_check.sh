#!/usr/bin/env bash
# The 7B GPU check, as one short script: install, then bench/gpu_check.py (see its docstring):
# CORY (separate and fused passes) and PPO at 7B shape in 4-bit, sampler vs `generate`.
# Needs a CUDA GPU with ~20 GB free and ~30 GB of disk for the random model.
#
#   bash bench/gpu_check.sh                 # pip installs what torch's machine lacks
#   bash bench/gpu_check.sh --wheels DIR    # no network: installs from DIR only (no index)
#
# A wheel folder for a machine with torch but no network, made where cory-lora is installed and
# pip reaches PyPI (name the target's Python; torch itself is not downloaded, the target has it):
#   bash bench/gpu_check.sh --download-wheels DIR --python-version 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--download-wheels" ]]; then
  dir="$2"; shift 2
  # Every package this environment runs cory-lora with (pip freeze, after `pip install -e .`),
  # pinned, for the target's platform; not torch and its CUDA libraries: the target has them.
  mapfile -t reqs < <(python3 -m pip freeze --exclude-editable \
    | grep -v -i -E '^(torch|triton|nvidia-|cuda-|cory-lora)([=@ ]|$)')
  # pip matches a manylinux tag exactly: offer every glibc a wheel may name, 2.17 to 2.35
  platforms=(--platform manylinux2014_x86_64 --platform any)
  for n in $(seq 17 35); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download --quiet --no-deps --dest "$dir" --only-binary=:all: \
    "${platforms[@]}" "$@" "${reqs[@]}" setuptools wheel
  echo "wheels in $dir: copy it beside the checkout, then: bash bench/gpu_check.sh --wheels $dir"
  exit 0
fi
if [[ "${1:-}" == "--wheels" ]]; then
  dir="$2"; shift 2
  # --no-index: nothing from the network; torch is the machine's own (pip keeps it: it
  # satisfies our torch>=2.6). --no-build-isolation: setuptools from the machine or DIR.
  python3 -m pip install --quiet --no-index --find-links "$dir" --no-build-isolation -e .
else
  python3 -m pip install --quiet -e .
fi
timeout 480 env PYTHONUNBUFFERED=1 python3 bench/gpu_check.py "$@"
