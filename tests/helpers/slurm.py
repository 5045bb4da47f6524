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
