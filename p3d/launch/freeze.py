"""Freeze a run: its spec (p3d.rundir.spec) and, for DeepSpeed's engine, the JSON config beside it. p3d-train's first
launch and every re-freeze (restart, requeue, an elastic resize) write both the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from p3d.config.schema import Config
from p3d.layout.run_plan import RunPlan
from p3d.layout.schedule_rules import runs_on_deepspeed
from p3d.rundir.spec import write_spec
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
