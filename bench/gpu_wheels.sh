#!/usr/bin/env bash
# Wheels of what p3d needs and a GPU machine's image lacks (the lent H200 has torch, numpy, psutil,
# tokenizers, safetensors, transformers, pyarrow, pandas, einops, msgpack, ninja, py-cpuinfo, ...,
# but no deepspeed, hydra-core, omegaconf, datasets, pydantic; ../shared/notes/gpu-device.md).
# Writes .whl/ (git-ignored, about 5 MiB) for Python 3.12 on x86-64: `make gpu-check` installs them
# there into a private target when the imports are missing. Versions are requirements-cpu.txt's.
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]       # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
PIP="${PIP:-.venv/bin/python -m pip}"
pin() { grep -E "^$1==" requirements-cpu.txt | cut -d= -f3; }
rm -rf .whl && mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Binary and pure-Python wheels as published; versions: this machine's venv (what the tests ran with).
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in hydra-core omegaconf datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection hjson torchao; do
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp "${PLATFORMS[@]}" \
    -d .whl "$name==$(ver "$name")"
done
# Published as source archives only: built here as pure-Python wheels (deepspeed's ops compile just in
# time and p3d uses torch's AdamW, so none is built).
DS_BUILD_OPS=0 $PIP wheel -q --no-deps -w .whl "deepspeed==$(pin deepspeed)" "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"
ls -la .whl && du -sh .whl
