"""Restarts within one launch: ``train.max_restarts=N``.

When the workers fail for a reason that is not an error they raised (a worker killed by a signal: SIGKILL, the
OOM killer, a lost node; or a hang, p3d.dist.hang), every worker is started again from the newest complete
checkpoint (the run spec is re-frozen with ``train.resume=auto`` resolved, as a requeued Slurm job does), at
most N times, each restart printed with its cause. An error a worker raised (a config, data or code error)
is never retried, and neither is a failure that repeats the previous one: the same cause at the same step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from p3d import exit_codes
from p3d.run_dir import read_metrics

RESTARTABLE = (exit_codes.WORKER_FAILED, exit_codes.HUNG)


def step_in_flight(run_dir: Path) -> int:
    """The step the run was in when it failed: one after the last one logged."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return (records[-1]["step"] if records else 0) + 1


def run_with_restarts(launch: Callable[[dict], int], run_dir: Path, max_restarts: int, console=None) -> int:
    """``launch(failure)`` runs the workers once (p3d.dist.launch.launch_local); returns the last status."""
    from p3d.dist.slurm_job import resume_spec

    console = console or sys.stdout
    previous: tuple[int, str] | None = None
    restarts = 0
    while True:
        failure: dict = {}
        rc = launch(failure)
        if rc not in RESTARTABLE or not failure.get("restartable") or max_restarts == 0:
            return rc
        this = (step_in_flight(run_dir), failure["cause"])
        if this == previous:
            print(f"p3d: {this[1]} at step {this[0]} again, as before the last restart: not restarting", file=console,
                  flush=True)  # fmt: skip
            return rc
        if restarts == max_restarts:
            print(f"p3d: {this[1]} at step {this[0]}; all {max_restarts} restarts (train.max_restarts) used",
                  file=console, flush=True)  # fmt: skip
            return rc
        restarts += 1
        previous = this
        print(f"p3d: restart {restarts} of {max_restarts}: {this[1]} at step {this[0]}; restarting every worker "
              "from the newest complete checkpoint", file=console, flush=True)  # fmt: skip
        if resume_spec(str(run_dir)) != 0:
            return rc
