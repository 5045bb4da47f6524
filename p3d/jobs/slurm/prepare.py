"""``p3d-prepare prepare.slices=n cluster=slurm ...``: a corpus beyond one machine, prepared on Slurm.

Two submissions of ``recipes/slurm/prepare.sbatch``, both through :func:`p3d.jobs.slurm.submit.sbatch` (as
p3d-train's job):

- an array job of n tasks; task i runs ``p3d-prepare <the same overrides> prepare.shard=i/n`` and writes
  ``<prepare.out>/part-i-of-n/`` (a store of its own, resumable: a requeued or rerun task continues);
- a merge job, ``--dependency=afterok:<array job>`` (it starts once every task succeeded and is cancelled
  if one fails), running ``prepare.merge=true``: the manifest of the whole store at ``<prepare.out>``.

Job logs go to ``<prepare.out>/logs/`` (``prepare-<array job>_<i>.out``, ``merge-<job>.out``). The tasks
run in the directory p3d-prepare ran from (``--chdir``), so relative paths mean the same there.
Everything is checked before the first sbatch (one-line errors, nothing submitted): the slices of the
input files, the data, an existing store at ``prepare.out``, the time limit, the partition and its CPUs.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p3d import exit_codes
from p3d.config.shipped import shipped
from p3d.jobs.slurm.submit import SLURM_TIMEOUT_S, partition_info, placement_args, sbatch, time_seconds
from p3d.layout.run_plan import P3DConfigError

RECIPE = shipped("recipes/slurm/prepare.sbatch")
DROPPED = ("cluster", "prepare.slices", "prepare.shard", "prepare.merge")  # the jobs set their own


def job_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides for the jobs: without the cluster group (a task prepares locally in its
    allocation) and without prepare.slices / shard / merge (the recipe adds each task's own)."""

    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    return [o for o in overrides if not any(key(o) == d or key(o).startswith(d + ".") for d in DROPPED)]


def hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise P3DConfigError("prepare.slices with cluster=slurm needs the p3d-prepare command line (Hydra)")
    return list(HydraConfig.get().overrides.task)


def check_slices(cfg, out: Path, check_store: Callable[[Any, Path], str | None]) -> str | None:
    """Raises P3DConfigError for what sbatch or a task would refuse; returns a message when ``out`` is a
    finished store already (then nothing is submitted). ``check_store`` is p3d-prepare's own input check
    (p3d.data.prepare_store.check_prepare, passed in: that module imports this one)."""
    from p3d.config.schema import Launcher
    from p3d.data.corpus import resolve_files
    from p3d.data.store_parts import slice_config

    n, c = cfg.prepare.slices, cfg.cluster
    if n is None:
        raise P3DConfigError(
            "cluster=slurm runs p3d-prepare as a Slurm array job of prepare.slices=n slices of the input files; "
            "set prepare.slices (e.g. prepare.slices=8), or drop cluster=slurm to prepare here"
        )
    if c.launcher != Launcher.slurm:
        raise P3DConfigError(
            f"prepare.slices={n} submits a Slurm array job; add cluster=slurm (without Slurm: run "
            f"prepare.shard=i/{n} for each i, then prepare.merge=true)"
        )
    if cfg.prepare.shard or cfg.prepare.merge:
        raise P3DConfigError(
            f"prepare.slices={n} submits the slices and the merge itself; drop prepare.shard and prepare.merge"
        )
    slice_config(dataclasses.replace(cfg, prepare=dataclasses.replace(cfg.prepare, shard="0/1")), out)  # files?
    files = len(resolve_files(cfg.data.path or "", cfg.data.format))
    if files < n:
        raise P3DConfigError(
            f"prepare.slices={n} is more than the {files} input files (a slice is whole files); "
            f"try prepare.slices={files}"
        )
    others = sorted({int(m[1]) for p in out.glob("part-*") if (m := re.fullmatch(r"part-\d{5}-of-(\d{5})", p.name))})
    if others and others != [n]:
        raise P3DConfigError(
            f"prepare.out={out} holds the parts of a prepare in {others[0]} slices; use prepare.slices={others[0]} "
            "to finish it, or another prepare.out"
        )
    finished = check_store(cfg, out)
    if finished:
        return finished
    if c.time is not None:
        time_seconds(c.time)
    cpus = c.cpus_per_task or cfg.prepare.workers or 1
    part = partition_info(c.partition)
    if cpus > part.cpus_per_node:
        field = "cluster.cpus_per_task" if c.cpus_per_task else "prepare.workers"
        raise P3DConfigError(
            f"{field}={cpus}: a slice's task needs {cpus} CPUs but the nodes of partition {part.name} have "
            f"{part.cpus_per_node}; try {field}={part.cpus_per_node}"
        )
    return None


def job_args(cfg) -> list[str]:
    """The sbatch options both jobs share: one task, the cluster's placement, time limit and requeueing."""
    from p3d.rundir.paths import user_cwd

    c = cfg.cluster
    args = [f"--chdir={user_cwd()}", "--ntasks=1", *placement_args(c)]
    if c.time is not None:
        args.append(f"--time={c.time}")
    return args + ["--requeue" if c.requeue else "--no-requeue"]


def submit_slices(cfg, out: Path, check_store: Callable[[Any, Path], str | None]) -> int:
    """Check, then submit the array job and the merge job; print their ids and logs. Returns the exit status."""
    finished = check_slices(cfg, out, check_store)
    if finished:
        print(finished, flush=True)
        return exit_codes.OK
    n, c = cfg.prepare.slices, cfg.cluster
    overrides = job_overrides(hydra_overrides())
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cpus = c.cpus_per_task or cfg.prepare.workers
    slice_args = [
        *job_args(cfg),
        f"--job-name={c.job_name}-prepare",
        f"--array=0-{n - 1}",
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        f"--output={logs}/prepare-%A_%a.out",
        *c.extra_sbatch,
    ]
    try:
        array = sbatch(c, slice_args, RECIPE, ["slice", str(n), *overrides])
    except RuntimeError as exc:
        print(f"p3d-prepare: {exc}", file=sys.stderr, flush=True)
        return exit_codes.WORKER_FAILED
    merge_args = [
        *job_args(cfg),
        f"--job-name={c.job_name}-merge",
        f"--dependency=afterok:{array}",
        "--kill-on-invalid-dep=yes",  # a failed slice cancels the merge instead of leaving it pending
        f"--output={logs}/merge-%j.out",
        *c.extra_sbatch,
    ]
    try:
        merge = sbatch(c, merge_args, RECIPE, ["merge", *overrides])
    except RuntimeError as exc:
        subprocess.run(["scancel", array], capture_output=True, timeout=SLURM_TIMEOUT_S)  # ours, just submitted
        print(f"p3d-prepare: {exc}; cancelled the array job {array}", file=sys.stderr, flush=True)
        return exit_codes.WORKER_FAILED
    print(
        f"p3d-prepare: submitted Slurm array job {array} ({n} tasks, task i prepares prepare.shard=i/{n} into "
        f"{out}/part-i-of-{n}) and merge job {merge} (starts when every task succeeded)\n"
        f"p3d-prepare: job logs {logs}/prepare-{array}_<i>.out and {logs}/merge-{merge}.out\n"
        f"p3d-prepare: when job {merge} completes, train with data=prepared data.path={out}\n"
        f"p3d-prepare: watch them with: squeue -j {array},{merge}",
        flush=True,
    )
    return exit_codes.OK
