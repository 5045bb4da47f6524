"""Tokens/s and measured bubble of each pipeline schedule on pp2 (or pp4), ratio to DeepSpeed's 1f1b (issue 11).

    .venv/bin/python bench/schedules.py                           # the bench model, m = 4 and 8, steps alternating
    .venv/bin/python bench/schedules.py --runs --rounds 3         # the same through p3d-train, runs alternating
    .venv/bin/python bench/schedules.py --set                     # model=tiny as it is (per-op overhead bound)
    .venv/bin/python bench/schedules.py --pp 4 --m 8 --set model.n_layers=8

The bench model is model=tiny widened until compute, not per-operation overhead, sets a step's time on a CPU
core (h = 512, ffn 1536, s = 128: ~100 ms of forward and backward per block and micro batch of 2, against
about a millisecond of a schedule's own work per action); its 512-word head costs 0.08 of a block, so the two
stages are balanced and what differs between schedules is their bubble and their executor.

Two ways to alternate, both on two worker processes (one per core here, so idle time is lost time):
- default: the pp workers build every schedule's executor as p3d-train builds it
  (``p3d.train.executors.build_executor``, the same seeded init and data) and alternate *steps*: one step of
  each schedule per round, the order reversed every other round. A step's time is the wall time of
  ``train_batch`` and its bubble the executor's timer over it (``trainer.step_stats``), as in metrics.jsonl. The
  machine's load then hits every schedule within seconds of the others: ratios to 1f1b are steady where whole
  runs minutes apart are not (measured here: rounds of whole runs spread by 10-30%).
- ``--runs``: one ``p3d-train mesh=pp2 schedule.pipeline=<s>`` run per (schedule, m, round), the schedules
  alternating within each round; per run the median over the steps after ``--warmup`` of ``tokens_per_s`` and
  ``bubble`` from its metrics.jsonl. This is what a user runs, launch included.
Printed: the median over rounds (and their range), the ratio to ``1f1b`` (DeepSpeed's engine) at the same m:
of the medians ("vs 1f1b"), and the median of each round's own ratio ("paired": a round's steps of all
schedules run within seconds, so this one cancels the slower swings of the machine), the measured bubble and
``geometry.schedule_bubble`` (the planner's), and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p3d.layout.geometry import schedule_bubble  # noqa: E402

BENCH_MODEL = ("model.hidden_size=512", "model.ffn_hidden_size=1536", "model.seq_len=128")
SCHEDULES = {  # name -> overrides (v = 2 for all but 1f1b and gpipe)
    "1f1b": (),
    "gpipe": ("schedule.pipeline=gpipe",),
    "interleaved_1f1b": ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
    "interleaved_zero_bubble": ("schedule.pipeline=interleaved_zero_bubble", "schedule.virtual_stages=2"),
    "zbv": ("schedule.pipeline=zbv", "schedule.virtual_stages=2"),
    "dualpipev": ("schedule.pipeline=dualpipev", "schedule.virtual_stages=2"),
}


def overrides(name: str, m: int, args) -> list[str]:
    mbs = args.micro_batch_size
    return [
        f"model={args.model}", f"mesh=pp{args.pp}", "train.save_every=0", f"schedule.micro_batch_size={mbs}",
        f"schedule.global_batch_size={mbs * m}", *SCHEDULES[name], *args.set,
    ]  # fmt: skip


# ---- whole runs through p3d-train
def one_run(name: str, m: int, args, run_dir: Path) -> tuple[float, float]:
    """(median tokens/s, median measured bubble) of the steps after the warmup."""
    cmd = [sys.executable, "-m", "p3d.cli", f"run.dir={run_dir}", f"train.steps={args.steps}", "train.keep_last=1",
           *overrides(name, m, args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} m={m} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    return statistics.median(r["tokens_per_s"] for r in records), statistics.median(r["bubble"] for r in records)


def by_runs(args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="p3d-bench-schedules-") as tmp:
        for r in range(args.rounds):
            for m in args.m:
                for name in args.schedules:
                    run_dir = Path(tmp) / f"{name}-m{m}-r{r}"
                    results.setdefault((name, m), []).append(one_run(name, m, args, run_dir))
                    print(f"round {r + 1}: {name} m={m} done", file=sys.stderr, flush=True)
    return results


# ---- steps alternating inside one set of workers
def _steps_worker(rank: int, world: int, args, out_path: str) -> None:
    import datetime

    import deepspeed
    import torch

    from p3d.data.loader import micro_batches
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors import build_executor
    from p3d.train.loop import Stopper, step_stats
    from p3d.train.worker import set_up_cpu_worker
    from tests.helpers.runs import typed

    set_up_cpu_worker()  # one thread, freed memory kept: as p3d-train's CPU workers
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    device, stopper, mesh = torch.device("cpu"), Stopper(), None
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-steps-{rank}-") as tmp:
        for m in args.m:
            executors, data, tokens = {}, {}, 0
            for name in args.schedules:
                cfg, plan = typed(*overrides(name, m, args), f"train.steps={args.rounds + args.warmup}")
                mesh = mesh or Mesh.from_plan(plan, rank).with_groups()
                executors[name] = build_executor(cfg, plan, mesh, rank, device, tmp)
                s = cfg.schedule
                tokens = s.global_batch_size * cfg.model.seq_len
                data[name] = micro_batches(cfg.data, cfg.model.seq_len, s.global_batch_size, s.micro_batch_size,
                                           1, 0, cfg.train.seed, 0, None)  # fmt: skip
            for r in range(args.warmup + args.rounds):
                order = args.schedules if r % 2 == 0 else args.schedules[::-1]
                for name in order:
                    ex = executors[name]
                    t0 = time.perf_counter()
                    ex.train_batch(data[name] if ex.reads_data else None)
                    step_time = time.perf_counter() - t0
                    _, bubble, _, compute, _ = step_stats(stopper, ex.timer.take() / step_time,
                                                          ex.timer.take_compute(), ex.timer.take_comm([]),
                                                          device, None)  # fmt: skip
                    if r >= args.warmup:
                        results.setdefault(f"{name}|{m}", []).append((tokens / step_time, bubble, step_time,
                                                                      statistics.mean(compute)))  # fmt: skip
                if rank == 0:
                    print(f"m={m}: round {r + 1} of {args.warmup + args.rounds}", file=sys.stderr, flush=True)
            del executors
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def by_steps(args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    from tests.helpers.dist import run_distributed

    with tempfile.TemporaryDirectory(prefix="p3d-bench-schedules-") as tmp:
        out = Path(tmp) / "results.json"
        run_distributed(_steps_worker, args.pp, args, str(out), timeout=7200)
        raw = json.loads(out.read_text())
    for key, rows in raw.items():  # the step's split: compute (forward, backward, weight passes), waits, the rest
        name, m = key.split("|")
        step, compute = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
        bubble = statistics.median(r[1] for r in rows)
        print(f"  {name} m={m}: step {step:.3f} s = compute {compute:.3f} + waits {bubble * step:.3f} + other "
              f"{step - compute - bubble * step:.3f} (medians, mean over ranks)", file=sys.stderr)  # fmt: skip
    return {(key.split("|")[0], int(key.split("|")[1])): [(r[0], r[1]) for r in v] for key, v in raw.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", action="store_true", help="whole p3d-train runs instead of alternating steps")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8, help="--runs: steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps (rounds) dropped: shapes, warm caches")
    ap.add_argument("--rounds", type=int, default=None, help="default 20 alternating steps, 3 with --runs")
    ap.add_argument("--pp", type=int, default=2, choices=[2, 4], help="pipeline stages (mesh=pp2 or pp4)")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro batches per step")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(BENCH_MODEL)})")
    args = ap.parse_args()
    args.set = list(BENCH_MODEL if args.set is None else args.set)
    args.rounds = args.rounds or (3 if args.runs else 20)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = by_runs(args) if args.runs else by_steps(args)
    how = f"{args.rounds} rounds x {args.steps} steps (first {args.warmup} dropped)" if args.runs else (
        f"{args.rounds} alternating steps of each schedule (after {args.warmup})")  # fmt: skip
    print(f"model={args.model} {' '.join(args.set)} pp{args.pp}, {how}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{'schedule':<24} {'m':>3} {'tokens/s':>10} {'range':>15} {'vs 1f1b':>8} {'paired':>7} {'bubble':>7} "
          f"{'theory':>7}")  # fmt: skip
    for m in args.m:
        base = [t for t, _ in results.get(("1f1b", m), [(float("nan"), 0.0)])]
        for name in args.schedules:
            toks = [t for t, _ in results[(name, m)]]
            tok = statistics.median(toks)
            paired = statistics.median(t / b for t, b in zip(toks, base))  # each round against its own 1f1b
            bub = statistics.median(b for _, b in results[(name, m)])
            theory = schedule_bubble(name, args.pp, m, 1 if name in ("1f1b", "gpipe") else 2)
            spread = f"{min(toks):,.0f}-{max(toks):,.0f}"
            print(f"{name:<24} {m:>3} {tok:>10,.0f} {spread:>15} {tok / statistics.median(base):>7.2f}x "
                  f"{paired:>6.2f}x {bub:>7.3f} {theory:>7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
