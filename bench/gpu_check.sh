#!/usr/bin/env bash
# `make gpu-check`: bench/gpu_check.py with a Python that has torch and p3d's needs.
#  - $P3D_GPU_PYTHON when set;
#  - this checkout's .venv when there is one (CPU machines: the check runs in dry mode), unless the machine has
#    an NVIDIA GPU, the .venv's torch no CUDA and python3's torch CUDA;
#  - else the machine's python3 (a lent GPU machine: CUDA torch already there); what it lacks
#    (deepspeed, hydra-core, omegaconf, datasets, ...) is installed from .whl/ (bench/gpu_wheels.sh)
#    into a private directory, never into the system's site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
has_cuda() { "$1" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
if [[ -n "${P3D_GPU_PYTHON:-}" ]]; then
  PY=$P3D_GPU_PYTHON
elif [[ -x .venv/bin/python ]] && ! { nvidia-smi -L >/dev/null 2>&1 && ! has_cuda .venv/bin/python && has_cuda python3; }; then
  PY=.venv/bin/python  # a CPU machine (the dry mode), or a .venv with a CUDA torch
else
  PY=python3  # a lent GPU machine: its python3 has the CUDA torch, a carried .venv the CPU one
fi
if [[ "$PY" != .venv/bin/python ]]; then
  if ! $PY -c "import deepspeed, hydra, omegaconf, datasets, torchao" 2>/dev/null; then
    [[ -d .whl ]] || { echo "gpu-check: deepspeed/hydra/datasets missing and no .whl/; run bench/gpu_wheels.sh where pip works and carry .whl" >&2; exit 1; }
    SITE=${P3D_GPU_SITE:-/tmp/p3d-gpu-site}
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec $PY bench/gpu_check.py "$@"
