"""Data at scale (issue 13, "Benchmark"): the token store against streaming, on the stdlib corpus.

    .venv/bin/python bench/data.py                 # about 2 minutes on an idle 2-core box
    .venv/bin/python bench/data.py --json out.json

1. ``p3d-prepare`` throughput: the stdlib corpus (byte tokenizer) into a fresh store with 1 and with 2
   workers, the real console module as a subprocess; tokens written / wall seconds (start-up included).
2. Loader throughput per reading rank from the store: ``p3d.data.loader.micro_batches`` of a
   ``model=small`` run (seq_len 1024, micro batch 2, global batch 16, dp 1, shuffled), as a worker pulls
   them; tokens of the micro batches / wall seconds. Target: >= 10M tokens/s.
3. Launch to first batch when resuming at step 100,000 of ``model=small`` (global batch 16): a fresh
   Python process that imports p3d, opens the data and takes the first micro batch at that step, as a
   resumed worker does (the workers' other start-up, torch.distributed and DeepSpeed, is the same for
   both and not counted). Store: measured at step 0 and at step 100,000. Streaming: measured at steps 0
   and 200, and its CPU cost per skipped token extrapolated to step 100,000 (1.64B tokens re-read and
   re-tokenized; measuring it directly takes hours). Target: store under 2 s and independent of the step.

Figures depend on the machine's load: the bench prints the load average with them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, MBS, GBS = 1024, 2, 16  # model=small, schedule=default

FIRST_BATCH = """
import sys, time
from p3d.config.schema import DataConfig, DataSource
from p3d.data.loader import micro_batches
t0, c0 = time.perf_counter(), time.process_time()
source, path, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = DataConfig(source=DataSource.prepared, path=path) if source == "store" else DataConfig()
x, y = next(micro_batches(cfg, {seq}, {gbs}, {mbs}, 1, 0, 1234, start_sample=step * {gbs}))
print(time.perf_counter() - t0, time.process_time() - c0)
"""


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def prepare(out: Path, workers: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of it and its workers, tokens written)."""
    t0, c0 = time.perf_counter(), child_cpu()
    r = subprocess.run(
        [sys.executable, "-m", "p3d.cli.prepare", f"prepare.out={out}", f"prepare.workers={workers}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    m = json.loads((out / "manifest.json").read_text())
    return wall, child_cpu() - c0, m["train"]["tokens"] + m["val"]["tokens"]


def loader_rate(store: Path, steps: int) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of this process, pulling one reading rank's micro batches."""
    from p3d.config.schema import DataConfig, DataSource
    from p3d.data.loader import micro_batches

    cfg = DataConfig(source=DataSource.prepared, path=str(store))
    it = micro_batches(cfg, SEQ, GBS, MBS, 1, 0, 1234, start_sample=10**6)
    next(it)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for _ in range(steps * GBS // MBS):
        x, _y = next(it)
        tokens += x.numel() + x.shape[0]  # windows of seq_len + 1
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def first_batch(source: str, store: Path, step: int) -> tuple[float, float, float, float]:
    """(wall, CPU) seconds of a fresh process from its start to its first micro batch at ``step``, then
    (wall, CPU) of the part after the imports (torch, p3d): opening the data and reading that batch."""
    code = FIRST_BATCH.format(seq=SEQ, gbs=GBS, mbs=MBS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0, c0 = time.perf_counter(), child_cpu()
    r = subprocess.run(
        [sys.executable, "-c", code, source, str(store), str(step)], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    data_wall, data_cpu = (float(v) for v in r.stdout.split()[-2:])
    return wall, child_cpu() - c0, data_wall, data_cpu


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loader-steps", type=int, default=200)
    ap.add_argument("--stream-step", type=int, default=200)
    ap.add_argument("--json")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out: dict = {"load_average": os.getloadavg(), "cpus": len(os.sched_getaffinity(0))}
    print(f"load average {out['load_average'][0]:.1f} on {out['cpus']} usable cores")
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            wall, cpu, tokens = prepare(Path(tmp) / f"w{workers}", workers)
            out[f"prepare_{workers}w"] = {"wall_s": wall, "cpu_s": cpu, "tokens": tokens}
            print(
                f"p3d-prepare, {workers} worker(s): {tokens / 1e6:.1f}M tokens in {wall:.1f} s wall = "
                f"{tokens / wall / 1e6:.2f}M tokens/s ({cpu:.1f} CPU s, all processes)"
            )
        store = Path(tmp) / "w1"
        wall_rate, cpu_rate = loader_rate(store, args.loader_steps)
        out["loader_tokens_per_s"] = {"wall": wall_rate, "cpu": cpu_rate}
        print(
            f"loader from the store, one reading rank (seq_len {SEQ}, shuffled): {wall_rate / 1e6:.1f}M tokens "
            f"per wall s, {cpu_rate / 1e6:.1f}M per CPU s"
        )
        step_far = 100_000
        for step in (0, step_far):
            wall, cpu, dwall, dcpu = first_batch("store", store, step)
            out[f"store_first_batch_step{step}"] = {
                "wall_s": wall,
                "cpu_s": cpu,
                "data_wall_s": dwall,
                "data_cpu_s": dcpu,
            }
            print(
                f"store: launch to first batch at step {step:,}: {wall:.2f} s wall, {cpu:.2f} CPU s; after the "
                f"imports {dwall:.3f} s wall, {dcpu:.3f} CPU s"
            )
        w0, c0, _, _ = first_batch("stream", store, 0)
        wn, cn, _, _ = first_batch("stream", store, args.stream_step)
        tokens_far = step_far * GBS * (SEQ + 1)
        per_token = max(cn - c0, 0.0) / (args.stream_step * GBS * (SEQ + 1))
        far = c0 + per_token * tokens_far
        out["stream_first_batch"] = {"step0": [w0, c0], f"step{args.stream_step}": [wn, cn], "step100k_cpu_s_est": far}
        print(f"streaming: launch to first batch at step 0: {w0:.2f} s wall, {c0:.2f} CPU s")
        print(f"streaming: at step {args.stream_step}: {wn:.2f} s wall, {cn:.2f} CPU s")
        print(
            f"streaming: at step {step_far:,} ({tokens_far / 1e9:.2f}B tokens to re-read), extrapolated from the "
            f"CPU s per skipped token: {far:,.0f} CPU s ({far / 60:.1f} min) with this tokenizer"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
