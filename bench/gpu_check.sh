#!/usr/bin/env bash
# The 7B GPU check, as one short script: install, then bench/gpu_check.py (see its docstring).
# Needs a CUDA GPU with ~20 GB free, ~30 GB of disk for the random model, no network beyond pip.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet -e .
PYTHONUNBUFFERED=1 python3 bench/gpu_check.py "$@"
