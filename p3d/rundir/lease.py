"""One run per run directory: a lease file that works on shared file systems.

``flock``/``fcntl`` locks are a no-op or local to one client on some NFS and Lustre mounts, so the
lock is a file, ``<run.dir>/run.lock`` (JSON): it names its holder (pid, host, start time, Slurm job
and restart if any) and carries a heartbeat that a thread of the holder refreshes every
``HEARTBEAT_S`` seconds while the run lives.

- **Taking it** is one atomic create: the lease is written to a private temporary file and
  ``link()``-ed to ``run.lock`` (atomic on NFS, which ``O_EXCL`` was not before NFSv3; where hard
  links are unsupported, ``O_CREAT | O_EXCL``). Exactly one contender wins.
- **Stale** (and then taken over, with a note on the console): the holder's host is this host and
  neither the holder nor a worker it started is alive; or the heartbeat is older than ``STALE_S``
  seconds (another host: its clock must agree with ours within that margin, as NTP keeps it). A lease
  of a Slurm job stays live while ``scontrol`` says the job is queued or running (a submitted job
  waiting in the queue, a requeued one) whatever its heartbeat.
- **The same Slurm job** takes over its own lease when it restarts (a requeue: same
  ``SLURM_JOB_ID``, another ``SLURM_RESTART_COUNT``), or from ``p3d-train cluster=slurm``, which
  takes the lease before freezing the spec and hands it to the job it submits.
- **Takeover** renames the stale lease aside (one contender wins the rename), checks that what it
  renamed is what it judged stale, and then takes the lease like anyone else.

    python -m p3d.cli.lease acquire <run_dir> --pid PID   # the Slurm recipe: lease held by PID (the batch shell)
    python -m p3d.cli.lease heartbeat <run_dir> --pid PID # refresh it until PID ends
    python -m p3d.cli.lease release <run_dir> --pid PID
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from p3d.console import error, say
from p3d.layout.run_plan import P3DConfigError
from p3d.rundir.files import LOCK as LOCK_NAME

HEARTBEAT_S = 10.0  # how often the holder refreshes the lease
STALE_S = 60.0  # a lease whose heartbeat is older than this is stale (lost host, SIGKILL elsewhere)
SLURM_LIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
}


FREEZE_ONLY_ENV = "P3D_SLURM_FREEZE_ONLY"  # set by the Slurm recipe: p3d-train freezes the spec and returns


class RunLocked(P3DConfigError):
    """The run directory is held by a live run; the message names the holder and the fix."""


def _host() -> str:
    return socket.gethostname()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) holds nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; [] elsewhere)."""
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.update(int(c) for c in (task / "children").read_text().split())
    except OSError:
        pass
    return sorted(found)


def _slurm_state(job: str) -> str | None:
    """The job's state per scontrol, or None when Slurm cannot tell (no scontrol, unknown job)."""
    if not shutil.which("scontrol"):
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")), None)
    return state if out.returncode == 0 else None


def read(run_dir: str | Path) -> dict | None:
    """The lease in ``run_dir``, or None when there is none (a torn or foreign file reads as {})."""
    try:
        text = (Path(run_dir) / LOCK_NAME).read_text()
    except FileNotFoundError:
        return None
    try:
        lease = json.loads(text)
        return lease if isinstance(lease, dict) else {}
    except ValueError:
        return {}


def describe(lease: dict) -> str:
    job = f", Slurm job {lease['slurm_job']}" if lease.get("slurm_job") else ""
    return f"pid {lease.get('pid', '?')} on {lease.get('host', '?')}, started {lease.get('started', '?')}{job}"


def stale_reason(lease: dict, now: float | None = None, stale_s: float = STALE_S) -> str | None:
    """Why this lease no longer holds the directory, or None while its holder lives."""
    why = _holder_gone(lease, now, stale_s)
    if why is None or not lease.get("slurm_job"):
        return why
    state = _slurm_state(lease["slurm_job"])  # asked only now: a queued job has no live process or heartbeat
    return None if state in SLURM_LIVE_STATES else why


