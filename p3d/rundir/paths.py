"""Paths the user gives, resolved once in the launcher against the directory the command ran from.

Every command (``p3d-train``, ``p3d-plan``, ``p3d-tokenizer``, ``p3d-export``, ``p3d-report``) turns
the paths of its arguments into absolute ones here, with ``~`` expanded, before anything reads or
writes them; ``p3d-train`` freezes them so in ``run_spec.yaml``. Workers, resume, sweeps and reports
then never depend on a working directory (Hydra does not change it here: ``hydra.job.chdir=false``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

Base = Optional["str | Path"]


def user_cwd() -> Path:
    """The directory the user ran the command from (Hydra's record of it when Hydra runs)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        cwd = HydraConfig.get().runtime.cwd
        if cwd:
            return Path(cwd)
    return Path.cwd()


def absolute(path: str | Path, base: Base = None) -> Path:
    """``path`` with ``~`` expanded, made absolute against ``base`` (default: the user's cwd) and
    normalised (``a/../b`` -> ``b``); symbolic links are kept as the user named them."""
    expanded = os.path.expanduser(str(path))
    return Path(os.path.normpath(os.path.join(str(base) if base is not None else user_cwd(), expanded)))


def absolute_globs(spec: str, base: Base = None) -> str:
    """A comma-separated list of paths or globs, each made absolute (its wildcards kept)."""
    return ",".join(str(absolute(part.strip(), base)) for part in spec.split(",") if part.strip())


def resolve_config_paths(cfg, base: Base = None):
    """The typed Config with every user-given path absolute: ``run.dir``, ``data.path`` (files; its
    globs; prepared: the store, and each ``data.mix`` store), ``data.tokenizer`` (unless ``byte`` or
    ``auto``), ``train.resume`` (unless ``none``/``auto``),
    ``model.init_from``, ``tokenizer.out`` and ``calibration``."""
    from p3d.config.schema import DataSource

    base = base if base is not None else user_cwd()
    rep = dataclasses.replace
    data, train, model = cfg.data, cfg.train, cfg.model
    if data.source == DataSource.files and data.path:
        data = rep(data, path=absolute_globs(data.path, base))
    if data.source == DataSource.prepared:
        if data.path:
            data = rep(data, path=str(absolute(data.path, base)))
        data = rep(data, mix=[rep(m, path=str(absolute(m.path, base))) for m in data.mix])
    if data.tokenizer not in ("byte", "auto"):
        data = rep(data, tokenizer=str(absolute(data.tokenizer, base)))
    if train.resume not in ("none", "auto"):
        train = rep(train, resume=str(absolute(train.resume, base)))
    if model.init_from:
        model = rep(model, init_from=str(absolute(model.init_from, base)))
    calibration = str(absolute(cfg.calibration, base)) if cfg.calibration else cfg.calibration
    return rep(
        cfg,
        calibration=calibration,
        data=data,
        train=train,
        model=model,
        run=rep(cfg.run, dir=str(absolute(cfg.run.dir, base))),
        tokenizer=rep(cfg.tokenizer, out=str(absolute(cfg.tokenizer.out, base))),
    )


# ---- where Hydra writes its own output (.hydra/ and the sweep's multirun.yaml)


def _quoted(path: Path) -> str | None:
    """``path`` as a Hydra override value; None when it holds characters Hydra would read as syntax."""
    text = str(path)
    return None if any(c in text for c in "'\\$") else f"'{text}'"


def _given_run_dir(argv: list[str]) -> tuple[str | None, bool]:
    """(the run.dir value on the command line, whether it is a sweep over several values)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in argv if a.split("=", 1)[0] == "run.dir"]
    if not given:
        return None, False
    try:
        override = OverridesParser.create().parse_override(given[-1])
    except Exception:
        return None, False
    if override.is_sweep_override():
        return None, True
    value = override.value()
    return (value if isinstance(value, str) and "${" not in value else None), False


def hydra_output_overrides(argv: list[str], base: Base = None) -> list[str]:
    """``argv`` with Hydra's own output moved into the run directory when ``run.dir`` is given, so that
    nothing appears under ``./outputs`` or ``./multirun``:

    - a single run: ``hydra.run.dir`` = the run directory, and no ``.hydra/`` (``run_spec.yaml`` is the
      run's frozen config; also without ``run.dir``), so a refused config leaves nothing behind;
    - a ``-m`` sweep with one ``run.dir``: that directory is the sweep's (``hydra.sweep.dir``), each
      point running in ``<run.dir>/<n>``, as the points of a sweep without ``run.dir`` do.

    A ``hydra.run.dir`` / ``hydra.sweep.dir`` the user gives wins. A swept ``run.dir=a,b`` is left as
    it is (each point writes its run there; Hydra's per-point ``.hydra/`` stays in the sweep dir)."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    multirun = any(a in ("-m", "--multirun") for a in argv) or "hydra.mode=MULTIRUN" in argv
    value, _ = _given_run_dir(argv)
    if value is None:  # Hydra's default ./outputs/<date>/<time>; still no .hydra/ for a single run
        single = not multirun and "hydra.output_subdir" not in keys
        return argv + ["hydra.output_subdir=null"] if single else argv
    target = _quoted(absolute(value, base))
    if target is None:
        return argv
    if not multirun:
        extra = [] if "hydra.run.dir" in keys else [f"hydra.run.dir={target}"]
        if "hydra.output_subdir" not in keys:
            extra.append("hydra.output_subdir=null")
        return argv + extra
    if "hydra.sweep.dir" in keys:
        return argv
    return [a for a in argv if a.split("=", 1)[0] != "run.dir"] + [f"hydra.sweep.dir={target}"]


def missing_run_dirs(argv: list[str], base: Base = None) -> list[Path]:
    """The run directory of a single run and its parents that do not exist yet (deepest first): Hydra
    creates them before p3d can refuse a config, and ``remove_if_empty`` takes them back."""
    multirun = any(a in ("-m", "--multirun") for a in argv) or "hydra.mode=MULTIRUN" in argv
    value, _ = _given_run_dir(argv)
    if value is None or multirun:
        return []
    out, path = [], absolute(value, base)
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def remove_if_empty(dirs: list[Path]) -> None:
    """Remove these directories, deepest first, while they are empty (never anything written into them)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # not empty, or gone: keep the rest too
            return
