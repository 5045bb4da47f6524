"""The planner with a calibration file against measured step times on this machine (issue 36).

    .venv/bin/python bench/planner_accuracy.py                          # calibrate, then 8 + 3 layouts 3 times: ~40 min
    .venv/bin/python bench/planner_accuracy.py --calibration cal.json --only single dp2 --json out.json

1. Calibrate once (unless ``--calibration`` names a file): ``p3d-plan calibrate`` with the common overrides below and
   ``mesh=auto cluster.gpus_per_node=8``, so the probes cover the block shapes of every tp and recompute mode the
   layouts use, and collectives up to 8 ranks.
2. For each layout, predict with ``p3d-plan <overrides> format=json``, once without the file (the device table's
   nominal cpu rates: the "table" column, which the docs call no prediction) and once with ``calibration=``.
3. Measure with ``p3d-train <overrides> train.steps=<steps>``: the median ``step_time_s`` of ``metrics.jsonl`` over
   the steps after ``--warmup`` (default: steps 3-5). Run directories live in a temp dir, each deleted after its
   layout (the final checkpoint is written after the timed steps). Every layout is measured in ``--passes`` passes
   (default 3; every other one in the reverse order, so that a drift of the machine's speed weighs on every layout
   alike); the measured time is the median of the passes (with two, their mean), so that one slow stretch of the
   machine, such as the minutes after a calibration (docs/benchmarks.md), moves no layout's figure on its own. How
   far apart the passes measured a layout is printed as the run's repeatability: the machine's own noise, which no
   prediction can beat.

Common overrides: ``model=small model.seq_len=128 schedule.micro_batch_size=1 schedule.global_batch_size=8
train.dtype=fp32``: 1024 tokens a step. The eight layouts of the targets cover dp, tp and pp, both executors
(DeepSpeed's 1f1b, torch's interleaved), recompute none / selective / full, on one rank per core at most (1 and 2
ranks here). Three mixes of two and three dimensions (4 and 8 ranks) follow, apart: on 2 cores they time-share.
Printed: one row per layout (world, table, calibrated, measured, error = calibrated / measured - 1), the median
|error| and the worst, and the ranking: Kendall's tau between calibrated and measured, and the inverted pairs whose
measured times differ by more than 3 % (closer pairs are within this machine's noise: printed, not counted).
Targets (issue 36): median |error| <= 5 %, worst <= 10 %, the ranking equal. A benchmark, never a test: wall
times here move 10-30 % with the machine's load (the load average is printed before and after).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMON = (
    "model=small", "model.seq_len=128", "schedule.micro_batch_size=1", "schedule.global_batch_size=8",
    "train.dtype=fp32",
)  # fmt: skip
INTERLEAVED = ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2")
LAYOUTS: dict[str, tuple[str, ...]] = {  # one rank per core at most: the planner's domain (a rank per GPU)
    "single": ("mesh=single",),
    "dp2": ("mesh=dp2",),
    "dp2-full": ("mesh=dp2", "schedule.recompute=full"),
    "tp2": ("mesh=tp2",),
    "tp2-full": ("mesh=tp2", "schedule.recompute=full"),
    "pp2": ("mesh=pp2",),
    "pp2-int": ("mesh=pp2", *INTERLEAVED),
    "pp2-int-sel": ("mesh=pp2", *INTERLEAVED, "schedule.recompute=selective"),
}
# More ranks than this machine's 2 cores: the mixes of two and three dimensions. Measured and printed apart: ranks
# time-share a core there, which no GPU layout does, and the contention bound is a floor, not a model of it.
OVERSUBSCRIBED: dict[str, tuple[str, ...]] = {
    "dp2_pp2-sel": ("mesh=dp2_pp2", "schedule.recompute=selective"),
    "tp2_pp2-int-full": ("mesh=tp2_pp2", *INTERLEAVED, "schedule.recompute=full"),
    "dp2_pp2_tp2": ("mesh=dp2_pp2_tp2",),
}
CALIBRATE = (*COMMON, "mesh=auto", "cluster.gpus_per_node=8")
NOISE = 0.03  # measured times closer than this are not taken as an order
TIMEOUT_S = 1800


def command(module: str, *args: str, timeout: float = TIMEOUT_S) -> str:
    """Run ``python -m <module> <args>`` from the checkout; its stdout, or exit with its output's tail."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        sys.exit(f"{module} {' '.join(args)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def calibrate(path: Path) -> None:
    command("p3d.cli.plan", "calibrate", *CALIBRATE, f"calibration={path}")


