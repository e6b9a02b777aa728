#!/usr/bin/env bash
# The image's install steps, in one place: the top-level Dockerfile runs this script, and CI runs it in
# a fresh virtual environment on every submission, so the image's install is exercised even
# where no image can be built.
#
#   docker/install.sh [SOURCE]     SOURCE: the project directory (default: .)
#
# torch: the one already installed is kept (the CUDA build of the pytorch/pytorch base image);
# without one, TORCH_SPEC is installed (default: torch, which on Linux is a CUDA build; CPU-only
# machines and CI set TORCH_SPEC=torch==2.13.0, the CPU build).
set -euo pipefail
source_dir="${1:-.}"

python -m pip install --quiet --upgrade pip
if python -c "import torch" 2>/dev/null; then
    echo "install: keeping torch $(python -c 'import torch; print(torch.__version__)')"
else
    python -m pip install --quiet "${TORCH_SPEC:-torch}"
fi
python -m pip install --quiet "$source_dir"   # the package itself, not editable: as users get it

# The installed command works and reads a shipped recipe (loads no model, needs no network).
cory-lora --version
cory-lora validate "$source_dir/recipes/smollm2_arith.toml"
