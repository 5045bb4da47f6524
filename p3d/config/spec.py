"""The run spec: the resolved config plus the run plan, frozen in ``<run.dir>/run_spec.yaml``.

The launcher writes it once; workers, resume, sweeps and reports read it. Nothing reads Hydra
after the launcher.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from p3d.config.schema import Config
from p3d.config.validate import RunPlan

SPEC_NAME = "run_spec.yaml"
# The derived run plan's key. Not "plan": that is the planner's options (Config.plan, ``plan.force``).
RUN_PLAN_KEY = "run_plan"


def to_config(node: DictConfig | dict) -> Config:
    """Typed, resolved Config from a composed or loaded node (unknown keys and bad types raise)."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), node)
    return OmegaConf.to_object(merged)


def spec_dict(cfg: Config, plan: RunPlan) -> dict[str, Any]:
    body = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    body[RUN_PLAN_KEY] = dataclasses.asdict(plan)
    return body


def write_spec(cfg: Config, plan: RunPlan, run_dir: str | Path) -> Path:
    """Write run_spec.yaml atomically (temporary name, then rename)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SPEC_NAME
    tmp = path.with_suffix(".yaml.tmp")
    header = "# p3d run spec: resolved config + derived run plan. Workers read this file, never Hydra.\n"
    tmp.write_text(header + OmegaConf.to_yaml(OmegaConf.create(spec_dict(cfg, plan))))
    os.replace(tmp, path)
    return path


def read_spec(path: str | Path) -> tuple[Config, RunPlan]:
    path = Path(path)
    if path.is_dir():
        path = path / SPEC_NAME
    if not path.is_file():
        raise FileNotFoundError(f"run spec {path} does not exist; run p3d-train to create it")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    plan = RunPlan(**raw.pop(RUN_PLAN_KEY))
    return to_config(raw), plan