def predicted(overrides: tuple[str, ...], calibration: Path | None) -> dict[str, Any]:
    """p3d-plan's JSON for the layout: step_time_s, layout.world_size, time_s (the breakdown), notes."""
    extra = (f"calibration={calibration}",) if calibration else ()
    return json.loads(command("p3d.cli.plan", *COMMON, *overrides, *extra, "format=json"))


KEPT = ("step_time_s", "dp_comm_s", "stage_compute_s", "bubble")  # of each step, into --json: where the time went


def step_records(metrics: Path) -> dict[int, dict[str, Any]]:
    """step -> the KEPT figures of a run's metrics.jsonl (step_time_s: the logging rank's wall time of each
    train_batch)."""
    out = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "step_time_s" in record and "step" in record:
            out[int(record["step"])] = {k: record[k] for k in KEPT if k in record}
    return out


def measured(overrides: tuple[str, ...], steps: int, warmup: int, where: Path) -> tuple[float, dict]:
    """Median step time of a p3d-train run over the steps after ``warmup``, and every step's KEPT figures; the run
    directory is removed."""
    run = where / "run"
    try:
        command("p3d.cli", *COMMON, *overrides, f"train.steps={steps}", f"run.dir={run}")
        records = step_records(run / "metrics.jsonl")
        kept = [r["step_time_s"] for step, r in sorted(records.items()) if step > warmup]
        if not kept:
            sys.exit(f"no step after the first {warmup} in {run / 'metrics.jsonl'}: {records}")
        return statistics.median(kept), records
    finally:
        shutil.rmtree(run, ignore_errors=True)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two lists of the same items: (concordant - discordant pairs) / all pairs."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    if not pairs:
        return 1.0
    score = sum(((a[i] - a[j]) * (b[i] - b[j]) > 0) - ((a[i] - a[j]) * (b[i] - b[j]) < 0) for i, j in pairs)
    return score / len(pairs)


def inverted_pairs(names: list[str], pred: list[float], meas: list[float], noise: float = NOISE):
    """(counted, within noise): the pairs the prediction orders the other way round from the measurement, split
    by whether their measured times differ by more than ``noise`` (relative to the faster one)."""
    counted, close = [], []
    for i, j in itertools.combinations(range(len(names)), 2):
        if (pred[i] - pred[j]) * (meas[i] - meas[j]) < 0:
            gap = abs(meas[i] - meas[j]) / min(meas[i], meas[j])
            (counted if gap > noise else close).append((names[i], names[j], gap))
    return counted, close


