"""The Slurm clusters of the cluster tests (tests/cluster/): the one-node cluster of .ci/slurm/start-local-slurm.sh and
the two nodes of .ci/slurm/two-node-slurm.sh, and what their tests read back (steps, losses, placements)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import ROOT

RECIPE = str(ROOT / "recipes" / "slurm" / "train.sbatch")


def run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def steps_done(run_dir) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(run_dir)]
    except (OSError, ValueError):
        return []


def complete_checkpoints(run_dir) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(d.name for d in root.glob("step_*") if (d / "meta.json").is_file()) if root.is_dir() else []


def stopped_requeued_and_resumed(
    cluster, job: str, run_dir: Path, log_path: Path, steps: int, scancel, while_pending=None
):
    """The time-limit signal's path (``--signal=B:USR1@N``, sent here at once by ``scancel``, the cluster's
    ``scancel --batch --signal=USR1 <job>``) once the job has run two steps: the workers checkpoint and exit 75, and
    the job requeues itself (pending again, same id; ``while_pending`` then checks more). Released early (Slurm holds
    a requeued job ~2 min, the test stays short), it completes, and its second start resumes at the checkpoint's next
    step. Returns (the checkpoint's step, the job's log, run.dir's slurm_jobs.log)."""
    wait_for(lambda: len(steps_done(run_dir)) >= 2, 180, "two training steps")
    assert scancel().returncode == 0
    state = cluster.wait(job, until={"PENDING", "COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    assert state == "PENDING", log_path.read_text()[-3000:]
    if while_pending is not None:
        while_pending()
    stopped_at = complete_checkpoints(run_dir)
    assert stopped_at, "no complete checkpoint after the stop signal"
    k = int(stopped_at[-1].split("_")[1])
    assert 2 <= k < steps
    cluster.release_requeued(job)
    state = cluster.wait(job, timeout=240)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    jobs_log = (run_dir / "slurm_jobs.log").read_text()
    assert f"{job} exit 75 after SIGUSR1" in jobs_log and f"{job} requeue after restart 0" in jobs_log
    assert f"{job} start (restart 1)" in jobs_log and f"{job} exit 0" in jobs_log
    second = log[log.index("(restart 1)") :]  # the second start resumed: its first step is k + 1
    first_step = re.search(r"step\s+(\d+)/", second)
    assert first_step and int(first_step.group(1)) == k + 1, second[:3000]
    return k, log, jobs_log


# ---- the two-node cluster

SCRIPT = ROOT / ".ci" / "slurm" / "two-node-slurm.sh"
BASE = Path(os.environ.get("TWO_NODE_BASE", "/tmp/two-node-slurm"))
SLURM_CONF = str(BASE / "slurm.conf")
NODES = ("n1", "n2")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}


def client_env(**extra: str) -> dict[str, str]:
    """This process's environment with the two-node cluster's SLURM_CONF (and P3D_PYTHON for the recipe)."""
    return {**os.environ, "SLURM_CONF": SLURM_CONF, "P3D_PYTHON": sys.executable, **extra}


PLACEMENT = re.compile(r"\[rank (\d+)\] placement: host (\S+) dp (\d+) pp (\d+) tp (\d+) local (\d+)")


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


def placements(run_dir: Path) -> dict[int, tuple[str, int, int, int, int]]:
    """rank -> (host, dp, pp, tp, local rank) from the placement line of each rank's log (first start)."""
    found = {}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        match = PLACEMENT.search(log.read_text())
        assert match, f"no placement line in {log}"
        rank, host, *coords = match.groups()
        found[int(rank)] = (host, *map(int, coords))
    return found


def hosts_of(groups: list[list[int]], host: dict[int, str]) -> list[set[str]]:
    return [{host[r] for r in group} for group in groups]
