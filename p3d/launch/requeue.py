"""A restarted or requeued run's spec, frozen again: ``train.resume=auto`` resolved to the newest complete
checkpoint and checked (as ``p3d-train train.resume=auto run.dir=<run_dir>`` would). The local launcher's restarts
(p3d.jobs.restart) and the Slurm recipe after a requeue (``python -m p3d.cli.slurm resume``) call it."""

from __future__ import annotations

import dataclasses
import sys

from p3d import exit_codes
from p3d.config.errors import P3DConfigError


def resume_spec(run_dir: str) -> int:
    """Re-freeze the spec of a requeued job with train.resume=auto resolved to the newest complete
    checkpoint (as ``p3d-train train.resume=auto run.dir=<run_dir>`` would)."""
    from p3d.launch.check import check_run  # resolves auto to a checkpoint dir and checks it
    from p3d.rundir.spec import read_spec, write_spec

    cfg, plan = read_spec(run_dir)
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, resume="auto"), run=dataclasses.replace(cfg.run, dir=str(run_dir))
    )
    try:
        cfg = check_run(cfg)
    except P3DConfigError as exc:
        print(f"p3d: cannot resume {run_dir}: {exc}", file=sys.stderr, flush=True)
        return exit_codes.CONFIG_ERROR
    write_spec(cfg, plan, run_dir)
    print(f"p3d: resuming {run_dir} from {cfg.train.resume}", flush=True)
    return 0
