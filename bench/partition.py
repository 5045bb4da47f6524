"""Stage partitions against the measured pipeline bubble (issue 11, item 6).

    .venv/bin/python bench/partition.py                 # 3 rounds of blocks, uniform, cost; 6 steps each
    .venv/bin/python bench/partition.py --rounds 5 --steps 8

pp2, ``model=small`` with 4 layers (its 50k-vocabulary head and loss weigh 5.5 blocks), 8 micro batches of
256 tokens. By count (``blocks``, ``uniform``) the last stage carries the head on top of its blocks and the
first waits for it; by ``cost`` the head gets the last stage to itself. Per run it reads ``metrics.jsonl``:
the measured idle share (``bubble``) and the ratio of the busier stage's forward + backward seconds to the
other's (``stage_compute_s``), medians over the steps after the first. The rounds interleave the partitions
so the machine's load hits each alike; it prints every run and the medians over rounds, with the theory
(1F1B with equal stages: (p-1)/(m+p-1)). The FLOPs each stage runs are a test (tests/unit/layout/test_partition.py);
this is the wall-clock effect, which on shared cores is no test.
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

ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = ("blocks", "uniform", "cost")
RUN = (
    "model=small", "model.n_layers=4", "model.seq_len=256", "mesh=pp2", "schedule.micro_batch_size=1",
    "schedule.global_batch_size=8", "train.save_every=0",
)  # fmt: skip


def measure(partition: str, steps: int, where: Path) -> tuple[float, float]:
    """(median idle share, median busier / other stage compute) of one run, step 1 left out."""
    run = where / partition
    argv = [sys.executable, "-m", "p3d.cli", *RUN, f"train.steps={steps}", f"schedule.partition={partition}",
            f"run.dir={run}"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"p3d-train {partition} exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r][1:]
    ratios = [max(r["stage_compute_s"]) / min(r["stage_compute_s"]) for r in records]
    return statistics.median(r["bubble"] for r in records), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    p, m = 2, 8
    print(f"pp{p}, m={m}: theory with equal stages {(p - 1) / (m + p - 1):.3f}; load {os.getloadavg()[0]:.1f}")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in PARTITIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in PARTITIONS:
                idle, ratio = measure(name, args.steps, Path(tmp) / f"round{rnd}")
                results[name].append((idle, ratio))
                print(f"round {rnd} {name:8s} idle share {idle:.3f}  busier/other stage compute {ratio:.2f}")
    print(f"medians over {args.rounds} rounds (load now {os.getloadavg()[0]:.1f}):")
    for name, rows in results.items():
        idle = statistics.median(r[0] for r in rows)
        ratio = statistics.median(r[1] for r in rows)
        print(f"  {name:8s} idle share {idle:.3f}  busier/other stage compute {ratio:.2f}")


if __name__ == "__main__":
    main()
