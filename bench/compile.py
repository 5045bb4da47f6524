"""What ``model.compile=true`` gains on this CPU (issue 16): p3d ``mesh=single`` with and without
torch.compile of each block, alternating in rounds (ABBA), same model, data and seed.

    .venv/bin/python bench/compile.py                         # model=small, 128 tokens x 4 per step
    .venv/bin/python bench/compile.py --rounds 2 --steps 8 --set model.n_layers=4

Prints the median step time and worker CPU seconds per step of each side (the first ``--warmup``
steps of a run dropped: they include inductor's compilation), their ratio, the compile time (first
step's excess) and the largest per-step loss difference (compile changes how, not what: it must
stay within 1e-5 relative). The runs are those of bench/overhead.py plain (bench/_common.py: the same
monitor, the same environment).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import run_p3d_monitored, summarize, turns


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="first steps of each run left out (compilation)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, alternating ABBA")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=1800)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    base = ["model=small", "model.seq_len=128", "schedule.global_batch_size=4", "schedule.micro_batch_size=2"]
    base += [f"train.steps={args.steps}", "logger=none", *args.extra]
    sides = {"eager": ["model.compile=false"], "compiled": ["model.compile=true"]}
    runs: dict[str, list[list[dict]]] = {k: [] for k in sides}
    order = [name for _, name in turns(("eager", "compiled"), args.rounds)]
    with tempfile.TemporaryDirectory(prefix="p3d-bench-compile-") as tmp:
        for i, name in enumerate(order):
            records, secs = run_p3d_monitored([*base, *sides[name]], Path(tmp) / f"{i}-{name}", 1, args.timeout, False)
            runs[name].append(records)
            print(
                f"run {i + 1}/{len(order)} {name}: {secs:.0f} s, first step {records[0]['step_time_s']:.2f} s",
                flush=True,
            )
    tokens = 4 * 128
    summary = {name: summarize(r, args.warmup, tokens) for name, r in runs.items()}
    first = {name: statistics.median(run[0]["step_time_s"] for run in r) for name, r in runs.items()}
    loss_diff = max(
        abs(a["loss"] - b["loss"]) / abs(a["loss"])
        for ea, co in zip(runs["eager"], runs["compiled"], strict=True)
        for a, b in zip(ea, co, strict=True)
    )
    print(f"\n{'side':<10} {'median step s':>14} {'cpu s/step':>11} {'tokens/s':>10} {'first step s':>13}")
    for name, s in summary.items():
        cpu = s["median_cpu_s_per_step"]
        print(
            f"{name:<10} {s['median_step_s']:>14.4f} {cpu if cpu is None else round(cpu, 4)!s:>11} "
            f"{s['median_tokens_per_s']:>10.0f} {first[name]:>13.2f}"
        )
    e, c = summary["eager"], summary["compiled"]
    print(f"\ncompiled / eager tokens/s: {e['median_step_s'] / c['median_step_s']:.3f} (wall, median)")
    if e["median_cpu_s_per_step"] and c["median_cpu_s_per_step"]:
        print(
            f"compiled / eager by worker CPU s per step: {e['median_cpu_s_per_step'] / c['median_cpu_s_per_step']:.3f}"
        )
    print(f"compilation: first step {first['compiled'] - first['eager']:.1f} s longer")
    print(f"largest per-step loss difference, compiled vs eager: {loss_diff:.2e} (relative)")
    return 0 if loss_diff <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
