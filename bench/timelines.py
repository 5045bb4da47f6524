"""Traced steps (issue 56): the picture of docs/timeline.md, and what tracing costs a run.

    .venv/bin/python bench/timelines.py picture        # three p3d-train runs, then docs/img/timeline_pp4.png
    .venv/bin/python bench/timelines.py cost --baseline /tmp/p3d-base    # git archive <commit> p3d hydra_plugins

- ``picture``: one traced step of 1f1b, interleaved_1f1b and zbv on pp4, drawn one above the other;
- ``cost``: the step time with tracing off, of untraced and of traced steps, against the code before tracing.
``bench/timelines.py <command> --help`` says how each measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import add_command, bench_parser, p3d_train, run_command, turns  # noqa: E402

PICTURE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2))
PICTURE_RUN = ("mesh=pp4", "model.n_layers=8", "schedule.micro_batch_size=1", "schedule.global_batch_size=8")
COST_LAYOUTS = {
    "dp2_pp2_tp2-1f1b": ("mesh=dp2_pp2_tp2",),
    "pp2-interleaved": ("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
}


def picture(args) -> int:
    """The picture of docs/timeline.md: one traced step of 1f1b, interleaved_1f1b and zbv on pp4 (issue 56).

    Each schedule trains model=tiny with 8 layers on mesh=pp4, m = 8 micro batches of 1, for two steps and traces the
    second (``train.trace_steps=[2]``; the first infers torch's shapes). Every Transformer block sleeps
    ``P3D_TEST_BLOCK_SECONDS`` (40 ms) in each of its forward, input-gradient and weight-gradient pieces
    (p3d.train.block_seconds), so four processes on two cores run the timeline of four real stages: the picture shows
    the schedules' own bubbles, not the machine's time-sharing. The three traces are drawn one above the other on one
    time axis (p3d.launch.timeline), each titled with its measured bubble and the theory's; printed: the same figures.
    """
    from p3d.launch.timeline import draw
    from p3d.rundir.files import trace_path
    from p3d.rundir.traces import read_trace

    tmp = Path(tempfile.mkdtemp(prefix="p3d-timelines-"))
    env = {"OMP_NUM_THREADS": "1", "P3D_TEST_BLOCK_SECONDS": str(args.block_seconds)}
    traces, titles = [], []
    for name, v in PICTURE_SCHEDULES:
        run = tmp / name
        overrides = [*PICTURE_RUN, f"schedule.pipeline={name}", f"schedule.virtual_stages={v}", "train.steps=2"]
        p3d_train([*overrides, "train.trace_steps=[2]", "logger=none"], run, env, timeout=None)
        trace = read_trace(trace_path(run, 2))
        f = trace["otherData"]["p3d"]["figures"]
        label = f"{name}" + (f" v={v}" if v > 1 else "")
        line = f"measured bubble {f['bubble']:.1%} (theory {f['bubble_theory']:.1%}), step {f['step_time_s']:.2f} s"
        print(f"{label:20s} {line}")
        traces.append(trace)
        titles.append(f"{label} on pp4, m = 8, {args.block_seconds * 1e3:.0f} ms per block and piece: {line}")
    print(f"wrote {draw(traces, args.out, titles)}")
    return 0


def wrapper_cost(baseline: str, calls: int = 100_000, repeats: int = 15) -> None:
    """ns per wrapped pass call, untraced: this checkout's step clocks against the baseline's (loaded by path)."""
    import importlib.util

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
    print(f"a wrapped pass, untraced: base {best['base'] * 1e9:.0f} ns, this {best['this'] * 1e9:.0f} ns "
          f"({(best['this'] - best['base']) * 1e9:+.0f} ns a call)")  # fmt: skip


def cost(args) -> int:
    """What tracing costs (issue 56): the step time with tracing off, of untraced steps in a traced run, and of a
    traced step, against each other and against the code before tracing existed, in one run of this command.

    Each variant is a real ``p3d-train`` (run directory in a temp dir) of ``--steps`` steps, its ``metrics.jsonl``
    ``step_time_s`` the figure; the first ``--warmup`` steps are dropped:
    - ``base``: the checkout given by ``--baseline`` (the same commands with that tree first on PYTHONPATH), no tracing;
    - ``off``: this checkout, ``train.trace_steps`` empty (the default);
    - ``on``: this checkout, every ``--every``-th step traced: its untraced steps, and its traced ones.
    With ``--baseline``, first the wrappers' own cost on an untraced step: a torch stage's pass wrapped by this
    checkout's ``TorchStageTimer`` and by the baseline's, around a pass that does nothing (best of 15 x 100,000 calls
    each, alternating). Variants alternate over ``--rounds`` (base, off, on, on, off, base, ...) so the machine's load
    hits each alike; each run's median step, the median of those per variant and its ratio to ``off`` are printed, per
    layout (``--layouts``: the default dp2_pp2_tp2 on DeepSpeed's engine, and pp2 with torch's interleaved_1f1b).
    """
    if args.baseline:
        wrapper_cost(args.baseline)
    tmp = Path(tempfile.mkdtemp(prefix="p3d-trace-overhead-"))
    traced = list(range(args.every, args.steps + 1, args.every))
    variants = (["base"] if args.baseline else []) + ["off", "on"]
    for layout in args.layouts:
        times: dict[str, list[list[float]]] = {v: [] for v in [*variants, "on traced"]}  # per run, its steps
        for i, (_, variant) in enumerate(turns(variants, args.rounds)):
            overrides = [*COST_LAYOUTS[layout], f"train.steps={args.steps}", "logger=none"]
            if variant == "on":
                overrides.append(f"train.trace_steps=[{','.join(map(str, traced))}]")
            env = {"OMP_NUM_THREADS": "1", **({"PYTHONPATH": args.baseline} if variant == "base" else {})}
            rows = p3d_train(overrides, tmp / f"{layout}-{i}-{variant}", env, None, Path(tempfile.gettempdir()))
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


def parser() -> argparse.ArgumentParser:
    ap, commands = bench_parser(__doc__)
    p = add_command(commands, picture)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "timeline_pp4.png")
    p.add_argument("--block-seconds", type=float, default=0.04)

    p = add_command(commands, cost)
    p.add_argument("--baseline", help="a tree of the code before tracing (p3d/ and hydra_plugins/)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--every", type=int, default=5, help="the on variant traces every N-th step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", nargs="*", default=list(COST_LAYOUTS), choices=list(COST_LAYOUTS))
    return ap


if __name__ == "__main__":
    sys.exit(run_command(parser()))
