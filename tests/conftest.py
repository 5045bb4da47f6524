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


# What make test runs alone, after the tier that runs two tests at once (pytest -n 2): the tests that time their
# processes or race a signal, a kill or a deadline against them (another test's load would move what they measure),
# and tests/cluster/, whose jobs share one Slurm cluster. Every other test's worker processes or commands only
# compute, so two of them side by side take both cores that one leaves idle while it starts, writes or waits.
SERIAL = (
    "tests/cluster/",
    "tests/workers/test_bubble_schedules.py",  # sleep-timed blocks against each schedule's theory
    "tests/workers/test_calibrate.py",  # the probes time the machine
    "tests/workers/test_dp_collectives.py",  # the dp clocks' own and exposed seconds
    "tests/workers/test_overlap.py",  # sleep-timed blocks: the exposed share of the dp reduction
    "tests/e2e/test_observe.py::test_time_blocked_in_dp_collectives_is_measured",  # a slowed rank's seconds
    "tests/e2e/test_trace.py",  # a traced step's span and waits against step_time_s and the bubble, within 5%
    "tests/e2e/test_hetero_timing.py",  # a simulated mixed cluster's step against p3d-plan's, within 15%
    "tests/e2e/test_run_lock.py::test_ctrl_c",  # Ctrl-C at chosen delays
    "tests/e2e/test_run_lock.py::test_the_lease_of_a_sigkilled_run",  # SIGKILL mid-run
    "tests/e2e/test_elastic_local.py",  # a node lost mid-step, the survivors' timeouts
    "tests/e2e/test_checkpoint_async.py::test_sigkill",  # a kill during a background write
    "tests/e2e/test_checkpoint_async.py::test_a_stop_signal",  # a stop signal during a background write
    "tests/e2e/test_durable.py::test_sigterm",  # SIGTERM mid-run
    "tests/e2e/test_durable.py::test_sigkill",  # SIGKILL during a save
    "tests/e2e/test_faults.py::test_a_slowed_rank_is_named_as_the_straggler",
    "tests/e2e/test_faults.py::test_a_stopped_worker_is_named_and_the_others_dump_their_stacks",
    "tests/e2e/test_faults.py::test_a_killed_worker",
    "tests/e2e/test_faults.py::test_a_worker_killed",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a variant make test leaves to make test-all (tests/helpers/tiers.py)")
    config.addinivalue_line("markers", "serial: run alone, after the tier of two tests at once (tests/conftest.py)")
    # matplotlib runs fc-list once per machine to build its font cache; build it now, so that the first plotting
    # test of tests/unit/ on a fresh machine is not taken for one that starts a process
    import matplotlib.font_manager  # noqa: F401


UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


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
