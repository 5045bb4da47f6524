"""Shared test helpers: Hydra compose, p3d-train as a subprocess, gloo process groups."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "p3d" / "conf"
PLACEMENT_PID = re.compile(r"\[rank (\d+)\] placement: .* pid (\d+)")

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
    from p3d.launch.check import prepare

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


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


# The slow tier: end-to-end variants whose path a case in `make test` already runs, kept out of `make test` so
# that CI (one run of the suite on 2 cores, 90 minutes at most) keeps a margin; `make test-all` runs them too.
# Each line: the test, then the case `make test` keeps for the same path. Seconds measured in one CI run here.
SLOW_TIER = {
    # 113 s: node loss at a save; kept: the two-node job, requeue on a Slurm signal (test_slurm_jobs)
    "tests/multinode/test_two_nodes.py::test_node_lost_during_a_save_requeues_and_resumes_to_the_same_losses",
    # 27 s; kept: the two-node job reproducing the one-node losses
    "tests/multinode/test_p3d_train_two_nodes.py::test_sweep_runs_a_two_node_point_with_the_one_node_points_losses",
    # 96 + 75 s; kept: the same SIGTERM -> 75 -> resume under zbv, Ctrl-C once -> resume bitwise (test_run_lock)
    "tests/test_durable.py::test_sigterm_then_resume_reproduces_the_uninterrupted_run[stage1]",
    "tests/test_durable.py::test_sigterm_then_resume_reproduces_the_uninterrupted_run[stage0]",
    # 87 s; kept: SP parity meshes, SP checkpoints resumed under other layouts (test_layouts), SP p2p bytes
    "tests/test_sp_resume.py::test_sp_off_and_on_again_continues_the_sp_run",
    # parity variants, 56 + 40 + 38 + 36 + 21 s; kept: tp2-sp and tp4-padded-vocab, tp2-compile-recompute,
    # single-fused-adamw and dp2_pp2_tp2-zero1, tp2_pp2-sp and dp2_pp2_tp2-sp-selective, tp2_pp2-tied and -sp
    "tests/test_parity.py::test_mesh_matches_single_process[tp4-sp]",
    "tests/test_parity.py::test_mesh_matches_single_process[single-compile]",
    "tests/test_parity.py::test_mesh_matches_single_process[dp2_pp2_tp2-zero1-fused-adamw]",
    "tests/test_parity.py::test_mesh_matches_single_process[dp2_pp2_tp2-zero1-sp]",
    "tests/test_parity.py::test_mesh_matches_single_process[tp2_pp2-tied-sp]",
    # 51 s; kept: the stopped worker after its schedule (DeepSpeed) and under zbv
    "tests/test_faults.py::test_a_stopped_worker_is_named_and_the_others_dump_their_stacks[sent]",
    # 18 s; kept: stage0, bf16 and interleaved
    "tests/test_faults.py::test_skip_discards_the_update_bitwise[stage1]",
    # 45 + 31 s; kept: dp2_pp2_tp2+zero1->single, pp2->dp2, the issue-11 chain dp2_pp2_tp2 -> pp4 v2 -> tp2_pp2
    "tests/test_layouts.py::test_resume_under_another_mesh_continues_the_curve[dp2_pp2_tp2->tp2_pp2]",
    "tests/test_layouts.py::test_resume_under_another_mesh_continues_the_curve[tp2_pp2->pp4]",
    # 42 + 14 s; kept: dp2_pp2_tp2-zero1, dp2_pp2_tp2-zero1-sp-selective, single
    "tests/test_bf16.py::test_bf16_tracks_the_fp32_curve[dp2_pp2_tp2]",
    "tests/test_bf16.py::test_bf16_tracks_the_fp32_curve[single-zero1]",
    # 33 s; kept: the time-limit signal's requeue and resume
    "tests/slurm/test_slurm_jobs.py::test_sweep_job_signalled_before_its_time_limit_requeues_and_resumes",
    # 23 s; kept: the killed worker restarted within the allocation (the same decision, tested in-process)
    "tests/slurm/test_slurm_restarts.py::test_a_worker_killed_at_the_same_step_again_fails_the_job",
    # 20 + 17 s; kept: the chain (1f1b -> interleaved -> zbv), the ZeRO-1 cases both ways, 1f1b -> zbv tied
    "tests/test_schedule_runs.py::test_resume_across_schedules_continues_the_curve[1f1b-to-interleaved_1f1b]",
    "tests/test_schedule_runs.py::test_resume_across_schedules_continues_the_curve[interleaved_1f1b-to-1f1b]",
    # documented lines, 23 + 34 + 40 s; kept: `p3d-train` (the job make train runs), the sweep
    # `p3d-train -m mesh=dp2,tp2,pp2 train.steps=20`, the Slurm sweep through submitit (test_slurm_jobs)
    "tests/test_documented_commands.py::test_documented_line[make train]",
    "tests/test_documented_commands.py::test_documented_line[p3d-train -m mesh=dp4,tp2_pp2,pp4 train.steps=50]",
    "tests/slurm/test_documented_slurm.py::test_documented_slurm_line[p3d-train -m cluster=slurm mesh=dp4,tp2_pp2,pp4"
    " train.steps=50]",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "procs: starts processes (workers, p3d-train, Slurm jobs): make test only")
    config.addinivalue_line("markers", "slow: a variant make test leaves to make test-all (SLOW_TIER in conftest)")
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_TIER:
            item.add_marker(pytest.mark.slow)
