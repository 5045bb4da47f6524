#!/usr/bin/env bash
# `make gpu-check`: bench/gpu_check.py with a Python that has torch and p3d's needs.
#  - this checkout's .venv when there is one (CPU machines: the check runs in dry mode);
#  - else the machine's python3 (a lent GPU machine: CUDA torch already there); what it lacks
#    (deepspeed, hydra-core, omegaconf, datasets, ...) is installed from .whl/ (bench/gpu_wheels.sh)
#    into a private directory, never into the system's site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
  if ! $PY -c "import deepspeed, hydra, omegaconf, datasets" 2>/dev/null; then
    [[ -d .whl ]] || { echo "gpu-check: deepspeed/hydra/datasets missing and no .whl/; run bench/gpu_wheels.sh where pip works and carry .whl" >&2; exit 1; }
    SITE=${P3D_GPU_SITE:-/tmp/p3d-gpu-site}
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec $PY bench/gpu_check.py "$@"