def summary(rows: list[dict[str, Any]], verdict: bool = True) -> list[str]:
    """The table and (``verdict``) the median, worst and ranking lines, from rows of name, world, table_s,
    calibrated_s, measured_s."""
    lines = [
        "| layout | ranks | table (s) | calibrated (s) | measured (s) | error | table error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        r["error"] = r["calibrated_s"] / r["measured_s"] - 1
        lines.append(
            f"| {r['name']} | {r['world']} | {r['table_s']:.2f} | {r['calibrated_s']:.2f} | {r['measured_s']:.2f} | "
            f"{r['error']:+.1%} | {r['table_s'] / r['measured_s'] - 1:+.1%} |"
        )
    if not verdict:
        return lines
    worst = max(rows, key=lambda r: abs(r["error"]))
    names = [r["name"] for r in rows]
    pred, meas = [r["calibrated_s"] for r in rows], [r["measured_s"] for r in rows]
    counted, close = inverted_pairs(names, pred, meas)
    lines += [
        "",
        f"median |error| {statistics.median(abs(r['error']) for r in rows):.1%}, worst {worst['name']} "
        f"{worst['error']:+.1%} (targets: 5%, 10%)",
        f"ranking: Kendall tau {kendall_tau(pred, meas):+.2f}; inverted pairs beyond {NOISE:.0%}: "
        + (", ".join(f"{a}/{b} ({g:.0%})" for a, b, g in counted) or "none")
        + "; within noise: "
        + (", ".join(f"{a}/{b} ({g:.1%})" for a, b, g in close) or "none"),
    ]
    return lines


def repeatability(rows: list[dict[str, Any]]) -> str:
    """How far apart the passes measured each layout (the largest over the smallest, less 1): this machine's own
    noise in one bench run, the closest a prediction can be expected to come."""
    spreads = sorted((max(r["passes_s"]) / min(r["passes_s"]) - 1, r["name"]) for r in rows)
    median = statistics.median(s for s, _ in spreads)
    return (
        f"repeatability: the passes measured a layout {median:.1%} apart (median), at most {spreads[-1][0]:.1%} "
        f"({spreads[-1][1]}); this machine's noise, the floor of the error"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--calibration", type=Path, help="an existing calibration file (else: calibrate first)")
    parser.add_argument("--only", nargs="+", choices=[*LAYOUTS, *OVERSUBSCRIBED], help="these layouts only")
    parser.add_argument("--no-oversubscribed", action="store_true", help="the layouts within the cores only")
    parser.add_argument(
        "--passes", type=int, default=3, help="times each layout is measured (every other pass backwards)"
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    names = args.only or [*LAYOUTS, *([] if args.no_oversubscribed else OVERSUBSCRIBED)]
    print(f"load {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; {', '.join(COMMON)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="p3d-accuracy-") as tmp:
        cal = args.calibration.resolve() if args.calibration else Path(tmp) / "cal.json"
        if not args.calibration:
            start = time.monotonic()
            calibrate(cal)
            print(
                f"calibrated in {time.monotonic() - start:.0f} s: p3d-plan calibrate {' '.join(CALIBRATE)}", flush=True
            )
            if args.json:
                shutil.copy(cal, args.json.with_suffix(".calibration.json"))
        rows = {}
        for name in names:
            overrides = {**LAYOUTS, **OVERSUBSCRIBED}[name]
            table, cal_plan = predicted(overrides, None), predicted(overrides, cal)
            rows[name] = {
                "name": name,
                "overrides": list(overrides),
                "world": cal_plan["layout"]["world_size"],
                "table_s": table["step_time_s"],
                "calibrated_s": cal_plan["step_time_s"],
                "passes_s": [],
                "steps": [],  # per pass: step -> its KEPT figures
                "breakdown": cal_plan["time_s"],
                "notes": cal_plan.get("notes", []),
            }
        for i in range(args.passes):
            for name in names if i % 2 == 0 else names[::-1]:  # every other pass backwards: a drift weighs alike
                seconds, records = measured(rows[name]["overrides"], args.steps, args.warmup, Path(tmp) / name)
                rows[name]["passes_s"].append(seconds)
                rows[name]["steps"].append(records)
                print(
                    f"pass {i + 1} {name}: calibrated {rows[name]['calibrated_s']:.2f} s, measured {seconds:.2f} s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    rows = [{**r, "measured_s": statistics.median(r["passes_s"])} for r in rows.values()]
    within = [r for r in rows if r["world"] <= (os.cpu_count() or 1)]
    print("\n".join(summary(within)))
    if args.passes > 1:
        print(repeatability(within))
    over = [r for r in rows if r not in within]
    if over:
        print("\nmore ranks than cores (outside the targets):")
        print("\n".join(summary(over, verdict=False)))
    print(f"load {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