def _holder_gone(lease: dict, now: float | None, stale_s: float) -> str | None:
    now = time.time() if now is None else now
    age = now - float(lease.get("heartbeat", 0))
    if lease.get("host") == _host() and "pid" in lease:
        pids = [int(lease["pid"]), *map(int, lease.get("workers", []))]
        if not any(alive(p) for p in pids):
            return f"its process {lease['pid']} on {lease['host']} and its workers are gone"
        if age <= stale_s:
            return None
    if age > stale_s:
        return f"no heartbeat for {age:.0f} s (more than {stale_s:.0f} s)"
    return None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _same_job_restart(lease: dict) -> bool:
    """This process is a later start of the Slurm job that holds the lease (requeue, or handed over)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or str(lease.get("slurm_job")) != job:
        return False
    return lease.get("slurm_restart") != os.environ.get("SLURM_RESTART_COUNT", "0") or lease.get("handed_over", False)


def _create(path: Path, body: dict) -> bool:
    """Atomically create ``path`` holding ``body``; False if it exists."""
    tmp = path.with_name(f".{LOCK_NAME}.{body['token']}")
    tmp.write_text(json.dumps(body) + "\n")
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            # NFS: a retransmitted link() may report EEXIST although it succeeded; the link count says
            return os.stat(tmp).st_nlink == 2
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        try:  # no hard links on this file system
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(body) + "\n")
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, body: dict) -> None:
    tmp = path.with_name(f".{LOCK_NAME}.{body['token']}.beat")
    tmp.write_text(json.dumps(body) + "\n")
    os.replace(tmp, path)


class Lease:
    """This process's lease on a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, body: dict):
        self.path = Path(run_dir) / LOCK_NAME
        self.body = body
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writing = threading.Lock()  # the heartbeat thread and hand_to_job / release

    @classmethod
    def acquire(cls, run_dir: str | Path, pid: int | None = None, what: str = "p3d-train", out=None) -> Lease:
        """Take the lease or raise RunLocked naming the holder. ``pid``: the process that holds it
        (default this one)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        now = time.time()
        body = {
            "pid": pid or os.getpid(),
            "host": _host(),
            "what": what,
            "started": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
            "heartbeat": now,
            "token": uuid.uuid4().hex,
            "workers": [],
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0") if "SLURM_JOB_ID" in os.environ else None,
        }
        for _ in range(50):
            if _create(path, body):
                return cls(run_dir, body)
            held = read(run_dir)
            if held is None:
                continue  # released meanwhile
            if not held and _age(path) < HEARTBEAT_S:  # being written by a contender (O_EXCL file systems)
                time.sleep(0.2)
                continue
            why = "an unreadable lease" if not held else stale_reason(held)
            if why is None and _same_job_restart(held):
                why = "it is this Slurm job's own lease (requeued or submitted)"
            if why is None:
                raise RunLocked(
                    f"run.dir={run_dir} is in use by {held.get('what', 'a run')} ({describe(held)}; "
                    f"lease {path}); wait for it to end or stop it, or choose another run.dir"
                )
            if _take_aside(path, held):
                say(f"took over the lease of {run_dir} ({describe(held)}): {why}", stream=out or sys.stderr)
        raise RunLocked(f"run.dir={run_dir}: could not take {path} (other launches compete for it); try again")

    def start_heartbeat(self, interval: float = HEARTBEAT_S) -> Lease:
        self._thread = threading.Thread(target=self._beat, args=(interval,), name="p3d-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self.refresh():
                return

    def refresh(self) -> bool:
        """Renew the heartbeat and record the holder's workers; False (and a warning) if the lease is
        no longer ours."""
        with self._writing:
            return self._refresh()

    def _refresh(self) -> bool:
        if self.body["token"] is None:  # handed over
            return False
        held = read(self.path.parent)
        if held is None:  # released
            return False
        if held.get("token") != self.body["token"]:
            if not (held.get("handed_over") and held.get("pid") == self.body["pid"]):
                error(f"warning: lost the lease {self.path} (now {describe(held) if held else 'none'})")
            return False
        self.body["heartbeat"] = time.time()
        self.body["workers"] = _children(int(self.body["pid"]))
        _write(self.path, self.body)
        return True

    def hand_to_job(self, job_id: str) -> None:
        """p3d-train submitted the run as Slurm job ``job_id``: the lease is the job's from now on (live
        while the job is queued or running; the job takes it over when it starts)."""
        self._stop.set()
        with self._writing:
            body = dict(
                self.body,
                slurm_job=str(job_id),
                slurm_restart=None,
                handed_over=True,
                what=f"Slurm job {job_id} (submitted by {self.body['what']})",
                token=uuid.uuid4().hex,
                heartbeat=time.time(),
            )
            _write(self.path, body)
            self.body["token"] = None  # not ours to refresh or release any more

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        held = read(self.path.parent)
        if held and held.get("token") == self.body["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def take_lease(cfg) -> Lease | None:
    """p3d-train's lease on ``cfg.run.dir``, its heartbeat running; None where another process holds
    the lease for this run: the Slurm recipe (its freeze step runs p3d-train) and ranks started by an
    external launcher (RANK set). Raises RunLocked."""
    if os.environ.get(FREEZE_ONLY_ENV) == "1" or "RANK" in os.environ:
        return None
    return Lease.acquire(cfg.run.dir).start_heartbeat()


def check_free(run_dir: str | Path) -> None:
    """Raise RunLocked if a live run holds ``run_dir`` (a sweep point before its job is submitted)."""
    held = read(run_dir)
    if held and stale_reason(held) is None:
        raise RunLocked(
            f"run.dir={run_dir} is in use by {held.get('what', 'a run')} ({describe(held)}); wait for "
            "it to end or stop it, or choose another hydra.sweep.dir"
        )


def _take_aside(path: Path, judged: dict) -> bool:
    """Move the stale lease out of the way; True if the one moved is the one judged stale."""
    aside = path.with_name(f".{LOCK_NAME}.stale.{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another contender moved it first
    moved = read_file(aside)
    if moved.get("token") != judged.get("token") or moved.get("heartbeat") != judged.get("heartbeat"):
        try:  # refreshed (or replaced) between our look and the rename: put it back unless taken meanwhile
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def read_file(path: Path) -> dict:
    try:
        lease = json.loads(path.read_text())
        return lease if isinstance(lease, dict) else {}
    except (OSError, ValueError):
        return {}


def held_by(run_dir: str, pid: int) -> Lease | None:
    held = read(run_dir)
    if not held or held.get("pid") != pid or held.get("host") != _host():
        return None
    return Lease(Path(run_dir), held)
