"""The picture of docs/timeline.md: one traced step of 1f1b, interleaved_1f1b and zbv on pp4 (issue 56).

    .venv/bin/python bench/schedule_timelines.py        # three p3d-train runs, then docs/img/timeline_pp4.png

Each schedule trains model=tiny with 8 layers on mesh=pp4, m = 8 micro batches of 1, for two steps and traces the
second (``train.trace_steps=[2]``; the first infers torch's shapes). Every Transformer block sleeps
``P3D_TEST_BLOCK_SECONDS`` (40 ms) in each of its forward, input-gradient and weight-gradient pieces
(p3d.train.block_seconds), so four processes on two cores run the timeline of four real stages: the picture shows
the schedules' own bubbles, not the machine's time-sharing. The three traces are drawn one above the other on one
time axis (p3d.launch.timeline), each titled with its measured bubble and the theory's; printed: the same figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2))
RUN = ("mesh=pp4", "model.n_layers=8", "schedule.micro_batch_size=1", "schedule.global_batch_size=8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "timeline_pp4.png")
    ap.add_argument("--block-seconds", type=float, default=0.04)
    args = ap.parse_args(argv)
    from p3d.launch.timeline import draw
    from p3d.rundir.files import trace_path
    from p3d.rundir.traces import read_trace

    tmp = Path(tempfile.mkdtemp(prefix="p3d-timelines-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "P3D_TEST_BLOCK_SECONDS": str(args.block_seconds)}
    traces, titles = [], []
    for name, v in SCHEDULES:
        run = tmp / name
        overrides = [*RUN, f"schedule.pipeline={name}", f"schedule.virtual_stages={v}", "train.steps=2"]
        cmd = [sys.executable, "-m", "p3d.cli", f"run.dir={run}", *overrides, "train.trace_steps=[2]", "logger=none"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        trace = read_trace(trace_path(run, 2))
        f = trace["otherData"]["p3d"]["figures"]
        label = f"{name}" + (f" v={v}" if v > 1 else "")
        line = f"measured bubble {f['bubble']:.1%} (theory {f['bubble_theory']:.1%}), step {f['step_time_s']:.2f} s"
        print(f"{label:20s} {line}")
        traces.append(trace)
        titles.append(f"{label} on pp4, m = 8, {args.block_seconds * 1e3:.0f} ms per block and piece: {line}")
    print(f"wrote {draw(traces, args.out, titles)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
