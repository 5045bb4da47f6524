"""Run a benchmark's worker and read its CPU time at each step it records (Linux /proc): the CPU seconds
between two step records move far less than wall time when other processes compete for the cores.
Used by bench/overhead.py (and through it bench/compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
POLL_S = 0.02


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15 of stat)


def find_pid(marker: str) -> int | None:
    """The p3d-train worker of this run: a process named ``p3d-rank0`` (p3d.train.worker.name_process) whose
    command line holds ``marker`` (its run directory: in the spec path of a fresh worker, or the launcher's
    ``run.dir=`` of a forked one)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                name = (d / "comm").read_text().strip()
                cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if name == "p3d-rank0" and marker in cmdline:
                return int(d.name)
    return None


def run_monitored(
    cmd: list[str],
    env: dict,
    log: Path,
    out: Path,
    timeout: float,
    worker_marker: str | None = None,
    cwd: Path | None = None,
):
    """Run ``cmd``; each time the worker appends a line to ``out`` (one per optimizer step), read the
    worker's CPU time. Returns (records, cpu time at each record or None, process wall seconds).
    The worker is ``cmd`` itself, or (p3d-train) the process whose command line holds ``worker_marker``."""
    t0 = time.perf_counter()
    marks: list[float | None] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        pid = None if worker_marker else proc.pid
        size, lines = -1, 0
        try:
            while True:
                done = proc.poll() is not None
                if pid is None:
                    pid = find_pid(worker_marker)
                try:
                    new_size = out.stat().st_size
                except OSError:
                    new_size = -1
                if new_size != size:
                    size = new_size
                    n = out.read_bytes().count(b"\n")
                    if n > lines:
                        cpu = proc_cpu_s(pid) if pid else None
                        marks.extend([cpu] * (n - lines))  # several lines at once: the extra intervals read ~0
                        lines = n
                if done:
                    break
                if time.perf_counter() - t0 > timeout:
                    proc.kill()
                    sys.exit(f"bench: {' '.join(cmd[:3])} ... took over {timeout:.0f} s; see {log}")
                time.sleep(POLL_S)
        except BaseException:
            proc.kill()
            raise
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        sys.exit(f"bench: {' '.join(cmd[:3])} ... failed with status {proc.returncode}; last lines of {log}:\n{tail}")
    from p3d.train.metrics import read_metrics

    records = read_metrics(out)
    for i, r in enumerate(records):  # CPU seconds between this step's record and the previous one's
        a, b = (marks[i - 1] if 0 < i <= len(marks) else None), (marks[i] if i < len(marks) else None)
        r["cpu_s"] = b - a if a is not None and b is not None else None
    return records, secs
