"""Context parallelism's memory in a whole run, as a user meets it (issue 52): p3d-train at 4,096 tokens on one
process, then split over 2 and 4 cp ranks, each run's peak_mem_gb (the largest peak RSS of its ranks) against cp1's,
and p3d-plan's per-rank figure for the same command beside it.

    .venv/bin/python bench/cp_runs.py                      # the issue's command (model=tiny), cp 1, 2, 4
    .venv/bin/python bench/cp_runs.py --cp 1 2 --extra model=small
    .venv/bin/python bench/cp_runs.py --host-memory keep release   # both CPU heap policies, run by run
    .venv/bin/python bench/cp_runs.py --host-memory release --added-over 256   # what s=4096 adds over s=256, per cp

``train.host_memory`` (p3d.train.host_memory) decides what the CPU peak RSS holds: ``keep`` (the default, fast)
leaves freed memory resident in the heap, so the peak holds the heap's reach, holes included; ``release`` hands
freed blocks back, so the peak is the live bytes' (CUDA's ``max_memory_allocated`` counterpart, which is what
p3d-plan predicts). With several policies each cp's runs are taken in turn, and the step column is the median
step time of the run's steps after the first (its cost).

What a rank holds beside its share of the activations is the floor cp cannot divide: the worker process itself
(torch's and the data readers' resident memory, ``p3d.planner.memory.host_bytes``), the weights, their gradients
and Adam's states (every cp rank holds the whole model), and the embedding and head's vocab-sized tensors. The
floor printed is the planner's count of those at cp = 1 less its activations and loss.
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

COMMAND = ("model.seq_len=4096", "mesh=single", "schedule.global_batch_size=2", "schedule.micro_batch_size=1",
           "train.steps=2")  # fmt: skip


def measured(overrides: list[str]) -> tuple[float, float]:
    """The run's peak_mem_gb (the largest over its records and ranks, peak RSS on cpu) and its median step seconds
    after the first step (all steps if it ran one)."""
    with tempfile.TemporaryDirectory(prefix="p3d-bench-cp-runs-") as tmp:
        cmd = [sys.executable, "-m", "p3d.cli", *overrides, f"run.dir={tmp}", "logger=none"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))]
        peak = max(r["peak_mem_gb"] for r in records if isinstance(r.get("peak_mem_gb"), (int, float)))
        return peak, statistics.median(steps[1:] or steps)


def planned(overrides: list[str]) -> tuple[float, float, float]:
    """p3d-plan's per-rank (total, activations with the loss and the cp attention's working set, that working set),
    in GB."""
    from p3d.planner import predict
    from tests.helpers.runs import typed

    cfg, _ = typed(*overrides)
    w = predict(cfg).worst
    return w.total / 1e9, w.activations_total / 1e9, w.attention_bytes / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to the issue's command")
    ap.add_argument("--host-memory", nargs="+", default=["keep"], choices=["keep", "release"],
                    help="train.host_memory policies, each a run per cp")  # fmt: skip
    ap.add_argument("--added-over", type=int, default=None, metavar="S",
                    help="what the sequence adds to a rank: each peak less the same run's at seq_len=S")  # fmt: skip
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = [*COMMAND, *args.extra]
    if args.added_over is not None:
        return added_by_the_sequence(base, args.cp, args.added_over, args.host_memory[-1])
    print(
        f"p3d-train {' '.join(base)} mesh.cp=N train.host_memory=H: peak_mem_gb (max over ranks), p3d-plan's "
        "per-rank GB"
    )
    print(f"{'cp':>3} {'heap':>7} {'measured GB':>11} {'vs cp1':>7} {'planned GB':>10} {'plan/meas':>9} "
          f"{'act+loss':>9} {'attn ws':>8} {'step s':>7}")  # fmt: skip
    first: dict[str, float] = {}
    for cp in args.cp:
        total, act, attn = planned([*base, f"mesh.cp={cp}"])
        for heap in args.host_memory:
            peak, step = measured([*base, f"mesh.cp={cp}", f"train.host_memory={heap}"])
            first.setdefault(heap, peak)
            print(f"{cp:>3} {heap:>7} {peak:>11.3f} {peak / first[heap]:>6.2f}x {total:>10.3f} {total / peak:>9.2f} "
                  f"{act:>9.3f} {attn:>8.3f} {step:>7.2f}", flush=True)  # fmt: skip
        if cp == 1:
            print(f"    floor (planned total less activations and loss at cp1): {total - act:.3f} GB")


def added_by_the_sequence(base: list[str], cps: list[int], short: int, heap: str) -> None:
    """Per cp: the peak at the command's seq_len less the peak at ``short`` tokens (the floor cancels: the process,
    the weights and their states), and that against cp1's. Ideal: 1 / cp of it."""
    print(f"p3d-train {' '.join(base)} mesh.cp=N train.host_memory={heap}: peak_mem_gb less the same at "
          f"model.seq_len={short}")  # fmt: skip
    print(f"{'cp':>3} {'long GB':>8} {'short GB':>8} {'added GB':>8} {'vs cp1':>7} {'ideal':>6}")
    first = None
    for cp in cps:
        long_peak, _ = measured([*base, f"mesh.cp={cp}", f"train.host_memory={heap}"])
        short_peak, _ = measured([*base, f"model.seq_len={short}", f"mesh.cp={cp}", f"train.host_memory={heap}"])
        added = long_peak - short_peak
        first = first or added
        print(f"{cp:>3} {long_peak:>8.3f} {short_peak:>8.3f} {added:>8.3f} {added / first:>6.2f}x {1 / cp:>5.2f}x",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
