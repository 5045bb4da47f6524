"""Freeze a run: its spec (p3d.rundir.spec) and, for DeepSpeed's engine, the JSON config beside it. p3d-train's first
launch and every re-freeze (restart, requeue, an elastic resize) write both the same way."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config
from p3d.layout.run_plan import RunPlan
from p3d.layout.schedule_rules import runs_on_deepspeed
from p3d.rundir.spec import SEGMENT_SPECS, write_spec
from p3d.train.executors.deepspeed_config import DS_CONFIG_NAME, deepspeed_config


def freeze(cfg: Config, plan: RunPlan, run_dir: str | Path, layout_change: dict[str, Any] | None = None) -> Path:
    """Write run_spec.yaml (with ``layout_change`` in its newest segment: p3d.jobs.elastic) and the DeepSpeed config
    the executor reads; returns the spec's path."""
    spec = write_spec(cfg, plan, run_dir, layout_change=layout_change)
    ds_json = spec.parent / DS_CONFIG_NAME
    if runs_on_deepspeed(cfg):  # the one executor that reads it: DeepSpeed's engine
        ds_json.write_text(json.dumps(deepspeed_config(cfg, plan), indent=2) + "\n")
    else:  # a torch schedule; a resumed 1f1b run's file would describe an engine this run does not use
        ds_json.unlink(missing_ok=True)
    return spec


@contextlib.contextmanager
def undone_if_refused(run_dir: str | Path) -> Iterator[None]:
    """The files a freeze writes (run_spec.yaml, the DeepSpeed JSON, specs/) put back as they were when the block
    raises P3DConfigError: a submission refused before anything was submitted (sbatch refused the job) leaves the run
    directory as it found it, a fresh one empty (p3d.launch.compose then removes it), a resumed one as it was."""
    from p3d.rundir.files import SPEC

    run_dir = Path(run_dir)
    kept = {
        name: (run_dir / name).read_bytes() if (run_dir / name).is_file() else None for name in (SPEC, DS_CONFIG_NAME)
    }
    segments = run_dir / SEGMENT_SPECS
    had = {p: p.read_bytes() for p in segments.iterdir() if p.is_file()} if segments.is_dir() else None
    try:
        yield
    except P3DConfigError:
        for name, body in kept.items():
            if body is None:
                (run_dir / name).unlink(missing_ok=True)
            else:
                (run_dir / name).write_bytes(body)
        if had is None:
            shutil.rmtree(segments, ignore_errors=True)
        elif segments.is_dir():
            for path in set(segments.iterdir()) - set(had):
                path.unlink(missing_ok=True)
            for path, body in had.items():
                path.write_bytes(body)
        raise
