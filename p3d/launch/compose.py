"""Compose with Hydra once, in the launching process, and report config errors in one line.

``run_hydra(task)`` runs ``task(cfg_node) -> exit status`` under ``hydra.main`` and returns the status:
the task's own, 2 for a config Hydra cannot compose (unknown group option, bad override, wrong type: a value its
field cannot hold is refused in one line before Hydra runs, p3d.launch.override_types), or a sweep's
(``p3d.exit_codes.SweepNotDone``).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from p3d import exit_codes
from p3d.config.schema import register_configs
from p3d.config.shipped import conf_dir
from p3d.console import error
from p3d.launch.override_keys import refused_key
from p3d.launch.override_types import wrong_type

CONFIG_PATH = str(conf_dir())


def config_groups() -> set[str]:
    """The config groups of ``conf/`` (model, mesh, schedule, ...), Hydra's own left out."""
    return {p.name for p in Path(CONFIG_PATH).iterdir() if p.is_dir() and p.name != "hydra"}


def given_overrides() -> list[str]:
    """The overrides on this command line (empty outside Hydra)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _split_head(message: str) -> tuple[str, str]:
    """('field=value', the rest) of a refusal: the value ends at the first space outside brackets and quotes, so a
    list or mapping value (``schedule.stage_blocks=[3, 2]``) stays whole."""
    depth, quote = 0, ""
    for i, ch in enumerate(message):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == " " and depth <= 0:
            return message[:i], message[i + 1 :]
    return message, ""


def message_field(message: str) -> str | None:
    """The one field a refusal starts with ('mesh.tp=4 must ...' -> 'mesh.tp'), None if it names none (tp*pp*dp)
    or already says where it was set."""
    head, rest = _split_head(message)
    head = head.removesuffix(":")  # 'model.init_from=/x: no config.json there'
    field = head.split("=", 1)[0]
    if "=" not in head or not re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", field) or rest.startswith("("):
        return None
    return field


def insert_source(message: str, where: str) -> str:
    """'mesh.tp=4 must ...' -> 'mesh.tp=4 (<where>) must ...'."""
    head, rest = _split_head(message)
    colon = ":" if head.endswith(":") else ""
    return f"{head.removesuffix(':')} ({where}){colon} {rest}"


def with_source(message: str) -> str:
    """Insert where the offending field was set: 'mesh.tp=4 (mesh/tp4.yaml) must divide ...'. A resume's refusal
    names the resumed spec itself where that gave the value (p3d.launch.resume_base.Resumed.sourced)."""
    field = message_field(message)
    if field is None or not HydraConfig.initialized():
        return message  # not one field (e.g. tp*pp*dp), its source said already, or no Hydra to ask
    hc = HydraConfig.get()
    if any(o.lstrip("+~").startswith(f"{field}=") for o in hc.overrides.task):
        where = "command line"
    else:
        group = field.split(".", 1)[0]
        choice = hc.runtime.choices.get(group)
        where = f"{group}/{choice}.yaml" if choice else "config.yaml"
    return insert_source(message, where)


def report_error(message: str, status: int = exit_codes.CONFIG_ERROR, prefix: str = "p3d") -> int:
    """Print one line on stderr; return ``status`` (the caller's exit status)."""
    error(message, prefix)
    return status


def config_error(message: str, multirun: bool = False) -> int:
    """A config error as the user sees it: where the field was set; a sweep goes on to its next point."""
    msg = with_source(message)
    if multirun:
        return report_error(f"skipped this point, config error: {msg}")
    return report_error(f"config error: {msg}")


def is_multirun() -> bool:
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _no_hydra_outputs(argv: list[str], name: str) -> list[str]:
    """Keep Hydra from creating output directories for a command that writes no run."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    defaults = {
        "hydra.output_subdir": "null",
        "hydra.run.dir": ".",
        "hydra.sweep.dir": str(Path(tempfile.gettempdir()) / name),
    }
    return argv + [f"{k}={v}" for k, v in defaults.items() if k not in keys]


def moe_field_of_a_dense_model(argv: list[str]) -> str | None:
    """The one-line refusal of ``model.moe.<field>=...`` on a dense model preset (``model.moe: null``, which
    OmegaConf cannot give fields: it would fail deep in Hydra with a traceback), or None."""
    fields = [a.lstrip("+") for a in argv if a.lstrip("+").startswith("model.moe.")]
    if not fields:
        return None
    choices = [a.split("=", 1)[1] for a in argv if a.startswith("model=")]
    model = choices[-1].split(",")[0] if choices else _default_choice("model")
    preset = Path(CONFIG_PATH) / "model" / f"{model}.yaml"
    if not preset.is_file() or re.search(r"^moe:\s*$", preset.read_text(), re.MULTILINE):
        return None  # an MoE preset (its moe: mapping), or a name Hydra refuses itself
    return (
        f"{fields[0]}: model={model} is a dense model (model.moe: null), with no model.moe fields to set; start "
        f"from a mixture-of-experts preset, e.g. model=moe_tiny {fields[0]} (also mixtral_8x7b, deepseek_moe_16b; "
        "docs/moe.md)"
    )


def _default_choice(group: str) -> str:
    found = re.search(rf"^\s*- {group}: (\S+)", (Path(CONFIG_PATH) / "config.yaml").read_text(), re.MULTILINE)
    return found.group(1) if found else ""


def run_hydra(task: Callable[[DictConfig], int], writes_outputs: bool = True) -> int:
    """Compose with Hydra, run ``task``; its exit status (the worst of a sweep's points, or the sweep's)."""
    argv = sys.argv[1:]
    # before Hydra's own reports of several lines
    refused = (
        moe_field_of_a_dense_model(argv) or refused_key(argv, Path(CONFIG_PATH), config_groups()) or wrong_type(argv)
    )
    if refused:
        return report_error(f"config error: {refused}")
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not multirun and any(a.lower() in ("dry_run=true", "+dry_run=true") for a in argv):
        writes_outputs = False  # a dry run prints and writes nothing
    if not writes_outputs:
        sys.argv = [sys.argv[0]] + _no_hydra_outputs(argv, Path(sys.argv[0]).name)
    made: list[Path] = []
    if writes_outputs:  # with run.dir given, Hydra runs there, never in ./outputs; no .hydra/ for one run
        from p3d.rundir.paths import hydra_output_overrides, missing_run_dirs

        made = missing_run_dirs(argv)
        sys.argv = [sys.argv[0]] + hydra_output_overrides(argv)
    started = time.time()
    out_dirs: list[Path] = []
    status = _run(task, out_dirs)
    if status == exit_codes.CONFIG_ERROR and writes_outputs and not multirun:  # refused: leave no directory
        from p3d.rundir.paths import remove_if_empty

        remove_if_empty(made or _made_since(out_dirs, started))
    return status


def _made_since(out_dirs: list[Path], started: float) -> list[Path]:
    """Hydra's default run directory (outputs/<date>/<time>) and the parents it made for this run."""
    made: list[Path] = []
    for path in out_dirs[:1]:
        while path != Path.cwd() and path.is_dir() and path.stat().st_ctime >= started - 1:
            made.append(path)
            path = path.parent
    return made


def _run(task: Callable[[DictConfig], int], out_dirs: list[Path]) -> int:
    statuses: list[int] = []

    def task_started(cfg_node: DictConfig) -> int:
        if HydraConfig.initialized():
            out_dirs.append(Path(HydraConfig.get().runtime.output_dir))
        status = task(cfg_node)
        statuses.append(status)
        return status

    register_configs()
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")(task_started)()
    except exit_codes.SweepNotDone as exc:
        return int(exc.code or exit_codes.WORKER_FAILED)
    except SystemExit as exc:  # Hydra's own exit: a config it cannot compose, --help, --cfg
        if not statuses and exc.code not in (0, None):
            return exit_codes.CONFIG_ERROR
        return int(exc.code or 0) if isinstance(exc.code, int) else exit_codes.OK
    # one run: its status; a sweep's points are judged by its callback, which raised SweepNotDone if any failed
    return statuses[0] if len(statuses) == 1 else exit_codes.OK
