"""Start local CPU workers by forking the launcher once it has imported torch, not as fresh interpreters.

Every worker imports torch and torch._dynamo (torch's optimizers import it on first use): about 2 s of CPU
each here, before it does anything. With the gloo backend, tp*pp*dp workers share a few cores, so those
imports were most of a small run's start-up (8 workers on 2 cores: 8 s of the 13). The launcher imports
them once and forks each worker, which then runs exactly what ``python -m p3d.cli.worker <spec>`` runs, with the
environment, session, output and signals that process would have had.

Forking is used only where it is known to be safe:
- the gloo backend: no CUDA (a forked child cannot use a CUDA context; importing torch creates none, but
  GPU runs gain little here, since their nodes have a core per worker);
- Linux, and a launcher with no thread besides its main one, torch's own and the run lease's heartbeat (a fork
  copies only the calling thread; a lock another thread held would stay held in the child), so never from
  inside a process that has run collectives, such as a test process;
- ``P3D_WORKER_START`` unset or ``fork``; ``P3D_WORKER_START=exec`` starts every worker as a fresh interpreter.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

WORKER_START = "P3D_WORKER_START"  # fork (default where safe) | exec
TORCH_THREADS = 1  # threads `import torch` starts in a process (checked on torch 2.13: one idle helper)


def native_threads() -> int | None:
    """The threads of this process as the kernel counts them (C++ ones included); None off Linux."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


# The launcher's own threads a fork may leave behind: the run lease's heartbeat (p3d.rundir.lease) sleeps and
# rewrites a small file; the child never touches the lease.
SAFE_THREADS = ("p3d-lease",)


def can_fork(backend: str) -> bool:
    if os.environ.get(WORKER_START, "fork") == "exec" or backend != "gloo" or not hasattr(os, "fork"):
        return False
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.name not in SAFE_THREADS for t in others):
        return False
    threads = native_threads()
    allowed = 1 + len(others) + (TORCH_THREADS if "torch" in sys.modules else 0)
    return threads is not None and threads <= allowed


# DeepSpeed's engine with ZeRO checks its optimizer against a list that lives in this module, which compiles
# a function with torch.compile at import (DeepSpeed 0.19: torch._inductor is imported, 1.5 s a worker here)
DEEPSPEED_ZERO_CHECK = "deepspeed.runtime.zero.muon.muon_optimizer"


def worker_imports(pipeline: str, zero_stage: int) -> tuple[str, ...]:
    """The modules every worker of such a run imports beyond torch's: DeepSpeed (each worker joins through
    ``deepspeed.init_distributed``) and, under DeepSpeed's engine (``1f1b``) with ZeRO, its optimizer check."""
    return ("deepspeed", DEEPSPEED_ZERO_CHECK) if pipeline == "1f1b" and zero_stage == 1 else ("deepspeed",)


def preload(modules: tuple[str, ...] = ()) -> None:
    """What every worker imports first, imported once here, then ``modules`` (one that does not import, say in
    another DeepSpeed version, is left to the workers). The thread counts a CPU worker asks for are read when
    torch loads its OpenMP runtime; each worker also sets them itself (p3d.train.worker)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch
    import torch._dynamo
    import torch.distributed  # noqa: F401

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


class ForkedWorker:
    """The part of ``subprocess.Popen`` the launcher uses: ``pid``, ``returncode`` (negative: killed by that
    signal), ``poll()`` and ``wait(timeout)``; polled from the launcher's main thread only."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing more can be known
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


Worker = subprocess.Popen | ForkedWorker  # what the launcher holds of a running worker


def fork_worker(spec_path: Path, env: dict[str, str], log_fd: int) -> ForkedWorker:
    """A worker running ``p3d.train.worker.main([spec_path])`` in a child of this process, in its own session, with
    ``env`` as its whole environment and ``log_fd`` (its log file) as its stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker: never returns into the launcher's code
        _run_child(spec_path, env, log_fd)
    return ForkedWorker(pid)


def _run_child(spec_path: Path, env: dict[str, str], out_fd: int) -> None:
    status = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # the launcher's forwarding handlers are not the worker's
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)  # the launcher holds no other worker's descriptor: each log is closed once forked
        # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh worker's (a progress bar's carriage returns included)
        sys.stdout = _text_stream(1)
        sys.stderr = _text_stream(2)
        os.environ.clear()
        os.environ.update(env)
        from p3d.train.worker import main

        status = main([str(spec_path)])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)
