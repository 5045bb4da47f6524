"""The run spec: the resolved config plus the run plan, frozen in ``<run.dir>/run_spec.yaml``.

The launcher writes it once; workers, resume, sweeps and reports read it. Nothing reads Hydra
after the launcher.

History: a run resumed with changed fields (``p3d.config.resume_rules``) is a new *segment*. The spec's
``segments`` list holds one entry per segment, oldest first: ``from_step`` (the checkpoint step it
continued), ``spec`` (``specs/from_step_<N>.yaml``, the whole spec that segment was launched with) and
``changes`` (one line per changed field). ``run_spec.yaml`` itself is the newest segment's spec. The
history comes from the resumed checkpoint's copy of the spec, so resuming an older checkpoint drops the
segments after it, as its steps are trained again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from p3d.config import resume_rules
from p3d.config.schema import Config
from p3d.layout.run_plan import P3DConfigError, RunPlan
from p3d.rundir.files import SPEC as SPEC_NAME

# The derived run plan's key. Not "plan": that is the planner's options (Config.plan, ``plan.force``).
RUN_PLAN_KEY = "run_plan"
LAYOUT_CHANGE = "layout_change"  # a segment's key: what an elastic re-fit changed (p3d.jobs.elastic)
SEGMENT_SPECS = "specs"  # specs/from_step_<N>.yaml: the spec each segment of the run was launched with


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
    from p3d.config.fields import unknown_option

    value = OmegaConf.select(node, key, throw_on_missing=False) if isinstance(node, DictConfig) else "..."
    return P3DConfigError(unknown_option(key, str(value)))


def to_config(node: DictConfig | dict) -> Config:
    """Typed, resolved Config from a composed or loaded node (unknown keys and bad types raise)."""
    unknown = unknown_keys(node)
    if unknown:
        raise _unknown_key_error(unknown[0], node)
    merged = OmegaConf.merge(OmegaConf.structured(Config), node)
    return cast(Config, OmegaConf.to_object(merged))


def config_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested data, enums as their names (the config part of run_spec.yaml)."""
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))


def spec_dict(cfg: Config, plan: RunPlan) -> dict[str, Any]:
    body = config_dict(cfg)
    body[RUN_PLAN_KEY] = dataclasses.asdict(plan)
    return body


def _checkpoint_spec(ckpt: Path) -> tuple[int, dict]:
    """(step, raw run spec) of a checkpoint directory: what the segment that wrote it ran with."""
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    spec = ckpt / SPEC_NAME
    return step, cast(dict, OmegaConf.to_container(OmegaConf.load(spec))) if spec.is_file() else {}


def config_part(raw: dict) -> dict:
    """The config of a raw spec: without the derived run plan (``plan`` in specs written before it was
    renamed ``run_plan``, told apart from the planner's options by its ``world_size``) and the history."""
    legacy_plan = isinstance(raw.get("plan"), dict) and "world_size" in raw["plan"]
    return {k: v for k, v in raw.items() if k not in (RUN_PLAN_KEY, "segments") and not (k == "plan" and legacy_plan)}


def resume_changes(cfg: Config, ckpt: str | Path) -> list[resume_rules.Change]:
    """Every field this run sets differently from the spec the checkpoint ``ckpt`` was trained with."""
    _, old = _checkpoint_spec(Path(ckpt))
    return resume_rules.diff(config_part(old), config_dict(cfg)) if old else []


def _segment_file(from_step: int) -> str:
    return f"{SEGMENT_SPECS}/from_step_{from_step:08d}.yaml"


def segments(cfg: Config) -> tuple[list[dict], bool]:
    """(the run's segments, oldest first, this launch's last; whether this launch starts a new one). The
    history is the resumed checkpoint's, plus a segment from its step when this launch changes a field;
    a launch that changes nothing continues the checkpoint's segment."""
    if cfg.train.resume == "none":
        return [{"from_step": 0, "spec": _segment_file(0)}], True
    step, old = _checkpoint_spec(Path(cfg.train.resume))
    history = list(old.get("segments") or [{"from_step": 0}])
    changed = resume_rules.printed(resume_rules.diff(config_part(old), config_dict(cfg))) if old else []
    if not changed:
        return history, False
    new = {"from_step": step, "spec": _segment_file(step), "changes": [c.line(step + 1) for c in changed]}
    return history + [new], True


def write_spec(cfg: Config, plan: RunPlan, run_dir: str | Path, layout_change: dict | None = None) -> Path:
    """Write run_spec.yaml atomically (temporary name, then rename), with the run's segment history; a
    launch that starts a segment also writes its spec to specs/from_step_<N>.yaml. ``layout_change``: what an
    elastic run's re-fit changed (p3d.jobs.elastic), kept in the newest segment until the worker records it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    body = spec_dict(cfg, plan)
    body["segments"], starts = segments(cfg)
    if layout_change is not None:
        body["segments"][-1] = {**body["segments"][-1], LAYOUT_CHANGE: layout_change}
    header = "# p3d run spec: resolved config + derived run plan. Workers read this file, never Hydra.\n"
    text = header + OmegaConf.to_yaml(OmegaConf.create(body))
    targets = ([run_dir / body["segments"][-1]["spec"]] if starts else []) + [run_dir / SPEC_NAME]
    for path in targets:  # the segment's own copy first, run_spec.yaml last
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return run_dir / SPEC_NAME


def pending_layout_change(run_dir: str | Path, start_step: int) -> dict | None:
    """The layout change (p3d.jobs.elastic) of the launch that starts after checkpoint ``start_step``: its segment's,
    when that segment starts there (a later resume within the segment has none to record)."""
    path = Path(run_dir) / SPEC_NAME
    if not path.is_file():
        return None
    raw = cast(dict, OmegaConf.to_container(OmegaConf.load(path)))
    last = (raw.get("segments") or [{}])[-1]
    return last.get(LAYOUT_CHANGE) if last.get("from_step") == start_step else None


def first_segment_spec(run_dir: str | Path) -> Path:
    """The spec file of the run's first segment (``specs/from_step_<N>.yaml``): the config the run started with."""
    raw = cast(dict, OmegaConf.to_container(OmegaConf.load(Path(run_dir) / SPEC_NAME)))
    first = (raw.get("segments") or [{}])[0]
    return Path(run_dir) / str(first.get("spec", _segment_file(0)))


def read_spec(path: str | Path) -> tuple[Config, RunPlan]:
    path = Path(path)
    if path.is_dir():
        path = path / SPEC_NAME
    if not path.is_file():
        raise FileNotFoundError(f"run spec {path} does not exist; run p3d-train to create it")
    raw = cast(dict, OmegaConf.to_container(OmegaConf.load(path)))
    plan = RunPlan(**raw.pop(RUN_PLAN_KEY))
    raw.pop("segments", None)
    return to_config(raw), plan
