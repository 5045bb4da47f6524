#!/usr/bin/env bash
# One machine, NPROC = tp * pp * dp processes under torchrun; p3d-train runs as a worker in each
# (RANK is set), every rank composes the same spec and rank 0 writes run_spec.yaml.
#   NPROC=8 RUN_DIR=/shared/runs/exp1 recipes/torchrun.sh mesh=dp2_pp2_tp2 model=tiny
set -euo pipefail
: "${NPROC:?set NPROC to tp*pp*dp of the mesh}"
RUN_DIR=${RUN_DIR:-outputs/torchrun-$(date +%Y%m%d-%H%M%S)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc-per-node "$NPROC" -m p3d.cli "run.dir=$RUN_DIR" "$@"
