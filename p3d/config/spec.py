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
from p3d.config.validate import P3DConfigError, RunPlan

SPEC_NAME = "run_spec.yaml"


def unknown_keys(node: Any, schema: Any = None, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` that the schema has no field for (a ``+train.foo=1`` override adds one
    past Hydra's struct check)."""
    schema = Config() if schema is None else schema
    names = {f.name for f in dataclasses.fields(schema)}
    found = []
    for key in node:
        if key not in names:
            found.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(getattr(schema, key)) and isinstance(node[key], (dict, DictConfig)):
            found += unknown_keys(node[key], getattr(schema, key), f"{prefix}{key}.")
    return found


def _unknown_key_error(key: str, node: Any) -> P3DConfigError:
    import difflib

    group, _, name = key.rpartition(".")
    section = OmegaConf.select(OmegaConf.structured(Config), group) if group else OmegaConf.structured(Config)
    close = difflib.get_close_matches(name, list(section.keys()), n=1)
    value = OmegaConf.select(node, key, throw_on_missing=False) if isinstance(node, DictConfig) else "..."
    fix = f"try {group + '.' if group else ''}{close[0]}={value}" if close else \
        "remove it (p3d-train --cfg job lists the options)"
    return P3DConfigError(f"{key}={value} is not a p3d option and would be ignored; {fix}")


def to_config(node: DictConfig | dict) -> Config:
    """Typed, resolved Config from a composed or loaded node (unknown keys and bad types raise)."""
    unknown = unknown_keys(node)
    if unknown:
        raise _unknown_key_error(unknown[0], node)
    merged = OmegaConf.merge(OmegaConf.structured(Config), node)
    return OmegaConf.to_object(merged)


def spec_dict(cfg: Config, plan: RunPlan) -> dict[str, Any]:
    body = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    body["plan"] = dataclasses.asdict(plan)
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
    plan = RunPlan(**raw.pop("plan"))
    return to_config(raw), plan
