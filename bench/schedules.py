"""Tokens/s and measured bubble of each pipeline schedule on pp2 (or pp4), through the real ``p3d-train`` (issue 11).

    .venv/bin/python bench/schedules.py                                   # model=tiny, m = 4 and 8, 2 rounds
    .venv/bin/python bench/schedules.py --model small --set model.n_layers=4 model.seq_len=128 --rounds 3
    .venv/bin/python bench/schedules.py --pp 4 --m 8 --set model.n_layers=8      # the issue's pp4 bubble order

Each (schedule, m) runs ``p3d-train mesh=pp2 schedule.pipeline=<s>`` for ``--steps`` steps (two worker processes,
one per core here, so idle time is lost time); the schedules alternate within each round, so that a change of
the machine's load hits all of them alike. Per run: the median over the steps after the first ``--warmup``
of ``tokens_per_s`` and of the measured ``bubble`` (the share of the step spent waiting on the pipeline
neighbour: DeepSpeed's send/recv instructions, or torch's p2p waits), from ``metrics.jsonl``; the theory is
``geometry.schedule_bubble``. Printed: the median over rounds, and tokens/s relative to ``1f1b`` (DeepSpeed's
engine) at the same m. The machine's load average is printed with the table: quote it with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p3d.model.geometry import schedule_bubble  # noqa: E402

SCHEDULES = {  # name -> overrides (v = 2 for all but 1f1b and gpipe)
    "1f1b": (),
    "gpipe": ("schedule.pipeline=gpipe",),
    "interleaved_1f1b": ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
    "interleaved_zero_bubble": ("schedule.pipeline=interleaved_zero_bubble", "schedule.virtual_stages=2"),
    "zbv": ("schedule.pipeline=zbv", "schedule.virtual_stages=2"),
    "dualpipev": ("schedule.pipeline=dualpipev", "schedule.virtual_stages=2"),
}


def one_run(name: str, m: int, args, run_dir: Path) -> tuple[float, float]:
    """(median tokens/s, median measured bubble) of the steps after the warmup."""
    mbs = args.micro_batch_size
    cmd = [
        sys.executable, "-m", "p3d.cli", f"run.dir={run_dir}", f"model={args.model}", f"mesh=pp{args.pp}",
        f"train.steps={args.steps}", "train.save_every=0", "train.keep_last=1",
        f"schedule.micro_batch_size={mbs}", f"schedule.global_batch_size={mbs * m}", *SCHEDULES[name], *args.set,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} m={m} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    return statistics.median(r["tokens_per_s"] for r in records), statistics.median(r["bubble"] for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped (shape inference, warm caches)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2, choices=[2, 4], help="pipeline stages (mesh=pp2 or pp4)")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro batches per step")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides, e.g. model.n_layers=4")
    args = ap.parse_args()
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="p3d-bench-schedules-") as tmp:
        for r in range(args.rounds):
            for m in args.m:
                for name in args.schedules:
                    run_dir = Path(tmp) / f"{name}-m{m}-r{r}"
                    results.setdefault((name, m), []).append(one_run(name, m, args, run_dir))
                    print(f"round {r + 1}: {name} m={m} done", file=sys.stderr, flush=True)
    print(f"model={args.model} {' '.join(args.set)} pp{args.pp}, {args.rounds} rounds x {args.steps} steps "
          f"(first {args.warmup} dropped); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{'schedule':<24} {'m':>3} {'tokens/s':>10} {'vs 1f1b':>8} {'bubble':>7} {'theory':>7}")
    for m in args.m:
        base = statistics.median(t for t, _ in results.get(("1f1b", m), [(float("nan"), 0.0)]))
        for name in args.schedules:
            tok = statistics.median(t for t, _ in results[(name, m)])
            bub = statistics.median(b for _, b in results[(name, m)])
            theory = schedule_bubble(name, args.pp, m, 1 if name in ("1f1b", "gpipe") else 2)
            print(f"{name:<24} {m:>3} {tok:>10,.0f} {tok / base:>7.2f}x {bub:>7.3f} {theory:>7.3f}")


if __name__ == "__main__":
    main()
