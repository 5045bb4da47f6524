"""Fixes that name a layout: a mesh preset where p3d ships one (``mesh=pp2``), else the fields (``mesh.pp=2``); and
those that let the layer list be cut into more pieces."""

from __future__ import annotations

from typing import cast

from p3d.config.schema import Config, Partition
from p3d.layout.geometry import max_pieces


def _mesh_presets() -> dict[tuple[int, int, str], str]:
    """(tp, pp, dp) -> preset name, read from conf/mesh/ to suggest a fix by name."""
    from omegaconf import DictConfig, OmegaConf

    from p3d.config.shipped import conf_dir

    presets: dict[tuple[int, int, str], str] = {}
    for f in sorted((conf_dir() / "mesh").glob("*.yaml")):
        vals = cast(DictConfig, OmegaConf.load(f))  # conf/mesh/*.yaml are mappings
        try:
            if vals["name"] != "auto":  # a placeholder for the planner's search, not a layout
                presets[(int(vals["tp"]), int(vals["pp"]), str(vals["dp"]))] = f.stem
        except (KeyError, ValueError, TypeError):
            continue
    return presets


def preset_of(tp: int, pp: int, dp: int | str = "auto", presets: dict | None = None) -> str | None:
    """``mesh=<preset>`` for this layout, or None where p3d ships none (``presets``: conf/mesh/ read already)."""
    presets = presets if presets is not None else _mesh_presets()
    for key in ((tp, pp, str(dp)), (tp, pp, "auto"), (tp, pp, "1")):  # dp auto is 1 on one machine
        if key in presets:
            return f"mesh={presets[key]}"
    return None


def suggest_mesh(tp: int, pp: int, dp: int | str = "auto") -> str:
    """An override that sets this layout: a preset name where one exists, else the fields."""
    return preset_of(tp, pp, dp) or f"mesh.tp={tp} mesh.pp={pp}" + (f" mesh.dp={dp}" if dp != "auto" else "")


def fewer_stages(cfg: Config, tp: int, most: int) -> list[str]:
    """Fixes that cut the pipeline into at most ``most`` stages: each pp a preset (``mesh=pp2``) and a field
    (``mesh.pp=2``, where the command line sets mesh.pp), divisors of the blocks first (even stages)."""
    n, pp = cfg.model.n_layers, cfg.mesh.pp
    stages = sorted(range(1, min(pp - 1, most) + 1), key=lambda p: (n % p != 0, -p))
    presets = _mesh_presets()
    return [fix for p in stages for fix in (preset_of(tp, p, cfg.mesh.dp, presets), f"mesh.pp={p}") if fix]


def finer_cuts(cfg: Config, pieces: int) -> tuple[list[str], str]:
    """Fixes that let the layer list be cut into ``pieces``: (the partitions that cut it so finely, the fewest blocks
    that the configured partition cuts so: ``model.n_layers=6``)."""
    n, partition = cfg.model.n_layers, cfg.schedule.partition
    more = next(m for m in range(n + 1, n + pieces + 1) if max_pieces(m, partition) >= pieces)
    return [f"schedule.partition={p.value}" for p in Partition if max_pieces(n, p) >= pieces], f"model.n_layers={more}"
