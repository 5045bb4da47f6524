"""What tracing costs (issue 56): the step time with tracing off, of untraced steps in a traced run, and of a traced
step, against each other and against the code before tracing existed, in one run of this script.

    .venv/bin/python bench/trace_overhead.py --baseline /tmp/p3d-base    # git archive <commit> p3d hydra_plugins

Each variant is a real ``p3d-train`` (run directory in a temp dir) of ``--steps`` steps, its ``metrics.jsonl``
``step_time_s`` the figure; the first ``--warmup`` steps are dropped:
- ``base``: the checkout given by ``--baseline`` (the same commands with that tree first on PYTHONPATH), no tracing;
- ``off``: this checkout, ``train.trace_steps`` empty (the default);
- ``on``: this checkout, every ``--every``-th step traced: its untraced steps, and its traced ones.
With ``--baseline``, first the wrappers' own cost on an untraced step: a torch stage's pass wrapped by this
checkout's ``TorchStageTimer`` and by the baseline's, around a pass that does nothing (best of 15 x 100,000 calls each,
alternating). Variants alternate over ``--rounds`` (base, off, on, on, off, base, ...) so the machine's load hits
each alike; each run's median step, the median of those per variant and its ratio to ``off`` are printed, per layout
(``--layouts``: the default dp2_pp2_tp2 on DeepSpeed's engine, and pp2 with torch's interleaved_1f1b).
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

LAYOUTS = {
    "dp2_pp2_tp2-1f1b": ("mesh=dp2_pp2_tp2",),
    "pp2-interleaved": ("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
}


def run(overrides: list[str], run_dir: Path, pythonpath: str | None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "p3d.cli", f"run.dir={run_dir}", "logger=none", *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wrapper_cost(baseline: str, calls: int = 100_000, repeats: int = 15) -> None:
    """ns per wrapped pass call, untraced: this checkout's step clocks against the baseline's (loaded by path)."""
    import importlib.util
    import time

    def timing_module(root: Path, name: str):
        spec = importlib.util.spec_from_file_location(name, root / "p3d" / "train" / "timing.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None):
            pass

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            pass

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            pass

    modules = {"base": timing_module(Path(baseline), "base_timing"), "this": timing_module(ROOT, "this_timing")}
    best = dict.fromkeys(modules, float("inf"))
    for _ in range(repeats):
        for name, module in modules.items():
            stage = Stage()
            timer = module.TorchStageTimer([stage])
            t0 = time.perf_counter()
            for i in range(calls):
                stage.forward_one_chunk(i, ())
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
            timer.take_compute()
    print(
        f"a wrapped pass, untraced: base {best['base'] * 1e9:.0f} ns, this {best['this'] * 1e9:.0f} ns "
        f"({(best['this'] - best['base']) * 1e9:+.0f} ns a call)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a tree of the code before tracing (p3d/ and hydra_plugins/)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="the on variant traces every N-th step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args(argv)
    if args.baseline:
        wrapper_cost(args.baseline)
    tmp = Path(tempfile.mkdtemp(prefix="p3d-trace-overhead-"))
    traced = list(range(args.every, args.steps + 1, args.every))
    variants = (["base"] if args.baseline else []) + ["off", "on"]
    for layout in args.layouts:
        times: dict[str, list[list[float]]] = {v: [] for v in [*variants, "on traced"]}  # per run, its steps
        order = [v for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
        for i, variant in enumerate(order):
            overrides = [*LAYOUTS[layout], f"train.steps={args.steps}"]
            if variant == "on":
                overrides.append(f"train.trace_steps=[{','.join(map(str, traced))}]")
            rows = run(overrides, tmp / f"{layout}-{i}-{variant}", args.baseline if variant == "base" else None)
            kept = rows[args.warmup :]
            times[variant].append([r["step_time_s"] for r in kept if variant != "on" or r["step"] not in traced])
            if variant == "on":
                times["on traced"].append([r["step_time_s"] for r in kept if r["step"] in traced])
        # a run's median step, then the median over its runs (a launch's placement moves a whole run)
        medians = {v: [statistics.median(run) for run in runs] for v, runs in times.items() if runs}
        off = statistics.median(medians["off"])
        print(f"{layout}: step_time_s, median over {args.rounds} runs of each run's median of steps past the warmup")
        for variant, values in medians.items():
            med = statistics.median(values)
            runs = " ".join(f"{v * 1e3:.1f}" for v in values)
            print(f"  {variant:10s} {med * 1e3:8.1f} ms  x{med / off:.3f} of off   runs (ms): {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
