"""A real two-node Slurm cluster for the multi-node tests: ``.ci/slurm/two-node-slurm.sh`` runs nodes
n1 (10.77.0.2) and n2 (10.77.0.3) in their own network namespaces, each with its own hostname, and
slurmctld on a bridge (10.77.0.1); gloo crosses the namespaces. It runs beside the single-node
cluster of tests/cluster/slurm/ (other ports, other config: ``SLURM_CONF`` below is passed to each client
command, never set in this process, so that the single-node tests keep talking to theirs).

The session fixture starts the cluster when it is not up (idempotent: the script also restarts a
node a failed test left down) and stops it at the end only if this session started it. Every test
cancels, on the way out, the jobs that appeared on this cluster while it ran; every wait has a
deadline. The cluster has no accounting: job states come from ``scontrol`` only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT
from tests.helpers.slurm import DONE, NODES, SCRIPT, SLURM_CONF, client_env


def slurm(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """A Slurm client command against the two-node cluster."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=client_env())


def script(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def cluster_up() -> bool:
    """slurmctld answers on the two-node config and both nodes are usable."""
    if not Path(SLURM_CONF).is_file():
        return False
    try:
        if "UP" not in slurm("scontrol", "ping", timeout=10).stdout:
            return False
        states = slurm("sinfo", "-h", "-N", "-o", "%N %t", timeout=10).stdout.split("\n")
    except subprocess.TimeoutExpired:
        return False
    rows = dict(line.split() for line in states if line.strip())
    return sorted(rows) == list(NODES) and all(s in ("idle", "mix", "alloc") for s in rows.values())


def job_ids() -> set[str]:
    return set(slurm("squeue", "-h", "-o", "%i").stdout.split())


@pytest.fixture(scope="session")
def two_nodes():
    """The two-node cluster: found up (left running at the end) or started here (stopped at the end)."""
    if os.environ.get("CI") != "true" and os.geteuid() != 0:
        pytest.skip("the multi-node tests start network namespaces and Slurm daemons as root (.ci/slurm/README.md)")
    started = not cluster_up()
    result = script("start")  # idempotent: also brings back a node that is down
    assert result.returncode == 0, f"two-node-slurm.sh start failed:\n{result.stderr[-4000:]}"
    try:
        yield TwoNodes()
    finally:
        if started:
            stop = script("stop", timeout=120)
            assert stop.returncode == 0, stop.stderr[-2000:]


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """Cancel the jobs that appeared on the two-node cluster during this test (and only those)."""
    if "two_nodes" not in request.fixturenames:
        yield
        return
    before = job_ids()
    yield
    left = sorted(job_ids() - before)
    if left:
        slurm("scancel", *left)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and set(left) & job_ids():
            time.sleep(1)


class TwoNodes:
    """sbatch / scontrol on the two-node cluster, node loss and revival, all with deadlines."""

    nodes = NODES

    def sbatch(self, *args: str) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=client_env()
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def show(self, job: str) -> dict[str, str]:
        """scontrol's fields of the job ({} once the controller forgot it)."""
        text = slurm("scontrol", "show", "job", "-o", job).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))

    def state(self, job: str) -> str:
        return self.show(job).get("JobState", "UNKNOWN")

    def wait(self, job: str, until: set[str] | None = None, timeout: float = 240) -> str:
        until = until or DONE
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in until:
                return state
            time.sleep(0.5)
        slurm("scancel", job)
        pytest.fail(f"job {job} still {state} after {timeout:.0f}s; cancelled it")

    def pids_on(self, node: str) -> list[int]:
        """The processes in the node's network namespace (its slurmd, and the job steps running there)."""
        out = subprocess.run(["ip", "netns", "pids", f"p3d{node}"], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, node: str, first: Sequence[int] = ()) -> None:
        """The node is lost: SIGKILL ``first`` (its processes, listed beforehand: no delay of a script
        start on a loaded machine), then kill-node, which SIGKILLs whatever else runs there."""
        for pid in first:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        result = script("kill-node", node, timeout=60)
        assert result.returncode == 0, result.stderr

    def revive_node(self, node: str) -> None:
        result = script("revive-node", node, timeout=120)
        assert result.returncode == 0, result.stderr

    def release_requeued(self, job: str) -> None:
        """Start a requeued job now, not after Slurm's requeue delay (see tests/cluster/slurm/conftest.py:
        a credential issued in the second the first run's was revoked would be refused)."""
        time.sleep(5.0)
        assert slurm("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0


def shrunk_then_requeued(
    two_nodes, job: str, log_path: Path, run_dir: Path, steps: int, changes, until: float, while_shrunk=None
) -> tuple[str, float]:
    """An elastic job loses n2 (killed with its workers) and goes on on n1 (the job RUNNING throughout, until its first
    ``changes()`` record, before ``until``); ``while_shrunk`` then checks more. n2 revived, the time-limit signal:
    the workers checkpoint and exit 75, the job requeues, and released at once (Slurm holds a requeued job ~2 min) it
    completes on both nodes. Returns the job's log and when n2 was killed (``time.time()``)."""
    from tests.helpers.slurm import steps_done

    on_n2 = two_nodes.pids_on("n2")
    revived = False
    try:
        two_nodes.kill_node("n2", first=on_n2)
        killed = time.time()
        while not changes():  # the first step on n1 alone
            assert time.monotonic() < until, log_path.read_text()[-4000:]
            assert two_nodes.state(job) == "RUNNING", log_path.read_text()[-4000:]
            time.sleep(0.2)
        if while_shrunk is not None:
            while_shrunk()
        two_nodes.revive_node("n2")
        revived = True
        assert slurm("scancel", "--batch", "--signal=USR1", job).returncode == 0  # checkpoint, exit 75, requeue
        two_nodes.wait(job, until={"PENDING", "COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
        assert max(steps_done(run_dir)) < steps, "the run ended before the signal: raise its steps"
        two_nodes.release_requeued(job)
        state = two_nodes.wait(job, timeout=300)
        log = log_path.read_text()
        assert state == "COMPLETED", log[-4000:]
    finally:
        if not revived:
            two_nodes.revive_node("n2")
    return log, killed
