"""A p3d-train run in this process with each worker's RSS and glibc heap sampled every 5 ms (bench/cp.py rss): at the
highest RSS, malloc's bytes in use and free inside its heap; the most in use at once and the rest of the RSS then;
what ``malloc_trim(0)`` hands back at the end. glibc only (``mallinfo2``, ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._common import rss_bytes


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _libc():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc


def heap(libc) -> tuple[int, int]:
    """(in use, free) bytes of malloc, all arenas: handed out (heap and own mmaps), and free inside the heaps."""
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd, m.fordblks


def watch_worker(out_prefix: str) -> None:
    """Wrap p3d.train.loop.train in this process: the forked workers run the wrapper, which samples while training
    and writes ``<out_prefix>.<rank>.json``."""
    import p3d.train.loop as loop

    inner = loop.train

    def train(cfg, plan, run_dir, rank):
        libc, seen, stop = _libc(), {"rss": 0, "max_in_use": 0}, threading.Event()

        def sample():
            while not stop.is_set():
                rss = rss_bytes()
                used, free = heap(libc)
                if rss > seen["rss"]:
                    seen.update(rss=rss, in_use=used, free=free)
                if used > seen["max_in_use"]:
                    seen.update(max_in_use=used, rest=rss - used - free)  # rest: libraries, stacks, not malloc's
                time.sleep(0.005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            return inner(cfg, plan, run_dir, rank)
        finally:
            stop.set()
            thread.join()
            before = rss_bytes()
            libc.malloc_trim(0)
            seen |= {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     "trimmed": before - rss_bytes()}  # fmt: skip
            Path(f"{out_prefix}.{rank}.json").write_text(json.dumps(seen))

    loop.train = train


def watched_run(overrides: list[str]) -> dict:
    """``p3d-train <overrides>`` in this process (one per interpreter: Hydra composes once per process); the rank
    with the highest peak RSS: its sample at that peak."""
    from p3d.launch.compose import run_hydra
    from p3d.launch.train import train_task

    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-rss-") as tmp:
        watch_worker(f"{tmp}/rank")
        argv = sys.argv
        sys.argv = ["p3d-train", *overrides, f"run.dir={tmp}/run", "logger=none"]
        try:
            status = run_hydra(train_task)
        finally:
            sys.argv = argv
        if status:
            raise SystemExit(f"p3d-train {' '.join(overrides)} exited {status}")
        ranks = [json.loads(p.read_text()) for p in Path(tmp).glob("rank.*.json")]
        return max(ranks, key=lambda r: r["maxrss"])
