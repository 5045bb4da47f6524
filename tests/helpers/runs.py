"""Configs composed as p3d-train composes them, and p3d run as a user runs it: a subprocess from the checkout,
its workers found by their placement lines, and nothing left running after a test."""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "p3d" / "conf"
PLACEMENT_PID = re.compile(r"\[rank (\d+)\] placement: .* pid (\d+)")


def compose(*overrides: str, run_dir: str = "/tmp/p3d-test-run"):
    """The composed DictConfig for these overrides, as Hydra's compose API makes it. Hydra composes each set of
    group choices (``model=small``, ``mesh=pp2``) once per test session (~0.2 s each: the groups are files that do
    not change during it, and their config refers to no environment variable); the value overrides are then applied
    to a copy by the same Hydra step that applies them after composing (test_compose_cache holds the two equal)."""
    groups, values = _split_overrides((f"run.dir={run_dir}", *overrides))
    if values is None:  # a sweep or a hydra.* override: Hydra composes the whole line
        return copy.deepcopy(_hydra_composed((f"run.dir={run_dir}", *overrides)))
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    cfg = copy.deepcopy(_hydra_composed(groups))
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as e:  # what Hydra's load_configuration raises for them
        raise ConfigCompositionException().with_traceback(e.__traceback__) from e
    return cfg


def hydra_compose(*overrides: str, run_dir: str = "/tmp/p3d-test-run"):
    """The composition of the whole line by Hydra, with no cache (what :func:`compose` must equal)."""
    return copy.deepcopy(_hydra_composed.__wrapped__((f"run.dir={run_dir}", *overrides)))


def _split_overrides(overrides: tuple[str, ...]):
    """(group choices as typed, the other overrides parsed), split as Hydra's defaults list splits them (a key that
    names a config group, with a value that is not a dict); (overrides, None) where Hydra must compose it all."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.is_sweep_override() or o.key_or_group.startswith("hydra") for o in parsed):
        return overrides, None
    is_group = [(CONF / o.key_or_group).is_dir() and not isinstance(o.value(), dict) for o in parsed]
    groups = tuple(o.input_line for o, g in zip(parsed, is_group, strict=True) if g)
    return groups, [o for o, g in zip(parsed, is_group, strict=True) if not g]


@functools.lru_cache(maxsize=1024)
def _hydra_composed(overrides: tuple[str, ...]):
    from hydra import compose as compose_api
    from hydra import initialize_config_dir

    from p3d.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose_api("config", overrides=list(overrides))


def compose_config(*overrides: str):
    """The typed Config for these overrides (what follows from other fields filled in), composed as p3d-plan
    composes it, without the run plan (the planner's tests model layouts p3d-train may refuse)."""
    from p3d.layout.run_plan import fill_derived
    from p3d.rundir.spec import to_config

    return fill_derived(to_config(compose(*overrides, run_dir="/tmp/p3d-plan-test")))


def typed(*overrides: str, run_dir: str = "/tmp/p3d-test-run"):
    """(Config, RunPlan) exactly as p3d-train prepares them from this command line."""
    from p3d.launch.check import prepare

    return prepare(compose(*overrides, run_dir=run_dir), overrides=[f"run.dir={run_dir}", *overrides])


def p3d_train(
    *args: str, timeout: float = 300, env: dict | None = None, drop_env: str | None = None
) -> subprocess.CompletedProcess:
    """Run p3d-train as a user would; output captured. ``env`` adds to this process's environment,
    from which the variables starting with ``drop_env`` are removed first."""
    return _command("p3d.cli", args, ROOT, timeout, env or {}, drop_env)


def p3d_plan(
    *args: str, cwd: Path = ROOT, timeout: float = 180, env: dict | None = None, drop_env: str | None = None
) -> subprocess.CompletedProcess:
    """Run p3d-plan as a user would (Hydra's short errors); ``env`` and ``drop_env`` as for :func:`p3d_train`."""
    return _command("p3d.cli.plan", args, cwd, timeout, {"HYDRA_FULL_ERROR": "0", **(env or {})}, drop_env)


def _command(module: str, args, cwd: Path, timeout: float, env: dict, drop_env: str | None):
    base = {k: v for k, v in os.environ.items() if not (drop_env and k.startswith(drop_env))}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **env},
    )


def assert_refused_in_one_line(overrides: tuple[str, ...], message: str, fix: str) -> None:
    """Preparing a run with ``overrides`` raises P3DConfigError in one line that holds ``message`` and ``fix``."""
    from p3d.config.errors import P3DConfigError

    with pytest.raises(P3DConfigError) as err:
        typed(*overrides)
    text = str(err.value)
    assert "\n" not in text
    assert message in text
    assert fix in text


