"""A refusal suggests only fixes the same command accepts.

A rule that refuses a config names its candidate fixes, the preferred first (``P3DConfigError(problem, fixes)``).
:func:`settle` applies each to the typed config as the same command line with the fix appended would give it, runs
the rules again, and keeps those that pass: ``try A, or B``. How a fix applies follows Hydra and p3d's resume:

- a dotted override (``mesh.pp=2``) sets that field;
- a group choice (``mesh=pp2``) replaces the group's section with the preset, except the fields the command line
  sets with dotted overrides: Hydra applies those after the group choice, so they still win
  (``mesh.pp=8 mesh=pp4`` is pp 8);
- ``schedule.pipeline`` re-derives ``schedule.virtual_stages`` when the command line does not set it, as
  ``fill_derived`` does for a fresh composition;
- a fix that changes a field this command may not change (a resume's refused fields: the model's shape,
  ``model.seq_len``, the data; p3d.config.resume_rules) is never suggested.

Where no candidate makes the whole config pass (it breaks another rule too), those that clear this refusal are
kept: the config has a second problem, which the next run of the rules names with its own fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p3d.config.errors import P3DConfigError
from p3d.config.schema import GROUPS, Config
from p3d.layout.schedule_rules import fewest_chunks_per_rank


@dataclass(frozen=True)
class Pins:
    """What a suggested fix cannot move: ``given``, the dotted fields the command line sets (a group choice leaves
    them as they are); ``refused``, the fields this command may not change at all (a resume's)."""

    given: frozenset[str] = frozenset()
    refused: Callable[[str], bool] | None = None

    def may_change(self, field: str) -> bool:
        return self.refused is None or not self.refused(field)


def settle(exc: P3DConfigError, cfg: Config, pins: Pins | None, rules: Callable[[Config], Any]) -> P3DConfigError:
    """``exc`` suggesting only the fixes that ``rules`` (every rule the command runs; raises P3DConfigError)
    accept once applied to ``cfg``; an error without fixes as it is."""
    if not exc.fixes:
        return exc
    pins = pins or Pins()
    accepted: list[tuple[str, Config]] = []
    clears: list[tuple[str, Config]] = []  # fixes that clear this refusal but meet another
    for fix in exc.fixes:
        fixed = apply_fix(cfg, fix, pins)
        if fixed is None:
            continue
        try:
            rules(fixed)
        except P3DConfigError as other:
            if other.problem != exc.problem:
                _add(clears, fix, fixed)
            continue
        _add(accepted, fix, fixed)
    return exc.settled([fix for fix, _ in accepted or clears])


def _add(kept: list[tuple[str, Config]], fix: str, fixed: Config) -> None:
    """Keep ``fix`` unless an earlier one gives the same config (``mesh=pp2`` and ``mesh.pp=2``: the name aside)."""
    if not any(_unnamed(fixed) == _unnamed(other) for _, other in kept):
        kept.append((fix, fixed))


def _unnamed(cfg: Config) -> Config:
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, name=""))


def apply_fix(cfg: Config, fix: str, pins: Pins) -> Config | None:
    """``cfg`` with ``fix`` (space-separated overrides) applied as the module docstring says; None where the fix
    cannot apply: it moves a field this command may not change, or names a preset p3d does not ship."""
    out = cfg
    keys = [word.split("=", 1)[0] for word in fix.split()]
    for word in fix.split():
        key, _, text = word.partition("=")
        applied = _with_preset(out, key, text, pins) if "." not in key else _with_field(out, key, text)
        if applied is None:
            return None
        out = applied
    if out.schedule.pipeline != cfg.schedule.pipeline and not {"schedule.virtual_stages"} & {*keys, *pins.given}:
        chunks = fewest_chunks_per_rank(str(out.schedule.pipeline.value))
        out = dataclasses.replace(out, schedule=dataclasses.replace(out.schedule, virtual_stages=chunks))
    before = _flat(cfg)
    moved = [k for k, v in _flat(out).items() if before.get(k) != v]
    return out if all(pins.may_change(k) for k in moved) else None


def _with_field(cfg: Config, key: str, text: str) -> Config | None:
    """``cfg`` with the dotted field ``key`` set to ``text`` (YAML, converted by OmegaConf as Hydra's merge would)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    *path, name = key.split(".")
    chain: list[Any] = [cfg]
    for part in path:
        chain.append(getattr(chain[-1], part, None))
        if not dataclasses.is_dataclass(chain[-1]):
            return None
    node = OmegaConf.structured(chain[-1])
    try:
        node[name] = yaml.safe_load(text)
    except OmegaConfBaseException:
        return None
    new = OmegaConf.to_object(node)
    for parent, part in zip(reversed(chain[:-1]), reversed(path)):
        new = dataclasses.replace(parent, **{part: new})
    return new  # type: ignore[return-value]  # the root of the chain: a Config


def _with_preset(cfg: Config, group: str, name: str, pins: Pins) -> Config | None:
    """``cfg`` with group ``group`` chosen as ``conf/<group>/<name>.yaml`` (a preset on its group's schema only),
    the command line's dotted fields of the group kept."""
    from omegaconf import DictConfig, OmegaConf

    from p3d.config.shipped import conf_dir

    path = conf_dir() / group / f"{name}.yaml"
    if group not in GROUPS or not path.is_file():
        return None
    raw = OmegaConf.load(path)
    assert isinstance(raw, DictConfig)  # a group file is a mapping
    if list(raw.get("defaults", [])) != [f"base_{group}"]:
        return None  # a preset built on another (cluster=h100_sxm on slurm): not modelled here
    raw.pop("defaults")
    new: Any = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GROUPS[group]), raw))  # the group's dataclass
    old = getattr(cfg, group)
    names = {f.name for f in dataclasses.fields(old)}
    given = {k.split(".")[1] for k in pins.given if k.startswith(f"{group}.")} & names
    return dataclasses.replace(cfg, **{group: dataclasses.replace(new, **{k: getattr(old, k) for k in given})})


def _flat(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{"model.seq_len": 64, ...}: every field of a config, nested dataclasses flattened."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out
