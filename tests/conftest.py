"""Shared test helpers: Hydra compose, p3d-train as a subprocess, gloo process groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def compose(*overrides: str, run_dir: str = "/tmp/p3d-test-run"):
    """The composed DictConfig for these overrides, through Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from p3d.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[f"run.dir={run_dir}", *overrides])


def typed(*overrides: str, run_dir: str = "/tmp/p3d-test-run"):
    """(Config, RunPlan) exactly as p3d-train prepares them."""
    from p3d.launch.prepare import prepare

    return prepare(compose(*overrides, run_dir=run_dir))


def p3d_train(
    *args: str, timeout: float = 300, env: dict | None = None, drop_env: str | None = None
) -> subprocess.CompletedProcess:
    """Run p3d-train as a user would; output captured. ``env`` adds to this process's environment,
    from which the variables starting with ``drop_env`` are removed first."""
    base = {k: v for k, v in os.environ.items() if not (drop_env and k.startswith(drop_env))}
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


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
    """rank -> pid of the p3d workers of this run (read from /proc)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            if b"p3d.worker" not in cmd or str(run_dir).encode() not in cmd:
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv)
            pids[int(env["RANK"])] = int(proc.name)
        except (OSError, KeyError, ValueError):
            continue
    return pids


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def pytest_configure(config):
    config.addinivalue_line("markers", "procs: starts processes (workers, p3d-train, Slurm jobs): make test only")
    if os.environ.get("P3D_TEST_TIER") == "fast":
        # matplotlib runs fc-list once per machine to build its font cache; build it before the guard below,
        # so that the first plotting test on a fresh machine is not taken for one that starts a process
        import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """Under ``make test-fast`` (P3D_TEST_TIER=fast) a test that starts a process fails and says to mark
    it ``procs``, so the quick tier stays in-process whatever a test grows into."""
    if os.environ.get("P3D_TEST_TIER") != "fast" or request.node.get_closest_marker("procs"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.procs")

    import multiprocessing.process

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