def suggested_fixes(message: str) -> list[list[str]]:
    """The overrides a refusal suggests (``...; try mesh=pp2, or mesh.pp=3``): one list per alternative, its
    ``key=value`` words (prose around them left out)."""
    starts = list(re.finditer(r"[;:] (?:try|add) ", message))
    if not starts:
        return []
    tail = message[starts[-1].end() :]
    alternatives = re.split(r",? or |, ", tail)
    return [
        words for alt in alternatives if (words := [w for w in alt.split() if re.fullmatch(r"[a-z][a-z0-9_.]*=\S+", w)])
    ]


def assert_fixes_accepted(overrides: tuple[str, ...] | list[str], **kwargs) -> None:
    """Every fix the refusal of ``overrides`` suggests, appended to the same command line, is accepted (issue 50: a
    suggestion is always one the same command accepts)."""
    from p3d.config.errors import P3DConfigError

    with pytest.raises(P3DConfigError) as err:
        typed(*overrides, **kwargs)
    fixes = suggested_fixes(str(err.value))
    assert fixes, f"{' '.join(overrides)}: the refusal suggests no override: {err.value}"
    for fix in fixes:
        try:
            typed(*overrides, *fix, **kwargs)
        except P3DConfigError as exc:
            raise AssertionError(f"{' '.join(overrides)}: the suggested {' '.join(fix)} is refused: {exc}") from None


def output_tail(proc: subprocess.CompletedProcess, chars: int = 3000) -> str:
    """The end of a finished command's stdout and stderr, for an assertion's message."""
    return proc.stdout[-chars:] + proc.stderr[-chars:]


@functools.cache
def single_process_curve(*overrides: str) -> list[dict]:
    """The metrics (loss, grad_norm, lr, val_loss per step) of the ``to_sequential`` twin trained by a plain PyTorch
    loop on ``mesh=single`` with ``overrides``: the curve every layout must follow (p3d.train.reference)."""
    from p3d.train.reference import reference_run

    cfg, _ = typed("mesh=single", *overrides)
    return reference_run(cfg)


def assert_follows_curve(
    got: list[dict],
    ref: list[dict],
    rtol: float,
    norm_rtol: float | None = None,
    lr: bool = False,
    extra: tuple[str, ...] = (),
) -> None:
    """Every step of ``got`` has ``ref``'s loss and gradient norm within ``rtol`` (``norm_rtol`` for the norm, if
    given) and clipping was exercised; ``lr``: its learning rate too (1e-12); ``extra``: the figures named there
    within ``rtol`` where ``ref`` has them (the last step's val_loss, a mixture's moe_aux_loss)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    assert any(r["grad_norm"] > 1.0 for r in ref), "clipping must be exercised"
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=rtol), f"step {r['step']} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=norm_rtol or rtol), f"step {r['step']} grad norm"
        if lr:
            assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), f"step {r['step']} lr"
        for key in extra:
            if key in r:
                assert g[key] == pytest.approx(r[key], rel=rtol), f"step {r['step']} {key}"


def start_p3d_train(run_dir, *overrides: str, cwd: Path = ROOT, new_session: bool = False) -> subprocess.Popen:
    """p3d-train in the background, output captured; ``new_session``: its own process group, as a shell
    starts a foreground job (so a test can send the group a terminal's Ctrl-C)."""
    return subprocess.Popen(
        [sys.executable, "-m", "p3d.cli", f"run.dir={run_dir}", *overrides],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the live p3d workers of this run: the pids their placement lines give (logs/rank<R>.log;
    workers may be forked from the launcher and share its command line), each still named ``p3d-rank<R>``."""
    pids = {}
    for log in (Path(run_dir) / "logs").glob("rank*.log"):
        try:
            found = PLACEMENT_PID.findall(log.read_text(errors="replace"))
        except OSError:
            continue
        for rank, pid in found[-1:]:  # the latest launch's (a restart appends to the log)
            try:
                alive = Path(f"/proc/{pid}/comm").read_text().strip() == f"p3d-rank{rank}"
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if alive and state != "Z":
                pids[int(rank)] = int(pid)
    return pids


def kill_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Whatever happened in the test: no launcher or worker of this run survives it."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    for pid in worker_pids(run_dir).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail("training did not reach the expected step")


def copy_run(saved: Path, tmp_path: Path) -> Path:
    """A copy of run directory ``saved`` at ``tmp_path/run``, for a test to damage or resume."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run
