"""A real Slurm cluster for the tests: one node on this machine, started once per session by
``.ci/slurm/start-local-slurm.sh`` (munge, slurmctld, slurmd, MariaDB + slurmdbd accounting;
idempotent, about 3 s when already up). Nothing here mocks Slurm: jobs are submitted with sbatch,
their states read from scontrol / sacct, and every wait has a deadline (then the job is cancelled).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT
from tests.helpers.slurm import run

START = ROOT / ".ci" / "slurm" / "start-local-slurm.sh"
SLURM_CONF = Path("/etc/slurm/slurm.conf")
OURS = "# managed by start-local-slurm.sh"
DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


@pytest.fixture(scope="session")
def slurm_cluster():
    """Start (or find running) the local one-node cluster; skip only where it cannot be ours to start."""
    ci = os.environ.get("CI") == "true"
    if not ci:
        if os.geteuid() != 0:
            pytest.skip("the Slurm tests start a local cluster as root (see .ci/slurm/README.md)")
        if SLURM_CONF.exists() and OURS not in SLURM_CONF.read_text():
            pytest.skip(f"{SLURM_CONF} belongs to another Slurm installation; not reconfiguring it")
    result = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"start-local-slurm.sh failed:\n{result.stderr[-4000:]}"
    assert shutil.which("sbatch"), "sbatch not on PATH after starting the cluster"
    return Slurm()


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """One node holds every job: a job a failed test leaves behind would keep the next tests' jobs
    pending until they time out. Cancel whatever this user still has queued or running."""
    yield
    if "slurm_cluster" in request.fixturenames and shutil.which("scancel"):
        import getpass

        run("scancel", f"--user={getpass.getuser()}")


class Slurm:
    """sbatch / scontrol / sacct with deadlines."""

    env = {**os.environ, "P3D_PYTHON": sys.executable}

    def sbatch(self, *args: str, cwd: Path = ROOT) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=self.env
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The controller's state of the job's current run (sacct's when the controller forgot it)."""
        out = run("scontrol", "show", "job", job)
        for word in out.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        rows = self.sacct(job)
        return rows[-1]["State"].split()[0] if rows else "UNKNOWN"

    def sacct(self, job: str, steps: bool = False) -> list[dict[str, str]]:
        """One dict per run of the job (-D: a requeued job's earlier runs too), or per step."""
        fields = "JobID,State,ExitCode,NNodes,NTasks,Start,End"
        out = run("sacct", "-j", job, "-D", "-n", "-P", "-o", fields, *([] if steps else ["-X"]))
        names = fields.split(",")
        return [dict(zip(names, line.split("|"))) for line in out.stdout.splitlines() if line.strip()]

    def wait(self, job: str, until: set[str] | None = None, timeout: float = 240) -> str:
        """Poll until the job reaches one of ``until`` (default: a final state); cancel it on the deadline."""
        until = until or DONE
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in until:
                return state
            time.sleep(1)
        run("scancel", job)
        pytest.fail(f"job {job} still {state} after {timeout:.0f}s; cancelled it")

    def release_requeued(self, job: str) -> None:
        """Start a requeued (pending, held) job now instead of after Slurm's requeue delay.

        The delay exists because slurmd revoked the first run's job credential when it ended, and
        it compares the revocation with the new credential's creation time in whole seconds: a
        credential issued in the same second is taken as revoked ("Job credential revoked", the
        job FAILS at once). The revocation comes with the controller's kill of the first run, about when
        the job shows PENDING again; a few seconds more leave only the safe case, even on a loaded machine."""
        time.sleep(5.0)
        assert run("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0

    def wait_accounted(self, job: str, runs: int = 1, timeout: float = 30) -> list[dict[str, str]]:
        """sacct's rows once it has recorded ``runs`` finished runs (accounting lags the controller)."""
        deadline = time.monotonic() + timeout
        rows: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            rows = self.sacct(job)
            if len(rows) >= runs and rows[-1]["State"].split()[0] in DONE:
                return rows
            time.sleep(1)
        pytest.fail(f"sacct did not record job {job} as finished within {timeout:.0f}s: {rows}")
