#!/usr/bin/env bash
# Download the wheels the GPU benchmark (benchmarks/gpu_check.py) needs on a GPU machine that
# has PyTorch but no internet: torchtitan and its imports that such an image lacks, and torchao
# (fp8). Into benchmarks/wheels/ (git-ignored), for the GPU image's Python (3.12, x86-64
# manylinux); each wheel without its dependencies, which are listed here one by one.
#   make gpu-wheels            # or: bash benchmarks/gpu_wheels.sh [DIR]
# Then on the GPU machine, from the repository root, with benchmarks/wheels carried along:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/wheels/*.whl \
#     && PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py
# Versions: override with TORCHTITAN=... TORCHAO=... PYVER=...; torchao's must match the
# machine's torch (0.17 for torch 2.11).
set -euo pipefail
DIR=${1:-"$(dirname "$0")/wheels"}
PYVER=${PYVER:-3.12}
PY=${PY:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=(
  "torchtitan==${TORCHTITAN:-0.3.0}" "spmd_types==0.2.3" torchdata torch_checkpointing
  tyro docstring-parser typeguard shtab      # torchtitan's config CLI
  "datasets>=3.6,<4.8" dill multiprocess       # its text dataloader
  "torchao==${TORCHAO:-0.17.0}"               # fp8 (training.fp8)
  zstandard                                   # colonnade.data imports it; the image lacks it
)
mkdir -p "$DIR"
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DIR" "$w"
done
ls -la "$DIR"
du -sh "$DIR"
