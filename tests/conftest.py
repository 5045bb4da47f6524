"""Markers, the tiers and the fixtures every test may use; the helpers are in tests/helpers/."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every worker the suite starts runs its steps under the device check (p3d.parallel.device_check): a host tensor
# handed to a collective fails here as it would on NCCL.
os.environ.setdefault("P3D_TEST_DEVICE_CHECK", "1")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def make_cfg():
    """``make_cfg(*overrides)``: a typed Config as p3d-plan composes it (tests/helpers/runs.py compose_config)."""
    from tests.helpers.runs import compose_config

    return compose_config


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a variant make test leaves to make test-all (tests/helpers/tiers.py)")
    # matplotlib runs fc-list once per machine to build its font cache; build it now, so that the first plotting
    # test of tests/unit/ on a fresh machine is not taken for one that starts a process
    import matplotlib.font_manager  # noqa: F401


UNIT = Path(__file__).parent / "unit"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test under tests/unit/ (the in-process tier, ``make test-fast``) that starts a process fails and says
    where it belongs, so the quick tier stays in-process whatever a test grows into."""
    if UNIT not in Path(str(request.node.path)).parents:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process: it belongs in tests/workers/ (gloo workers), tests/e2e/ "
            "(p3d's commands) or tests/cluster/ (Slurm)"
        )

    import multiprocessing.process

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
