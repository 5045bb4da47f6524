"""Run a function in N gloo processes (file-store rendezvous, one thread each, a timeout).

The processes come from one forkserver per test session (``context()``): a clean process, started on first
use, that has imported torch, torch._dynamo and DeepSpeed once and forks a worker per request. Spawned, each
worker imported them itself: about 3 s of CPU a process, so an 8-rank test spent 12 s of its 2 cores before
its first line. Like spawn, a forkserver child starts from a process that has run no test and no collective
(the pytest process has: its threads make a plain fork unsafe); unlike spawn, it has the server's environment,
so ``_entry`` takes the caller's environment at the call, as spawn would have.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p3d.jobs.forked import worker_imports

# what every test worker imports first, imported once by the forkserver (an import that fails there is
# skipped by multiprocessing and done by the worker)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.pipelining",
    "p3d.train.worker",
    *worker_imports("1f1b", zero_stage=1),  # DeepSpeed, and its ZeRO check for the tests that use it
]


def context():
    """The multiprocessing context for test workers: a forkserver that preloads ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world: int, store: str, fn, args, errors, environ: dict[str, str]) -> None:
    from p3d.train.worker import leave, skip_cpu_shm_build

    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    skip_cpu_shm_build()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    status = 0
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        status = 1
    finally:
        dist.destroy_process_group()
    leave(status)  # not the interpreter's teardown, which can abort on gloo's threads (see p3d.train.worker.leave)


def run_distributed(fn, world: int, *args, timeout: float = 120.0) -> None:
    """fn(rank, world, *args) on ``world`` processes; raises with the failing rank's traceback.

    ``fn`` must be importable (a module-level function of a test module)."""
    ctx = context()
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        environ = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, args, errors, environ)) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if not errors.empty():
            raise AssertionError(errors.get())
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f}s")
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise AssertionError(f"ranks exited with errors (rank, status): {failed}")
