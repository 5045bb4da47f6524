"""Where a CPU run's peak RSS goes (issue 52): p3d-train's command of bench/cp_runs.py, run in this process (its
workers forked from it, as p3d-train forks them), each worker watched by a thread that reads its RSS and glibc's
``mallinfo2`` every 5 ms. At the highest RSS seen it prints the bytes malloc has handed out and not got back
(in use: tensors, Python objects) and the bytes free inside malloc's heap (freed, still resident: what CUDA's
caching allocator would call reserved but not allocated, which ``max_memory_allocated`` does not count); at the end
of the run, what ``malloc_trim(0)`` hands back to the kernel. Beside them p3d-plan's per-rank figure.

    .venv/bin/python bench/cp_rss.py                                 # model=tiny, cp 1
    .venv/bin/python bench/cp_rss.py --cp 1 2 4 --extra model=small

The most in use is the largest of the samples, and a sample every 5 ms can miss the exact peak by a few ms of
allocations: the figures are a reading, not a count. glibc only (mallinfo2, malloc_trim).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cp_runs import COMMAND, planned  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _libc():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def heap(libc) -> tuple[int, int]:
    """(in use, free) bytes of malloc, all arenas: handed out (heap and own mmaps), and free inside the heaps."""
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd, m.fordblks


def watch_worker(out_prefix: str):
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


def run(overrides: list[str]) -> dict:
    """The rank with the highest peak RSS: its sample at that peak."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", nargs="+", type=int, default=[1])
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to the issue's command")
    ap.add_argument("--one", action="store_true", help="run the first --cp here and print its sample as JSON")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.one:  # one p3d-train per interpreter: Hydra composes once per process
        print(json.dumps(run([*COMMAND, *args.extra, f"mesh.cp={args.cp[0]}"])))
        return
    print("GB per rank (the rank of the highest peak RSS): peak RSS; at it, malloc's bytes in use and free in its")
    print("heap; the most malloc had in use at once and the rest of the RSS then (libraries, stacks); malloc_trim's")
    print("release at the end; p3d-plan's total against the RSS and against the peak in use + the rest")
    print(f"{'cp':>3} {'peak RSS':>9} {'in use':>7} {'free':>6} {'max in use':>10} {'rest':>6} {'trimmed':>8} "
          f"{'planned':>8} {'plan/RSS':>8} {'plan/used':>9}")  # fmt: skip
    for cp in args.cp:
        overrides = [*COMMAND, *args.extra, f"mesh.cp={cp}"]
        child = [sys.executable, __file__, "--one", "--cp", str(cp), "--extra", *args.extra]
        done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"{' '.join(child)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        total = planned(overrides)[0]
        peak, used, free = r["maxrss"] / 1e9, r["in_use"] / 1e9, r["free"] / 1e9
        most, rest = r["max_in_use"] / 1e9, r["rest"] / 1e9
        print(f"{cp:>3} {peak:>9.3f} {used:>7.3f} {free:>6.3f} {most:>10.3f} {rest:>6.3f} {r['trimmed'] / 1e9:>8.3f} "
              f"{total:>8.3f} {total / peak:>8.2f} {total / (most + rest):>9.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
